"""Replay benchmark: wall time and simulated requests per second, per policy, on the Mooncake
trace (3,993 requests, ~15k-token prompts), plus where the time goes for epp (cProfile).

Run: ./run python bench/bench_replay.py [--limit N] [--policies epp,random] [--profile]
Target (issue 5): under 10 s per policy on this machine. Timings vary with machine load.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

from simulator.replay.policies import POLICY_NAMES, policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.workload import DEFAULT_TRACE, MooncakeTrace

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(ROOT / DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--kv-blocks", type=int, default=16384)
    ap.add_argument("--profile", action="store_true", help="cProfile the epp run, top 25 functions")
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"trace {args.trace} not found; nothing to measure")
        return 0
    t0 = time.perf_counter()
    trace = MooncakeTrace.load(args.trace, 1.0, args.limit)
    print(f"loaded {len(trace)} requests in {time.perf_counter() - t0:.2f} s")
    config = ReplayConfig(kv_blocks=args.kv_blocks)
    print(f"{'policy':<18} {'wall s':>7} {'sim req/s':>10}")
    for spec in args.policies.split(","):
        name, factory = policy_factory(spec)
        prof = cProfile.Profile() if args.profile and name == "epp" else None
        if prof:
            prof.enable()
        result = Replayer(config).run(trace, factory, name)
        if prof:
            prof.disable()
        print(f"{name:<18} {result.wall_s:>7.2f} {len(result.outcomes) / result.wall_s:>10,.0f}", flush=True)
        if prof:
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
