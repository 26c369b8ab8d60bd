"""Agent traffic in the replay (issue 42): the default profile, the default with session
affinity (``session-affinity-scorer``, weight 1), with load in tokens (``token-load-scorer``,
1) and with both, the default without its session spread (``-session spread``) or its
saturation charge (``-saturation charge``), the default not hearing replies' text
(``-reply text``), llm-d-style sticky routing (the shipped ``sticky`` profile) and SGLang's
cache-aware router.

Workload: the replay's ``agentic`` generator (``simulator.replay.workload.AgenticParams``):
64 agent sessions of 10-60 turns, each turn adding the model's tool call and the tool's
output (~1,500 tokens) to a context that grows to 100k tokens, sessions sharing 4 system
prompts of 4k tokens, 8% of turns fanning out into 3 parallel sub-agents that start from
the parent's context; turns ~5 s apart (~7 requests a second at 0.25 sessions a second once
sessions overlap), open loop as a recorded trace replays, or with ``--closed-loop`` each call
sent when the answer it follows (a sub-agent's parent, a parent's sub-agents) has ended. 8 replicas, at two loads (0.25 and 0.5 sessions started per
second) with scarce KV (16,384 blocks of 16 tokens per replica) and
one with ample KV (65,536). Each point is run with ``--seeds`` seeds (the workload's draws
and the policies'); TTFT percentiles are the seeds' medians, hit rates their means.

One seed's p90 moves by 2x and more from the next seed's (a draw that overloads a replica for a
minute sets it), so the verdicts compare policies seed by seed: the geometric mean over the
seeds of a policy's p90 over the default's on the same seed, with a 90% bootstrap interval. The
default is "level" with a policy when that interval holds 1, "behind" when it lies wholly
below 1.

Run: ./run bench agentic [--seeds 8] [--quick] [--closed-loop] [--points 0.5:16384] [--policies default,+token load (agentic)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stats import describe  # noqa: E402
from epp.config.loader import parse_config  # noqa: E402
from simulator.replay.bound import bound_percentile, ttft_lower_bounds  # noqa: E402
from simulator.replay.policies import policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer  # noqa: E402
from simulator.replay.report import summarize  # noqa: E402
from simulator.replay.workload import build_generator  # noqa: E402

POLICIES = {"default": "epp", "+sessions": "epp", "+token load (agentic)": "epp", "+both": "epp",
            "+token load 128k": "epp", "+token load 128k x0.5": "epp", "+token load (decode)": "epp",
            "-session spread": "epp", "-saturation charge": "epp", "-reply text": "epp",
            "sticky (llm-d style)": "epp:sticky", "SGLang cache-aware": "cache-aware"}  # fmt: skip
TOKEN_128K = {"scaleTokens": 131072}
ADDED: dict[str, tuple[tuple[str, dict[str, Any], float], ...]] = {
    "+sessions": (("session-affinity-scorer", {}, 1),),
    "+token load (agentic)": (("token-load-scorer", {}, 1),),
    "+both": (("session-affinity-scorer", {}, 1), ("token-load-scorer", {}, 1)),
    "+token load 128k": (("token-load-scorer", TOKEN_128K, 1),),
    "+token load 128k x0.5": (("token-load-scorer", TOKEN_128K, 0.5),),
    "+token load (decode)": (("token-load-scorer", TOKEN_128K | {"prefillWeight": 0}, 1),),
}
"""The variants of the default: these scorers added to it, with their parameters and weight
(the default with token load is the shipped ``agentic`` profile; the 128k ones are the
candidates of bench/configs/default-token-load-128k*.yaml; "decode" counts only the tokens of
requests past their first token, bench/configs/default-ph-token-load-decode.yaml)."""
TURNED_OFF: dict[str, dict[str, float]] = {
    "-session spread": {"sessionSpreadSeconds": 0},
    "-saturation charge": {"saturationWeight": 0},
}
"""The variants of the default with one of its predicted-ttft-scorer's charges off."""
VARIANTS = ADDED.keys() | TURNED_OFF.keys()
UNHEARD: dict[str, dict[str, bool]] = {"-reply text": {"reply_text_learned": False}}
"""The default as shipped, hearing less of each reply: without its text (usage and the first
token only: what epp hears of a streamed answer through the default bootstrap, docs/envoy.md)."""


def variant(name: str) -> Any:
    """The shipped default (as it is today, whatever it weighs) with ``ADDED[name]`` or
    ``TURNED_OFF[name]``."""
    doc = yaml.safe_load(resources.files("epp.config").joinpath("profiles/default.yaml").read_text("utf-8"))
    for plugin in doc["plugins"]:
        if plugin["type"] == "predicted-ttft-scorer":
            plugin.setdefault("parameters", {}).update(TURNED_OFF.get(name, {}))
    picker = doc["schedulingProfiles"][0]["plugins"].pop()  # the picker stays last
    for scorer, params, weight in ADDED.get(name, ()):
        doc["plugins"].append({"type": scorer, **({"parameters": params} if params else {})})
        doc["schedulingProfiles"][0]["plugins"].append({"pluginRef": scorer, "weight": weight})
    doc["schedulingProfiles"][0]["plugins"].append(picker)
    return parse_config(doc, f"default {name}")
POINTS = [(0.25, 16384), (0.5, 16384), (0.25, 65536)]


def run_one(job: tuple[float, int, str, int, int, bool]) -> tuple[float, int, str, float, float, float, float]:
    rate, kv, policy, seed, sessions, closed = job
    workload = build_generator("agentic", {"rate": rate, "seed": seed, "num_sessions": sessions, "closed_loop": closed})
    name, factory = policy_factory(POLICIES[policy], variant(policy) if policy in VARIANTS else None)
    config = ReplayConfig(kv_blocks=kv, seed=seed, **UNHEARD.get(policy, {}))
    s = summarize(Replayer(config).run(workload, factory, name))
    return rate, kv, policy, s.hit_rate, s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s


def bound(job: tuple[float, int, int, int, bool]) -> tuple[float, int, float]:
    rate, kv, seed, sessions, closed = job
    workload = build_generator("agentic", {"rate": rate, "seed": seed, "num_sessions": sessions, "closed_loop": closed})
    cfg = ReplayConfig(kv_blocks=kv, seed=seed)
    bounds = ttft_lower_bounds(workload.requests(), cfg.cost, cfg.block_size_tokens, cfg.model)
    return rate, kv, bound_percentile(bounds, kv, 90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated, of: " + ", ".join(POLICIES))
    ap.add_argument("--quick", action="store_true", help="16 sessions, one seed, the first point")
    ap.add_argument("--points", default="",
                    help="sessions/s:KV blocks pairs, comma-separated (default: "
                    + ",".join(f"{r}:{kv}" for r, kv in POINTS) + ")")
    ap.add_argument("--closed-loop", action="store_true",
                    help="each agent call waits for the answer it follows (default: open loop, the planned times)")
    args = ap.parse_args()
    sessions = 16 if args.quick else 64
    seeds = 1 if args.quick else args.seeds
    try:
        points = [(float(r), int(kv)) for r, kv in (p.split(":") for p in args.points.split(",") if p.strip())]
    except ValueError:
        ap.error(f"--points: expected sessions/s:KV blocks pairs, got {args.points!r}")
    points = points or (POINTS[:1] if args.quick else POINTS)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or "default" not in policies:
        ap.error(f"--policies: unknown {unknown}" if unknown else "--policies must hold default")
    policies = ["default"] + [p for p in policies if p != "default"]
    closed = args.closed_loop
    jobs = [(r, kv, p, seed, sessions, closed) for r, kv in points for p in policies for seed in range(seeds)]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(run_one, jobs))
        bounds = list(pool.map(bound, [(r, kv, s, sessions, closed) for r, kv in points for s in range(seeds)]))
    cells: dict[tuple[float, int, str], list[tuple[float, float, float, float]]] = {}
    for rate, kv, policy, hit, p50, p90, p99 in results:
        cells.setdefault((rate, kv, policy), []).append((hit, p50, p90, p99))
    lows: dict[tuple[float, int], list[float]] = {}
    for rate, kv, b in bounds:
        lows.setdefault((rate, kv), []).append(b)
    print(f"# agentic workload, 8 replicas, {sessions} sessions, {seeds} seed(s) per point, "
          f"{'closed' if closed else 'open'} loop")
    print("hit rate / TTFT p50 / p90 / p99 (s); `bound`: a TTFT p90 no policy can beat\n")
    head = " | ".join(f"{p:^33}" for p in policies)
    print(f"{'sessions/s':>10} {'KV blocks':>9} | {head} | bound p90")
    verdicts: list[str] = []
    for rate, kv in points:
        row = []
        for p in policies:
            vals = cells[(rate, kv, p)]
            hit = statistics.fmean(v[0] for v in vals)
            p50 = statistics.median(v[1] for v in vals)
            p90 = statistics.median(v[2] for v in vals)
            p99 = statistics.median(v[3] for v in vals)
            row.append(f"{100 * hit:5.1f}% {p50:7.2f} {p90:7.2f} {p99:7.2f}  ")
        print(f"{rate:>10g} {kv:>9} | {' | '.join(row)} | {statistics.median(lows[(rate, kv)]):.2f}")
        base = [v[2] for v in cells[(rate, kv, "default")]]
        parts = []
        for p in policies[1:]:
            parts.append(f"{p} {describe([v[2] for v in cells[(rate, kv, p)]], base)}")
        verdicts.append(f"{rate:g}/s {kv} KV, p90 against the default, seed by seed: " + "; ".join(parts))
    print()
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    sys.exit(main())
