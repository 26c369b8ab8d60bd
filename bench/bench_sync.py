"""What index sync between epp replicas buys, in the replay and (``--live``) through real Envoy.

The profile sweep's (bench_profiles.py) replayer, workloads and default profile, with R
routers (arrival i through router i mod R) and index sync off, "index only" (each router's
prefix-index writes reach the others ``--sync-flush-ms`` later) or on (its prefill in flight too:
the predicted-TTFT scorer's uncached prompt tokens sent and not yet answered), as ``epp serve
--peers`` sends them: each workload at its multi-router point, one router and each R in
``--epp-replicas``; then the sync delay swept on conversations at the largest R.

``--live``: the sweep's RAG 4/s point (4,096 KV blocks a server, 4 routers) sent by ``epp-sim
load`` through real Envoy to 4 epp replicas and 4 emulated servers at real time (512
requests, ~2 minutes a run): no sync, index only (``--no-sync-prefill``) and sync as shipped,
each on fresh servers, per ``--live-seeds`` seed, beside the same seeds replayed. Live
figures: the client's TTFT and the servers' prefix-cache hit rate from their ``usage``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import Point, config_of, grid, pool_map, replay, workload_of  # noqa: E402
from bench.harness import count, ints  # noqa: E402
from bench.stats import describe  # noqa: E402

Job = tuple[Point, int, float | None, int, bool, bool]
"""(point, routers, sync delay in ms or None for off, seed, quick, share the prefill)."""


def run_one(job: Job) -> tuple[Job, float, float, float]:
    point, routers, sync_ms, seed, quick, prefill = job
    cfg = dataclasses.replace(config_of(point, seed), routers=routers, sync_prefill=prefill,
                              sync_delay_s=None if sync_ms is None else sync_ms / 1e3)  # fmt: skip
    s = replay(cfg, workload_of(point, quick, seed), "epp")
    return job, s.hit_rate, s.ttft_p50_s, s.ttft_p90_s


LIVE_POINT = Point("rag", 4, 4096, 4, routers=4)
SETUPS = (("no sync", False, False), ("index only", True, False), ("sync", True, True))


async def live_run(sync: bool, prefill: bool, seed: int) -> Any:
    from simulator.load import LoadOptions, run_load, summarize
    from simulator.stack.stack import StackOptions, start_stack

    p = LIVE_POINT
    stack = await start_stack(StackOptions(replicas=p.replicas, kv_blocks=p.kv_blocks, epp_replicas=p.routers,
                                           sync=sync, sync_prefill=prefill, ready_timeout_s=120))  # fmt: skip
    try:
        return summarize(await run_load(stack.gateway_url, workload_of(p, False, seed), LoadOptions(stack.options.model)))
    finally:
        await stack.stop()


def live_table(seeds: int, sync_ms: float) -> None:
    p = LIVE_POINT
    print(f"\n## live: {p.label}, {len(workload_of(p, False, 0))} requests, {p.replicas} emulated servers, "
          f"{p.routers} epp replicas behind real Envoy (replay: {p.routers} routers), the default profile\n")
    print("| seed | set-up | live ok | live hit | live TTFT p50 | live TTFT p90 | replay hit | replay TTFT p50 "
          "| replay TTFT p90 |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seed in range(seeds):
        for label, sync, prefill in SETUPS:
            got = asyncio.run(live_run(sync, prefill, seed))
            _, hit, p50, p90 = run_one((p, p.routers, sync_ms if sync else None, seed, False, prefill))
            print(f"| {seed} | {label} | {got.ok} | {got.hit_rate:.1%} | {got.ttft_p50_s:.3f} | {got.ttft_p90_s:.3f} "
                  f"| {hit:.1%} | {p50:.3f} | {p90:.3f} |", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="conversations only, smaller; R = 4 and delays 0, 200, 5000 ms (and --sync-flush-ms) "
                    "in place of --epp-replicas and --delays-ms")
    ap.add_argument("--seeds", type=count, default=3, help="seeds per cell (3)")
    ap.add_argument("--epp-replicas", type=ints, default="2,4,8", help="epp replica counts, comma-separated (2,4,8)")
    ap.add_argument("--sync-flush-ms", type=float, default=20.0,
                    help="the sync delay of the main table, ms (20: epp's default flush period)")
    ap.add_argument("--delays-ms", type=lambda t: [float(d) for d in t.split(",") if d.strip()],
                    default="0,20,200,1000,5000", help="the delays swept on conversations at the largest R, ms")
    ap.add_argument("--live", action="store_true", help="also run RAG 4/s live, per set-up (~2 minutes each)")
    ap.add_argument("--live-seeds", type=count, default=2, help="live: workload draws (2)")
    args = ap.parse_args()
    counts, delays = sorted(set(args.epp_replicas)), args.delays_ms
    if min(counts, default=0) < 2 or min([args.sync_flush_ms, *delays]) < 0:
        ap.error("--epp-replicas: 2 or more each; delays >= 0")
    if args.quick:
        counts, delays, points = [4], [0.0, 200.0, 5000.0], [Point("chat", 8, 2048, 4)]
    else:
        full = grid(["chat", "rag", "shared-prefix", "mooncake"], False)
        points = [dataclasses.replace(p, routers=1) for p in full if p.routers > 1]
    seeds = range(args.seeds)
    chat = points[0]
    jobs: list[Job] = [(p, 1, None, s, args.quick, True) for p in points for s in seeds]
    jobs += [(p, r, sync, s, args.quick, prefill) for p in points for r in counts
             for sync, prefill in ((None, True), (args.sync_flush_ms, False), (args.sync_flush_ms, True))
             for s in seeds]  # fmt: skip
    jobs += [(chat, counts[-1], d, s, args.quick, True) for d in delays if d != args.sync_flush_ms for s in seeds]
    results = {job: (hit, p50, p90) for job, hit, p50, p90 in pool_map(run_one, jobs)}

    def cell(p: Point, r: int, sync: float | None, prefill: bool = True) -> list[tuple[float, float, float]]:
        return [results[(p, r, sync, s, args.quick, prefill)] for s in seeds]

    def summary(rows: list[tuple[float, float, float]]) -> str:
        return (f"{100 * statistics.mean(h for h, _, _ in rows):5.1f}% "
                f"{statistics.median(a for _, a, _ in rows):6.2f} {statistics.median(b for _, _, b in rows):6.2f}")

    print(f"# index sync between epp replicas, in the replay: the default profile, {args.seeds} seed(s), "
          f"sync delay {args.sync_flush_ms:g} ms")
    print("hit rate (servers' prefix-cache hits, mean) / TTFT p50 / p90 (s, medians); the last column:")
    print("p90 with sync over without, seed by seed\n")
    print(f"{'point':<40} {'routers':>7} | {'no sync: hit   p50    p90':>25} | {'index only: hit p50    p90':>26} "
          f"| {'sync: hit   p50    p90':>22} | p90 sync / no sync")
    for p in points:
        label = f"{p.label} ({p.replicas} replicas)"
        print(f"{label:<40} {1:>7} | {summary(cell(p, 1, None)):>25} | {'(one router)':>26} | {'':>22} |")
        for r in counts:
            off, index, on = cell(p, r, None), cell(p, r, args.sync_flush_ms, False), cell(p, r, args.sync_flush_ms)
            said = describe([v[2] for v in on], [v[2] for v in off], "no sync")
            print(f"{'':<40} {r:>7} | {summary(off):>25} | {summary(index):>26} | {summary(on):>22} | {said}")
    print(f"\nthe sync delay, {chat.label}, {counts[-1]} routers:")
    base = cell(chat, counts[-1], None)
    print(f"  {'no sync':>10} | {summary(base)}")
    for d in sorted({*delays, args.sync_flush_ms}):
        rows = cell(chat, counts[-1], d)
        print(f"  {d:>7g} ms | {summary(rows)} | p90 over no sync {describe([v[2] for v in rows], [v[2] for v in base], 'no sync')}")
    if args.live:
        live_table(1 if args.quick else args.live_seeds, args.sync_flush_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
