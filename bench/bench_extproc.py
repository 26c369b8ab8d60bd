"""ext_proc throughput and added latency without Envoy: `epp serve` vs a no-op ext_proc server.

One grpc.aio client drives both as Envoy does in FULL_DUPLEX_STREAMED mode: request headers,
the body in two chunks, response headers and a JSON body with ``usage`` (``--sse-events N``: a
streamed chat answer of N events, one message each). The no-op server (bench/harness.py)
answers with no parsing and no scheduling, so the difference is what epp adds. epp serves 32
endpoints serving the real vLLM /metrics page from another process, scraped at default
settings; 16 KB mixed-script prompts from 64 shared prefixes. Latency: from the request
headers to the routing reply (what Envoy waits before it forwards). Rounds alternate the
servers and which goes first, the other paused (SIGSTOP); medians, throughput ratios also
paired round by round, CPU per request of the server (/proc) and the client (this process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import PAGE, ints, only, pct, prompts, start_noop, start_pages, stop, table  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "théta", "日本")
USAGE = {"prompt_tokens": 4000, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 3000}}  # fmt: skip


def sse_events(n: int) -> list[bytes]:
    """A chat completion streamed as vLLM streams it: one ``data:`` event per token, the last
    with ``usage`` (``stream_options.include_usage``), then ``[DONE]``."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    tokens = [{"index": 0, "delta": {"content": f" w{i}"}} for i in range(n)]
    out = [json.dumps({**chunk, "choices": [t]}) for t in tokens]
    if out:  # the usage rides with the last token's event
        out[-1] += "\n\ndata: " + json.dumps({"choices": [], "usage": USAGE}) + "\n\ndata: [DONE]"
    return [f"data: {e}\n\n".encode() for e in out]


async def drive(port: int, bodies: list[bytes], conc: int, sse: int) -> tuple[float, list[float]]:
    """(streams a second, each stream's time to its routing reply); ``sse``: 0, each reply is
    one JSON body; N, an SSE stream of N events, one chunk each, each answered before the next."""
    import grpc

    from tests.integration import envoy_client as ec

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await channel.channel_ready()
    answer = json.dumps({"choices": [{"text": "ok"}], "usage": USAGE}).encode()
    events = sse_events(sse)
    latencies: list[float] = []
    queue = list(reversed(bodies))

    async def one(body: bytes) -> None:
        s = ec.Stream(channel)
        half = len(body) // 2
        t0 = time.perf_counter()
        first, rest = ec.request_body(body[:half], False), ec.request_body(body[half:], True)
        await s.send(ec.request_headers(), first, rest)
        await s.recv()
        latencies.append(time.perf_counter() - t0)
        await s.recv()
        if events:
            await s.send(ec.response_headers(content_type="text/event-stream"))
            await s.recv()
            for i, event in enumerate(events):
                await s.send(ec.response_body(event, i == len(events) - 1))
                await s.recv()
        else:
            await s.send(ec.response_headers(), ec.response_body(answer, True))
            await s.recv_n(2)
        await s.call.done_writing()
        await s.call.code()

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return len(bodies) / elapsed, latencies


async def bench(args: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, float]]]:
    from simulator.eppproc import EppProcess
    from simulator.stack.cpu import cpu_ns

    bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": 16}, ensure_ascii=False).encode()
              for p in prompts(args.requests, 16 * 1024, words=WORDS)]  # fmt: skip
    pages, ports = start_pages(32)
    noop, noop_port = start_noop(["10.0.0.1:8000"])
    log = Path(tempfile.mkdtemp(prefix="bench-extproc-")) / "epp.log"
    extra = ("--log-level", "error", *(("--config", args.config) if args.config else ()))
    epp = EppProcess([f"127.0.0.1:{p}" for p in ports], log, extra=extra)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        await epp.start()
        servers = {"noop": (noop.pid, noop_port), "epp": (epp.pid, epp.grpc_port)}
        for _, port in servers.values():
            await drive(port, bodies[:200], 4, 0)
        for r, c in ((r, c) for r in range(args.rounds) for c in args.concurrency):
            # who goes first alternates: with a fixed order, two identical no-op servers
            # measured back to back read 0.90 at concurrency 1
            for kind, (pid, port) in list(servers.items())[:: -1 if r % 2 else 1]:
                only([pid], [p for p, _ in servers.values()])
                # a resumed epp first rescrapes and catches up
                await drive(port, bodies[:100], 4, 0)
                s0, c0 = cpu_ns(pid), os.times()
                rps, lat = await drive(port, bodies, c, args.sse_events)
                s1, c1 = cpu_ns(pid), os.times()
                client = c1.user + c1.system - c0.user - c0.system
                runs.setdefault((kind, c), []).append({
                    "rps": rps, "p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3,
                    "server_cpu": (s1 - s0) / 1e3 / len(bodies), "client_cpu": client * 1e6 / len(bodies)})  # fmt: skip
    finally:
        await epp.stop()
        stop([noop, pages])
    return runs


def report(args: argparse.Namespace, runs: dict[tuple[str, int], list[dict[str, float]]]) -> None:
    def m(kind: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[(kind, c)])

    how = f", epp --config {args.config}" if args.config else ""
    how += f", replies streamed as {args.sse_events} SSE events" if args.sse_events else ""
    print(f"ext_proc bench: 32 endpoints serving the real vLLM page, scraped{how}; 16 KB prompts, "
          f"{args.requests} requests x {args.rounds} rounds per cell (medians), python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs shared with other work")  # fmt: skip
    keys = ("rps", "p50", "p99", "server_cpu", "client_cpu")
    rows = [[kind, c, *(f"{m(kind, c, k):.{3 if k[0] == 'p' else 0}f}" for k in keys)]
            for c in args.concurrency for kind in ("noop", "epp")]  # fmt: skip
    head = ["server", "concurrency", "req/s", "p50 ms", "p99 ms", "server CPU us a request"]
    head.append("client CPU us a request")
    print(table(head, rows))
    for c in args.concurrency:
        # each round's pair ran back to back, so its ratio cancels most of the machine's drift
        pairs = zip(runs[("noop", c)], runs[("epp", c)], strict=True)
        paired = statistics.median(e["rps"] / n["rps"] for n, e in pairs)
        print(f"concurrency {c:>2}: epp/noop throughput {m('epp', c, 'rps') / m('noop', c, 'rps'):.2f} "
              f"(target >= 0.80; paired {paired:.2f}), added p50 {m('epp', c, 'p50') - m('noop', c, 'p50'):.3f} ms"
              + (" (target <= 0.3 ms)" if c == 1 else "")
              + f", added p99 {m('epp', c, 'p99') - m('noop', c, 'p99'):.3f} ms")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=ints, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per server and concurrency")
    ap.add_argument("--sse-events", type=int, default=0, metavar="N", help="N SSE events a reply")
    ap.add_argument("--config", default="", metavar="FILE", help="as epp serve --config FILE")
    args = ap.parse_args()
    if not PAGE.exists():
        print(f"skipped: {PAGE} not found (the real vLLM page lives in ../shared/vllm)")
        return
    report(args, asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
