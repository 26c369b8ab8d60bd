"""Cost of keeping a pool fresh: CPU that epp's metrics scraper spends per endpoint-second.

Endpoints serve the real vLLM 0.32 /metrics page (``../shared/vllm``, 56 KB, ~690 lines) from
another process (bench/harness.py: a raw asyncio server answering every GET with the same
bytes). This process runs epp's ``MetricsScraper`` at default settings against 8 / 64 / 256 of
them and reads its own CPU time over a window: first fetching the whole page (the baseline, as
before epp asked for less), then only the families epp reads (``?name[]=...``, the default).

    ./run bench scrape [--seconds 5] [--endpoints 8,64,256]

Skips (exit 0, with a message) when ``../shared/vllm`` is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import PAGE, ints, start_pages, stop, table  # noqa: E402


async def epp_scraper(ports: list[int], seconds: float, full_page: bool) -> tuple[float, float]:
    """(cores, scrapes per second) of epp's scraper at default settings (``full_page``:
    without asking for only the families epp reads)."""
    from prometheus_client import CollectorRegistry

    from epp.datastore.scraper import MetricsScraper, ScrapeOptions
    from epp.datastore.store import Datastore
    from epp.framework.endpoint import Endpoint, endpoint_id
    from epp.observability.metrics import EppMetrics

    ds = Datastore()
    ds.replace_all([Endpoint(endpoint_id("127.0.0.1", p), "127.0.0.1", p) for p in ports])
    metrics = EppMetrics(CollectorRegistry())
    scraper = MetricsScraper(ds, metrics, ScrapeOptions(families_only=not full_page))
    await scraper.start()
    try:
        await asyncio.sleep(1.0)  # connections open, scrapes spread over the period
        n0, c0, w0 = metrics.scrapes._value.get(), time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        n1, c1, w1 = metrics.scrapes._value.get(), time.process_time(), time.monotonic()
    finally:
        await scraper.stop()
    errors = sum(s.value for m in metrics.registry.collect() if m.name == "epp_scrape_errors"
                 for s in m.samples if s.name.endswith("_total"))  # fmt: skip
    if errors:
        print(f"  ({errors:.0f} scrape errors)")
    return (c1 - c0) / (w1 - w0), (n1 - n0) / (w1 - w0)


async def bench(sizes: list[int], seconds: float) -> None:
    from epp.datastore.scraper import ScrapeOptions

    opts = ScrapeOptions()
    print(f"scrape bench: real vLLM page ({PAGE.stat().st_size / 1024:.0f} KB), default settings "
          f"(interval {opts.interval_s * 1e3:.0f} ms, budget {opts.budget_per_s:.0f} scrapes/s), "
          f"keep-alive, {seconds:g} s windows, {os.cpu_count()} CPUs shared with other work")
    proc, ports = start_pages(max(sizes))
    rows, per_scrape, per_endpoint = [], {}, {}
    try:
        for full in (True, False):
            for n in sizes:
                cores, rate = await epp_scraper(ports[:n], seconds, full_page=full)
                per_endpoint[(full, n)], per_scrape[(full, n)] = cores / n, cores / rate if rate else float("nan")
                rows.append(["whole page" if full else "families epp reads (default)", n, f"{rate:.0f}",
                             f"{n / rate * 1e3 if rate else float('inf'):.0f}", f"{cores:.3f}",
                             f"{cores / rate * 1e6 if rate else 0:.0f}", f"{cores / n * 1e6:.0f}"])  # fmt: skip
    finally:
        stop([proc])
    print(table(["page", "endpoints", "scrapes/s", "period ms", "cores", "us a scrape",
                 "CPU us per endpoint-s"], rows))  # fmt: skip
    print("families only / whole page, CPU a scrape: " + ", ".join(
        f"{n} endpoints {per_scrape[(False, n)] / per_scrape[(True, n)]:.2f}x" for n in sizes))
    if 64 in sizes:
        print(f"target: 64 endpoints <= 0.15 of a core -> {per_endpoint[(False, 64)] * 64:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--endpoints", type=ints, default=[8, 64, 256])
    args = ap.parse_args()
    if not PAGE.exists():
        print(f"skipped: {PAGE} not found (the real vLLM page lives in ../shared/vllm)")
        return
    asyncio.run(bench(args.endpoints, args.seconds))


if __name__ == "__main__":
    main()
