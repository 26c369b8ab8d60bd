"""Agent traffic on the live stack (issue 42): the replay's ``agentic`` generator sent by
``epp-sim load`` through real Envoy and epp to emulated servers, once per shipped profile,
next to the same trace replayed offline.

The point: 8 emulated replicas of 16,384 KV blocks (16 tokens), 24 agent sessions started
0.25 a second, contexts growing to 24k tokens (the emulator serves 32k, the generator counts tokens its own way), sub-agents as the generator makes them. The
live stack runs the emulated GPUs ``--speedup`` times faster than real time (4) and the
trace is sent that much faster too (its session rate times 4, its think times over 4), so a
live figure times 4 is in the replay's modelled seconds; the gateway, epp and the network
are not sped up, so their cost weighs 4 times more live than it would on GPUs. Figures:
TTFT p50/p90 (the client's, to the first text chunk) and the servers' prefix-cache hit rate
from their ``usage``.

Run: ./run bench agentic_live [--record] [--sessions 24] [--speedup 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from epp.config.loader import load_config  # noqa: E402
from simulator.load import LoadOptions, run_load, summarize  # noqa: E402
from simulator.replay.policies import policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer  # noqa: E402
from simulator.replay.report import summarize as replay_summary  # noqa: E402
from simulator.replay.workload import build_generator  # noqa: E402
from simulator.stack.stack import StackOptions, start_stack  # noqa: E402

PROFILES = ("default", "agentic", "sticky")
REPLICAS, KV_BLOCKS = 8, 16384


def params(sessions: int, speedup: float) -> dict[str, Any]:
    return {"num_sessions": sessions, "rate": 0.25 * speedup, "turn_gap_s": 5.0 / speedup,
            "max_context": 24_000, "seed": 0}  # fmt: skip


async def live(profile: str, sessions: int, speedup: float) -> dict[str, float]:
    stack = await start_stack(StackOptions(replicas=REPLICAS, speedup=speedup, kv_blocks=KV_BLOCKS,
                                           config=profile, ready_timeout_s=120))  # fmt: skip
    try:
        workload = build_generator("agentic", params(sessions, speedup))
        sent = await run_load(stack.gateway_url, workload, LoadOptions(stack.options.model))
    finally:
        await stack.stop()
    s = summarize(sent)
    return {"requests": s.requests, "ok": s.ok, "late": s.late, "hit": s.hit_rate,
            "p50": s.ttft_p50_s * speedup, "p90": s.ttft_p90_s * speedup}  # fmt: skip


def replay(profile: str, sessions: int) -> dict[str, float]:
    workload = build_generator("agentic", params(sessions, 1.0))
    name, factory = policy_factory("epp", load_config(profile))
    s = replay_summary(Replayer(ReplayConfig(replicas=REPLICAS, kv_blocks=KV_BLOCKS)).run(workload, factory, name))
    return {"requests": s.requests, "hit": s.hit_rate, "p50": s.ttft_p50_s, "p90": s.ttft_p90_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--speedup", type=float, default=4.0)
    args = ap.parse_args()
    print(f"# agentic workload, {args.sessions} sessions, {REPLICAS} replicas x {KV_BLOCKS} KV "
          f"blocks; live: real Envoy + epp + emulated servers at speedup {args.speedup:g} "
          "(figures in modelled seconds); replay: the same trace offline\n")
    print("| profile | live requests (ok, late) | live hit | live TTFT p50 | live TTFT p90 "
          "| replay hit | replay TTFT p50 | replay TTFT p90 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for profile in PROFILES:
        got = asyncio.run(live(profile, args.sessions, args.speedup))
        off = replay(profile, args.sessions)
        print(f"| {profile} | {got['requests']:.0f} ({got['ok']:.0f}, {got['late']:.0f}) "
              f"| {got['hit']:.1%} | {got['p50']:.2f} | {got['p90']:.2f} | {off['hit']:.1%} "
              f"| {off['p50']:.2f} | {off['p90']:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
