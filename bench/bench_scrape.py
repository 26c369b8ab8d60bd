"""Cost of keeping a pool fresh: CPU that epp's metrics scraper spends per endpoint-second.

Endpoints serve the real vLLM 0.32 /metrics page (``../shared/vllm``, 56 KB, ~690 lines) from
another process (bench/harness.py). This process runs epp's ``MetricsScraper`` at default
settings against 8 / 64 / 256 of them and reads its own CPU time over a window: first fetching
the whole page (the baseline), then only the families epp reads (``?name[]=...``, the default).
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

from bench.harness import PAGE, ints, start_pages, stop  # noqa: E402
from bench.results import table  # noqa: E402


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
    assert n1 > n0, f"no scrape of {len(ports)} endpoints succeeded"
    return (c1 - c0) / (w1 - w0), (n1 - n0) / (w1 - w0)


async def bench(sizes: list[int], seconds: float) -> None:
    from epp.datastore.scraper import ScrapeOptions

    opts = ScrapeOptions()
    print(f"scrape bench: real vLLM page ({PAGE.stat().st_size / 1024:.0f} KB), default settings "
          f"(interval {opts.interval_s * 1e3:.0f} ms, budget {opts.budget_per_s:.0f} scrapes/s), "
          f"keep-alive, {seconds:g} s windows, {os.cpu_count()} CPUs shared with other work")  # fmt: skip
    proc, ports = start_pages(max(sizes))
    rows: list[list[object]] = []
    cpu: dict[tuple[bool, int], tuple[float, float]] = {}  # by (whole page, endpoints)

    def us(full: bool, n: int) -> float:  # CPU a scrape (epp_scraper asserts rate > 0)
        cores, rate = cpu[(full, n)]
        return cores / rate * 1e6

    try:
        for full, n in ((full, n) for full in (True, False) for n in sizes):
            cores, rate = cpu[(full, n)] = await epp_scraper(ports[:n], seconds, full_page=full)
            page = "whole page" if full else "families epp reads (default)"
            rows.append([page, n, f"{rate:.0f}", f"{n / rate * 1e3:.0f}", f"{cores:.3f}", f"{us(full, n):.0f}",
                         f"{cores / n * 1e6:.0f}"])
    finally:
        stop([proc])
    print(table(["page", "endpoints", "scrapes/s", "period ms", "cores", "us a scrape", "CPU us per endpoint-s"], rows))
    ratios = (f"{n} endpoints {us(False, n) / us(True, n):.2f}x" for n in sizes)
    print("families only / whole page, CPU a scrape: " + ", ".join(ratios))
    if 64 in sizes:
        print(f"target: 64 endpoints <= 0.15 of a core -> {cpu[(False, 64)][0]:.3f}")


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
