"""Index sync live (docs/sync.md): the replay's RAG workload sent by ``epp-sim load`` through
real Envoy to 4 epp replicas and 4 emulated servers, without sync, with the index writes
alone (``--no-sync-prefill``) and with sync as shipped (index writes and prefill in flight),
beside the same seeds replayed offline with 4 routers (``bench_sync.py``'s model of it).

The point is the sweep's RAG 4/s with 4,096 KV blocks a server and 4 routers, where the
replay finds the routers colliding on the servers that hold popular documents until they
share their prefill in flight. Emulated GPUs at real time; each run is 512 requests at 4 a
second (~2 minutes); figures: the client's TTFT p50 / p90 (to the first text chunk) and the
servers' prefix-cache hit rate from their ``usage``. Each seed draws its own documents and
arrivals; the three set-ups run one after the other on fresh servers.

Run: ./run bench sync_live [--record] [--seeds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import Point, workload_of  # noqa: E402
from bench.bench_sync import run_one  # noqa: E402
from simulator.load import LoadOptions, run_load, summarize  # noqa: E402
from simulator.stack.stack import StackOptions, start_stack  # noqa: E402

POINT = Point("rag", 4, 4096, 4, routers=4)
SETUPS = (("no sync", False, False), ("index only", True, False), ("sync", True, True))
SYNC_MS = 20.0


async def live(sync: bool, prefill: bool, seed: int) -> tuple[float, float, float, int]:
    stack = await start_stack(StackOptions(
        replicas=POINT.replicas, kv_blocks=POINT.kv_blocks, epp_replicas=POINT.routers,
        sync=sync, sync_prefill=prefill, ready_timeout_s=120,
    ))  # fmt: skip
    try:
        workload = workload_of(POINT, False, seed)  # the trace bench_sync.py replays
        sent = await run_load(stack.gateway_url, workload, LoadOptions(stack.options.model))
    finally:
        await stack.stop()
    s = summarize(sent)
    return s.hit_rate, s.ttft_p50_s, s.ttft_p90_s, s.ok


def replay(sync: bool, prefill: bool, seed: int) -> tuple[float, float, float]:
    _, hit, p50, p90 = run_one((POINT, POINT.routers, SYNC_MS if sync else None, seed, False, prefill))
    return hit, p50, p90


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2, help="workload draws (2)")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds: 1 or more")
    print(f"# {POINT.label}: {len(workload_of(POINT, False, 0))} requests, {POINT.replicas} emulated servers, {POINT.routers} epp "
          "replicas behind real Envoy (live) / 4 routers (replay), the default profile\n")
    print("| seed | set-up | live ok | live hit | live TTFT p50 | live TTFT p90 | replay hit | replay TTFT p50 "
          "| replay TTFT p90 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        for label, sync, prefill in SETUPS:
            hit, p50, p90, ok = asyncio.run(live(sync, prefill, seed))
            r_hit, r50, r90 = replay(sync, prefill, seed)
            print(f"| {seed} | {label} | {ok} | {hit:.1%} | {p50:.3f} | {p90:.3f} | {r_hit:.1%} | {r50:.3f} "
                  f"| {r90:.3f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
