"""Agent traffic (issue 42), in the replay open and closed loop, and live: the default profile,
with load in tokens (``token-load-scorer``, weight 1), without its session spread or its
saturation charge, llm-d-style sticky routing (the shipped ``sticky`` profile) and SGLang's
cache-aware router; with ``--live``, the shipped profiles through real Envoy and epp too.

Workload: the replay's ``agentic`` generator (64 agent sessions whose contexts grow by tool
calls to 100k tokens, some turns fanning out into sub-agents); open loop sends each call at its
planned time, closed loop when the answer it follows has ended. 8 replicas, ``--points``. TTFT
percentiles are the seeds' medians, hit rates their means; the verdicts compare policies seed
by seed (``bench.stats``).

``--live``: 24 sessions (contexts to 24k tokens) sent by ``epp-sim load`` through real Envoy
and epp to 8 emulated servers, once per shipped profile, beside the same trace replayed. The
emulated GPUs and the trace run ``--speedup`` times faster (4), so a live figure times 4 is in
the replay's modelled seconds (the gateway, epp and the network are not sped up). Live: the
client's TTFT and the servers' hit rate from their ``usage``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import bound_p90, pool_map, replay  # noqa: E402
from bench.stats import describe  # noqa: E402
from epp.config.loader import load_config, parse_config  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402
from simulator.replay.workload import build_generator  # noqa: E402

POLICIES = {"default": "epp", "-saturation charge": "epp", "-session spread": "epp", "+token load (agentic)": "epp",
            "sticky (llm-d style)": "epp:sticky", "SGLang cache-aware": "cache-aware"}  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "-saturation charge": {"saturationWeight": 0},
    "-session spread": {"sessionSpreadSeconds": 0},
    "+token load (agentic)": {},
}
"""The shipped default (whatever it weighs today) with a predicted-ttft-scorer charge off, or token load added."""
POINTS = [(0.25, 16384), (0.5, 16384), (0.25, 65536)]
LIVE_PROFILES = ("default", "agentic", "sticky")
REPLICAS, LIVE_KV_BLOCKS = 8, 16384


def epp_config(policy: str, candidates: dict[str, str]) -> Any:
    """A candidate's config, the shipped default with a ``VARIANTS`` change, or None (as named)."""
    if policy in candidates or policy not in VARIANTS:
        return load_config(candidates[policy]) if policy in candidates else None
    doc = yaml.safe_load(resources.files("epp.config").joinpath("profiles/default.yaml").read_text("utf-8"))  # fmt: skip
    for plugin in doc["plugins"]:
        if plugin["type"] == "predicted-ttft-scorer":
            plugin.setdefault("parameters", {}).update(VARIANTS[policy])
    if policy == "+token load (agentic)":
        doc["plugins"].append({"type": "token-load-scorer"})
        doc["schedulingProfiles"][0]["plugins"].insert(-1, {"pluginRef": "token-load-scorer", "weight": 1})  # fmt: skip
    return parse_config(doc, f"default {policy}")


Job = tuple[float, int, str, int, int, bool, dict[str, str]]
"""(sessions a second, KV blocks, policy, seed, sessions, closed loop, candidates' configs)"""


def agents(rate: float, seed: int, sessions: int, closed: bool) -> Any:
    return build_generator("agentic", {"rate": rate, "seed": seed, "num_sessions": sessions, "closed_loop": closed})  # fmt: skip


def run_one(job: Job) -> tuple[Job, tuple[float, float, float, float, float]]:
    """A policy's figures on a seed; with the default's, the seed's TTFT bound (``bound_p90``)."""
    rate, kv, policy, seed, sessions, closed, candidates = job
    cfg, workload = ReplayConfig(kv_blocks=kv, seed=seed), agents(rate, seed, sessions, closed)
    s = replay(cfg, workload, POLICIES.get(policy, "epp"), epp_config(policy, candidates))
    low = bound_p90(cfg, agents(rate, seed, sessions, closed)) if policy == "default" else 0.0
    return job, (s.hit_rate, s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s, low)


def loop_table(closed: bool, points: list[tuple[float, int]], policies: list[str], seeds: int, sessions: int,
               candidates: dict[str, str]) -> None:  # fmt: skip
    jobs = [(r, kv, p, s, sessions, closed, candidates) for r, kv in points for p in policies for s in range(seeds)]  # fmt: skip
    cells: dict[tuple[float, int, str], list[tuple[float, float, float, float, float]]] = {}
    for job, figures in pool_map(run_one, jobs):
        cells.setdefault(job[:3], []).append(figures)
    print(f"## {'closed' if closed else 'open'} loop: 8 replicas, {sessions} sessions, {seeds} seed(s) a point\n\n"
          "hit rate / TTFT p50 / p90 / p99 (s); `bound`: a TTFT p90 no policy can beat\n")  # fmt: skip
    print(f"{'sessions/s':>10} {'KV blocks':>9} | " + " | ".join(f"{p:^33}" for p in policies) + " | bound p90")  # fmt: skip
    verdicts = []
    for rate, kv in points:
        row = []
        for v in (cells[(rate, kv, p)] for p in policies):
            p50, p90, p99 = (statistics.median(x[k] for x in v) for k in (1, 2, 3))
            row.append(f"{100 * statistics.fmean(x[0] for x in v):5.1f}% {p50:7.2f} {p90:7.2f} {p99:7.2f}  ")  # fmt: skip
        default = cells[(rate, kv, "default")]
        print(f"{rate:>10g} {kv:>9} | {' | '.join(row)} | {statistics.median(x[4] for x in default):.2f}")
        base = [v[2] for v in default]
        verdicts.append(f"{rate:g}/s {kv} KV, p90 against the default, seed by seed: " + "; ".join(
            f"{p} {describe([v[2] for v in cells[(rate, kv, p)]], base)}" for p in policies[1:]))  # fmt: skip
    print("\n" + "\n".join(verdicts) + "\n", flush=True)


def live_table(sessions: int, speedup: float) -> None:
    """Each shipped profile live (real Envoy and epp, emulated servers ``speedup`` times faster)
    beside its replay of the same trace."""
    from simulator.load import LoadOptions, run_load, summarize
    from simulator.stack.stack import StackOptions, start_stack

    def params(speedup: float) -> dict[str, Any]:
        return {"num_sessions": sessions, "rate": 0.25 * speedup, "turn_gap_s": 5.0 / speedup,
                "max_context": 24_000, "seed": 0}  # fmt: skip

    async def live_run(profile: str) -> Any:
        stack = await start_stack(StackOptions(replicas=REPLICAS, speedup=speedup, kv_blocks=LIVE_KV_BLOCKS,
                                               config=profile, ready_timeout_s=120))  # fmt: skip
        try:
            workload = build_generator("agentic", params(speedup))
            return summarize(await run_load(stack.gateway_url, workload, LoadOptions(stack.options.model)))  # fmt: skip
        finally:
            await stack.stop()

    print(f"## live: {sessions} sessions, {REPLICAS} replicas x {LIVE_KV_BLOCKS} KV blocks; real Envoy + epp + "
          f"emulated servers at speedup {speedup:g} (figures in modelled seconds); replay: the same trace\n")  # fmt: skip
    print("| profile | live requests (ok, late) | live hit | live TTFT p50 | live TTFT p90 "
          "| replay hit | replay TTFT p50 | replay TTFT p90 |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for profile in LIVE_PROFILES:
        got = asyncio.run(live_run(profile))
        cfg = ReplayConfig(replicas=REPLICAS, kv_blocks=LIVE_KV_BLOCKS)
        off = replay(cfg, build_generator("agentic", params(1.0)), "epp", load_config(profile))
        print(f"| {profile} | {got.requests} ({got.ok}, {got.late}) | {got.hit_rate:.1%} | "
              f"{got.ttft_p50_s * speedup:.2f} | {got.ttft_p90_s * speedup:.2f} | {off.hit_rate:.1%} "
              f"| {off.ttft_p50_s:.2f} | {off.ttft_p90_s:.2f} |", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of: " + ", ".join(POLICIES))  # fmt: skip
    ap.add_argument("--candidate", action="append", default=[], metavar="NAME=CONFIG",
                    help="also run this epp config (a file or shipped name) as column NAME (repeatable)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="16 sessions, one seed, the first point, 8 live sessions")  # fmt: skip
    ap.add_argument("--points", default=",".join(f"{r}:{kv}" for r, kv in POINTS),
                    help="sessions/s:KV blocks pairs, comma-separated")  # fmt: skip
    ap.add_argument("--loops", default="open,closed", help="the replay's loops: open, closed, both, or none ('')")  # fmt: skip
    ap.add_argument("--live", action="store_true", help="also run the shipped profiles live (a few minutes each)")  # fmt: skip
    ap.add_argument("--live-sessions", type=int, default=24)
    ap.add_argument("--speedup", type=float, default=4.0, help="live: emulated GPUs this much faster (4)")  # fmt: skip
    args = ap.parse_args()
    try:
        points = [(float(r), int(kv)) for r, kv in (p.split(":") for p in args.points.split(",") if p.strip())]  # fmt: skip
    except ValueError:
        ap.error(f"--points: expected sessions/s:KV blocks pairs, got {args.points!r}")
    candidates = dict(c.partition("=")[::2] for c in args.candidate)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] + list(candidates)
    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    if set(policies) - set(POLICIES) - set(candidates) or "default" not in policies or set(loops) - {"open", "closed"}:  # fmt: skip
        ap.error(f"--policies: default and any of {', '.join(POLICIES)}; --loops: open, closed or both")  # fmt: skip
    if any(not n or not c for n, c in candidates.items()):
        ap.error("--candidate expects NAME=CONFIG")
    policies = ["default"] + [p for p in policies if p != "default"]
    for loop in loops:
        loop_table(loop == "closed", points[:1] if args.quick else points, policies, 1 if args.quick else args.seeds,
                   16 if args.quick else 64, candidates)  # fmt: skip
    if args.live:
        live_table(8 if args.quick else args.live_sessions, args.speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
