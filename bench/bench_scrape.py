"""Cost of keeping a pool fresh: CPU that epp's metrics scraper spends per endpoint-second.

Endpoints serve the real vLLM 0.32 /metrics page (``../shared/vllm/metrics-vllm-cpu-0.32.txt``,
56 KB, ~690 lines) from a separate process (a raw asyncio server that answers every GET with
the same bytes, so the server's own cost stays out of this process). This process runs epp's
``MetricsScraper`` at default settings against 8 / 64 / 256 of them and reads its own CPU
time (``time.process_time``) over a window.

Baseline, in the same process: a general HTTP client (an ``aiohttp.ClientSession`` with a
kept-alive connection, decoding the page to text) fetching the same page, and the parser epp
used before this benchmark existed (text search over the decoded page). It prints the
baseline's CPU per scrape next to epp's.

    python bench/bench_scrape.py [--seconds 5] [--endpoints 8,64,256] [--close]

``--close``: the server closes the connection after each answer (no keep-alive).
Skips (exit 0, with a message) when ``../shared/vllm`` is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT.parent / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"


# --- the page server (a subprocess) -----------------------------------------------------


async def serve(page_path: str, n: int, close: bool) -> None:
    from urllib.parse import parse_qs

    from simulator.emulator.metrics import restrict_page

    page = Path(page_path).read_bytes()
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    head += b"Connection: close\r\n" if close else b""
    answers: dict[bytes, bytes] = {}

    def answer_for(request: bytes) -> bytes:
        target = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
        answer = answers.get(target)
        if answer is None:
            query = parse_qs(target.partition(b"?")[2].decode())
            body = restrict_page(page, set(query["name[]"])) if "name[]" in query else page
            answer = answers[target] = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        return answer

    class Page(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: asyncio.Transport = transport  # type: ignore[assignment]
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while b"\r\n\r\n" in self.buf:
                request, _, self.buf = self.buf.partition(b"\r\n\r\n")
                self.transport.write(answer_for(request))
                if close:
                    self.transport.close()
                    return

    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(n):
        server = await loop.create_server(Page, "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
    print(",".join(map(str, ports)), flush=True)
    await asyncio.Event().wait()


def start_pages(n: int, close: bool) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(n)] + (["--close"] if close else []),
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split(",")]


# --- measurements -----------------------------------------------------------------------


async def epp_scraper(
    ports: list[int], seconds: float, full_page: bool = False
) -> tuple[float, float]:
    """(cores, scrapes per second) of epp's scraper at default settings (``full_page``:
    without asking for only the families epp reads, as before ``?name[]=``)."""
    from prometheus_client import CollectorRegistry

    from epp.datastore.scraper import MetricsScraper
    from epp.datastore.store import Datastore
    from epp.framework.endpoint import Endpoint, endpoint_id
    from epp.observability.metrics import EppMetrics

    ds = Datastore()
    ds.replace_all([Endpoint(endpoint_id("127.0.0.1", p), "127.0.0.1", p) for p in ports])
    metrics = EppMetrics(CollectorRegistry())
    from epp.datastore.scraper import ScrapeOptions

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


async def per_scrape(port: int, count: int) -> tuple[float, float]:
    """CPU seconds per scrape, one endpoint, back to back: (epp, baseline)."""
    import aiohttp

    from epp.datastore.metricsparse import VLLM, PageParser
    from epp.datastore.pagefetch import PageFetcher

    old = _old_parser()
    fetcher = PageFetcher("127.0.0.1", port)
    parser = PageParser(VLLM)
    url = f"http://127.0.0.1:{port}/metrics"
    results = {"epp": 0.0, "baseline": 0.0}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # interleaved rounds: machine noise hits both alike
            t0 = time.process_time()
            for _ in range(count):
                parser.parse(await fetcher.fetch(1.0), 1.0)
            results["epp"] += time.process_time() - t0
            t0 = time.process_time()
            for _ in range(count):
                async with session.get(url) as resp:
                    old(await resp.text())
            results["baseline"] += time.process_time() - t0
    fetcher.close()
    return results["epp"] / (3 * count), results["baseline"] / (3 * count)


def _old_parser() -> object:
    """The parser epp shipped before (text search over the decoded page, labels by regex on
    every scrape), kept here as the baseline."""
    import re

    label = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

    def samples(text: str, name: str) -> list[tuple[str, float]]:
        out = []
        needle = "\n" + name
        pos = text.find(needle)
        while pos >= 0:
            end = text.find("\n", pos + 1)
            line = text[pos + 1 + len(name) : end if end >= 0 else None]
            labels = ""
            if line[:1] == "{":
                close = line.rfind("}")
                labels, line = line[1:close], line[close + 1 :]
            if line[:1] in (" ", "\t"):
                out.append((labels, float(line.split()[0])))
            pos = text.find(needle, end) if end >= 0 else -1
        return out

    def parse(text: str) -> tuple[float, ...]:
        waiting = sum(v for _, v in samples(text, "vllm:num_requests_waiting"))
        running = sum(v for _, v in samples(text, "vllm:num_requests_running"))
        kv = max((v for _, v in samples(text, "vllm:kv_cache_usage_perc")), default=0.0)
        samples(text, "vllm:lora_requests_info")
        cc = samples(text, "vllm:cache_config_info")
        labels = dict(label.findall(cc[0][0])) if cc else {}
        return waiting, running, kv, float(labels.get("num_gpu_blocks", 0))

    return parse


async def bench(sizes: list[int], seconds: float, close: bool) -> None:
    from epp.datastore.scraper import ScrapeOptions

    opts = ScrapeOptions()
    print(f"scrape bench: real vLLM page ({PAGE.stat().st_size / 1024:.0f} KB), default settings "
          f"(interval {opts.interval_s * 1e3:.0f} ms, budget {opts.budget_per_s:.0f} scrapes/s), "
          f"{'server closes after each answer' if close else 'keep-alive'}, "
          f"{seconds:.0f} s windows, {os.cpu_count()} CPUs shared with other work")
    proc, ports = start_pages(max(sizes), close)
    try:
        if not close:
            epp_s, base_s = await per_scrape(ports[0], 300)
            print(f"one scrape (fetch + parse), back to back: epp {epp_s * 1e6:.0f} us CPU, "
                  f"baseline (aiohttp + text parse) {base_s * 1e6:.0f} us: "
                  f"{base_s / epp_s:.1f}x less CPU")
        print(f"{'endpoints':>9} {'scrapes/s':>10} {'period ms':>10} {'cores':>7} "
              f"{'us/scrape':>10} {'CPU us per endpoint-s':>22}")
        for full in (True, False):
            print("whole page (56 KB)" if full else
                  "families epp reads only (?name[]=..., the default: 1.7 KB)")  # fmt: skip
            for n in sizes:
                cores, rate = await epp_scraper(ports[:n], seconds, full_page=full)
                period = n / rate if rate else float("inf")
                print(f"{n:>9} {rate:>10.0f} {period * 1e3:>10.0f} {cores:>7.3f} "
                      f"{cores / rate * 1e6 if rate else 0:>10.0f} {cores / n * 1e6:>22.0f}")
                if n == 64 and not full:
                    print(f"{'':>9} target: 64 endpoints <= 0.15 of a core -> {cores:.3f}")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--close", action="store_true", help="server closes after each answer")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--endpoints", default="8,64,256")
    args = ap.parse_args()
    if not PAGE.exists():
        print(f"skipped: {PAGE} not found (the real vLLM page lives in ../shared/vllm)")
        return
    if args.serve:
        asyncio.run(serve(str(PAGE), args.serve, args.close))
        return
    asyncio.run(bench([int(n) for n in args.endpoints.split(",")], args.seconds, args.close))


if __name__ == "__main__":
    main()
