"""Agent traffic (issue 42), in the replay open and closed loop, and live: the default profile,
with load in tokens (``token-load-scorer``, weight 1), without its session spread or its
saturation charge, llm-d-style sticky routing (the shipped ``sticky`` profile) and SGLang's
cache-aware router; with ``--live``, the shipped profiles through real Envoy and epp too.

Workload: the replay's ``agentic`` generator (``AgenticParams``): 64 agent sessions of 10-60
turns ~5 s apart, each adding a tool call and its output (~1,500 tokens) to a context that
grows to 100k tokens, 4 shared system prompts of 4k tokens, 8% of turns fanning out into 3
sub-agents. Open loop sends each call at its planned time; closed loop when the answer it
follows has ended. 8 replicas, at 0.25 and 0.5 sessions started a second with 16,384 KV
blocks a replica, and 0.25 with 65,536. TTFT percentiles are the ``--seeds`` seeds' medians,
hit rates their means; the verdicts compare policies seed by seed (``bench.stats``: the
geometric mean of a policy's p90 over the default's, with a 90% bootstrap interval).

``--live``: 24 sessions (contexts to 24k tokens: the emulator serves 32k) sent by ``epp-sim
load`` through real Envoy and epp to 8 emulated servers of 16,384 KV blocks, once per shipped
profile (``default``, ``agentic``, ``sticky``), beside the same trace replayed. The emulated
GPUs run ``--speedup`` times faster than real time (4) and the trace is sent that much faster,
so a live figure times 4 is in the replay's modelled seconds; the gateway, epp and the network
are not sped up. Live figures: the client's TTFT (to the first text chunk) and the servers'
prefix-cache hit rate from their ``usage``.

Run: ./run bench agentic [--record] [--live] [--seeds 8] [--quick] [--loops open,closed]
     [--points 0.5:16384] [--policies default,sticky (llm-d style)] [--candidate NAME=CONFIG]
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

POLICIES = {"default": "epp", "-saturation charge": "epp", "-session spread": "epp", "-reply text": "epp",
            "+token load (agentic)": "epp", "sticky (llm-d style)": "epp:sticky",
            "SGLang cache-aware": "cache-aware"}  # fmt: skip
PAGE = [p for p in POLICIES if p != "-reply text"]
"""The policies run unless ``--policies`` says otherwise."""
VARIANTS: dict[str, dict[str, Any]] = {
    "-saturation charge": {"saturationWeight": 0},
    "-session spread": {"sessionSpreadSeconds": 0},
    "+token load (agentic)": {},
}
"""The shipped default (whatever it weighs today) with one predicted-ttft-scorer charge off,
or with ``token-load-scorer`` added at weight 1."""
UNHEARD: dict[str, dict[str, bool]] = {"-reply text": {"reply_text_learned": False}}
"""The default hearing less of each reply: usage and the first token, not the text (what epp
hears of a streamed answer through the default bootstrap, docs/envoy.md)."""
POINTS = [(0.25, 16384), (0.5, 16384), (0.25, 65536)]
LIVE_PROFILES = ("default", "agentic", "sticky")
REPLICAS, LIVE_KV_BLOCKS = 8, 16384


def variant(name: str) -> Any:
    doc = yaml.safe_load(resources.files("epp.config").joinpath("profiles/default.yaml").read_text("utf-8"))
    for plugin in doc["plugins"]:
        if plugin["type"] == "predicted-ttft-scorer":
            plugin.setdefault("parameters", {}).update(VARIANTS[name])
    if name == "+token load (agentic)":
        doc["plugins"].append({"type": "token-load-scorer"})
        doc["schedulingProfiles"][0]["plugins"].insert(-1, {"pluginRef": "token-load-scorer", "weight": 1})
    return parse_config(doc, f"default {name}")


def epp_config(policy: str, candidates: dict[str, str]) -> Any:
    if policy in candidates:
        return load_config(candidates[policy])
    return variant(policy) if policy in VARIANTS else None


Job = tuple[float, int, str, int, int, bool, dict[str, str]]
"""(sessions a second, KV blocks, policy, seed, sessions, closed loop, candidates' configs)"""


def agents(rate: float, seed: int, sessions: int, closed: bool) -> Any:
    return build_generator("agentic", {"rate": rate, "seed": seed, "num_sessions": sessions, "closed_loop": closed})


def run_one(job: Job) -> tuple[Job, tuple[float, float, float, float]]:
    rate, kv, policy, seed, sessions, closed, candidates = job
    cfg = ReplayConfig(kv_blocks=kv, seed=seed, **UNHEARD.get(policy, {}))
    s = replay(cfg, agents(rate, seed, sessions, closed), POLICIES.get(policy, "epp"), epp_config(policy, candidates))
    return job, (s.hit_rate, s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s)


def bound(job: tuple[float, int, int, int, bool]) -> float:
    rate, kv, seed, sessions, closed = job
    return bound_p90(ReplayConfig(kv_blocks=kv, seed=seed), agents(rate, seed, sessions, closed))


def loop_table(closed: bool, points: list[tuple[float, int]], policies: list[str], seeds: int, sessions: int,
               candidates: dict[str, str]) -> None:  # fmt: skip
    jobs = [(r, kv, p, s, sessions, closed, candidates) for r, kv in points for p in policies for s in range(seeds)]
    cells: dict[tuple[float, int, str], list[tuple[float, float, float, float]]] = {}
    for job, figures in pool_map(run_one, jobs):
        cells.setdefault(job[:3], []).append(figures)
    lows = pool_map(bound, [(r, kv, s, sessions, closed) for r, kv in points for s in range(seeds)])
    print(f"## {'closed' if closed else 'open'} loop: 8 replicas, {sessions} sessions, {seeds} seed(s) a point\n")
    print("hit rate / TTFT p50 / p90 / p99 (s); `bound`: a TTFT p90 no policy can beat\n")
    print(f"{'sessions/s':>10} {'KV blocks':>9} | " + " | ".join(f"{p:^33}" for p in policies) + " | bound p90")
    verdicts = []
    for i, (rate, kv) in enumerate(points):
        row = []
        for p in policies:
            v = cells[(rate, kv, p)]
            hit, (p50, p90, p99) = statistics.fmean(x[0] for x in v), (statistics.median(x[k] for x in v) for k in (1, 2, 3))
            row.append(f"{100 * hit:5.1f}% {p50:7.2f} {p90:7.2f} {p99:7.2f}  ")
        low = statistics.median(lows[i * seeds:(i + 1) * seeds])
        print(f"{rate:>10g} {kv:>9} | {' | '.join(row)} | {low:.2f}")
        base = [v[2] for v in cells[(rate, kv, "default")]]
        verdicts.append(f"{rate:g}/s {kv} KV, p90 against the default, seed by seed: " + "; ".join(
            f"{p} {describe([v[2] for v in cells[(rate, kv, p)]], base)}" for p in policies[1:]))
    print("\n" + "\n".join(verdicts) + "\n", flush=True)


def live_params(sessions: int, speedup: float) -> dict[str, Any]:
    return {"num_sessions": sessions, "rate": 0.25 * speedup, "turn_gap_s": 5.0 / speedup,
            "max_context": 24_000, "seed": 0}  # fmt: skip


async def live_run(profile: str, sessions: int, speedup: float) -> Any:
    from simulator.load import LoadOptions, run_load, summarize
    from simulator.stack.stack import StackOptions, start_stack

    stack = await start_stack(StackOptions(replicas=REPLICAS, speedup=speedup, kv_blocks=LIVE_KV_BLOCKS,
                                           config=profile, ready_timeout_s=120))  # fmt: skip
    try:
        workload = build_generator("agentic", live_params(sessions, speedup))
        return summarize(await run_load(stack.gateway_url, workload, LoadOptions(stack.options.model)))
    finally:
        await stack.stop()


def live_table(sessions: int, speedup: float) -> None:
    print(f"## live: {sessions} sessions, {REPLICAS} replicas x {LIVE_KV_BLOCKS} KV blocks; real Envoy + epp + "
          f"emulated servers at speedup {speedup:g} (figures in modelled seconds); replay: the same trace\n")
    print("| profile | live requests (ok, late) | live hit | live TTFT p50 | live TTFT p90 "
          "| replay hit | replay TTFT p50 | replay TTFT p90 |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for profile in LIVE_PROFILES:
        got = asyncio.run(live_run(profile, sessions, speedup))
        cfg = ReplayConfig(replicas=REPLICAS, kv_blocks=LIVE_KV_BLOCKS)
        off = replay(cfg, build_generator("agentic", live_params(sessions, 1.0)), "epp", load_config(profile))
        print(f"| {profile} | {got.requests} ({got.ok}, {got.late}) | {got.hit_rate:.1%} | "
              f"{got.ttft_p50_s * speedup:.2f} | {got.ttft_p90_s * speedup:.2f} | {off.hit_rate:.1%} "
              f"| {off.ttft_p50_s:.2f} | {off.ttft_p90_s:.2f} |", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--policies", default=",".join(PAGE), help="comma-separated, of: " + ", ".join(POLICIES))
    ap.add_argument("--candidate", action="append", default=[], metavar="NAME=CONFIG",
                    help="also run this epp config (a file or shipped name) as column NAME (repeatable)")
    ap.add_argument("--quick", action="store_true", help="16 sessions, one seed, the first point, 8 live sessions")
    ap.add_argument("--points", default="", help="sessions/s:KV blocks pairs, comma-separated (default: "
                    + ",".join(f"{r}:{kv}" for r, kv in POINTS) + ")")
    ap.add_argument("--loops", default="open,closed", help="the replay's loops: open, closed, both, or none ('')")
    ap.add_argument("--live", action="store_true", help="also run the shipped profiles live (a few minutes each)")
    ap.add_argument("--live-sessions", type=int, default=24)
    ap.add_argument("--speedup", type=float, default=4.0, help="live: emulated GPUs this much faster (4)")
    args = ap.parse_args()
    try:
        points = [(float(r), int(kv)) for r, kv in (p.split(":") for p in args.points.split(",") if p.strip())]
    except ValueError:
        ap.error(f"--points: expected sessions/s:KV blocks pairs, got {args.points!r}")
    candidates = dict(c.partition("=")[::2] for c in args.candidate)
    if any(not n or not c for n, c in candidates.items()):
        ap.error("--candidate expects NAME=CONFIG")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] + list(candidates)
    unknown = sorted(set(policies) - set(POLICIES) - set(candidates))
    if unknown or "default" not in policies:
        ap.error(f"--policies: unknown {unknown}" if unknown else "--policies must hold default")
    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    if set(loops) - {"open", "closed"}:
        ap.error("--loops: open, closed or both")
    policies = ["default"] + [p for p in policies if p != "default"]
    points = points or (POINTS[:1] if args.quick else POINTS)
    for loop in loops:
        loop_table(loop == "closed", points, policies, 1 if args.quick else args.seeds, 16 if args.quick else 64,
                   candidates)  # fmt: skip
    if args.live:
        live_table(8 if args.quick else args.live_sessions, args.speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
