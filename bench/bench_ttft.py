"""The predicted-TTFT scorer against today's default, SGLang's cache-aware policy and the
oracle, in the replay (issue 15's grid).

Four workloads (the shared Mooncake trace, and the chat, RAG and shared-prefix generators),
each at three loads and three KV-cache sizes; per point and policy: prefix-cache hit rate,
TTFT p50 / p90 / p99, and for the predicted-TTFT scorer its prediction error (median
relative, mean absolute, predicted at the pick vs the simulated time to first token).

Policies: ``default`` (epp's shipped profile: prefix 3, queue 2, KV use 2), ``predicted``
(the shipped ``predicted-ttft`` profile), ``cache-aware`` (SGLang's router policy) and
``oracle`` (the default profile reading the replicas' true caches).

Each point runs ``--seeds`` times (default 3: the replayer's seed, which breaks ties between
equal scores and draws every random choice a policy makes) and reports the median of each
TTFT figure and the mean hit rate: near a cache's limit one seeded run can land in a stable
placement or in a thrash, and a single run then says more about the seed than the policy.

The last lines count the points where the issue's targets hold: TTFT p90 at least 10% below
the default's, and a hit rate no lower than cache-aware's. ``bound p90`` is the p90 of a
lower bound on every request's TTFT that no policy can beat (``simulator.replay.bound``:
each request's own prefill with every block another request brought before it cached, and
one decode step); where 90% of the default's p90 is below it, no policy can meet the p90
target, and the last line says at how many points that is so.

``--ttft-oracle`` adds the ``ttft-oracle`` policy (each request to the replica whose what-if
run gives its first token soonest: what routing on true TTFTs gets, greedily) and counts the
points where it is 10% below the default's p90.

Run: ./run python bench/bench_ttft.py [--quick] [--seeds 3] [--ttft-oracle]
                                            [--workloads mooncake,chat,rag,shared-prefix]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from simulator.replay.bound import bound_percentile, ttft_lower_bounds
from simulator.replay.policies import policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.report import summarize
from simulator.replay.workload import (
    DEFAULT_TRACE,
    MooncakeTrace,
    Workload,
    build_generator,
    scaled_rate,
)

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"default": "epp", "predicted": "epp:predicted-ttft", "cache-aware": "cache-aware",
            "oracle": "oracle"}  # fmt: skip


@dataclass(frozen=True)
class Grid:
    """One workload's 3 x 3 points: loads (trace time scale or request rate) x KV blocks."""

    name: str
    loads: tuple[float, ...]
    load_label: str
    kv_blocks: tuple[int, ...]
    base: ReplayConfig


GRIDS = {
    # the trace at its pace, 4/3 and 5/3 of it; 8 replicas of 64k / 128k / 256k tokens
    "mooncake": Grid("mooncake", (1.0, 0.75, 0.6), "time scale", (4096, 8192, 16384),
                     ReplayConfig(replicas=8)),
    "chat": Grid("chat", (4.0, 8.0, 12.0), "req/s", (1024, 2048, 4096), ReplayConfig(replicas=4)),
    "rag": Grid("rag", (2.0, 4.0, 8.0), "req/s", (2048, 4096, 8192), ReplayConfig(replicas=4)),
    "shared-prefix": Grid("shared-prefix", (4.0, 8.0, 16.0), "req/s", (1024, 2048, 4096),
                          ReplayConfig(replicas=4)),
}  # fmt: skip


def workload_at(name: str, load: float, quick: bool) -> Workload:
    if name == "mooncake":
        return MooncakeTrace.load(ROOT / DEFAULT_TRACE, load, 1000 if quick else 0)
    params: dict[str, Any] = {}
    if quick:
        params = {"chat": {"num_sessions": 32}, "rag": {"num_requests": 192},
                  "shared-prefix": {"num_prompts_per_group": 12}}[name]  # fmt: skip
    return scaled_rate(build_generator(name, params), load)


def run_one(job: tuple[str, float, int, str, bool, str, int]) -> dict[str, Any]:
    wname, load, kv, label, quick, predicted, seed = job
    grid = GRIDS[wname]
    workload = workload_at(wname, load, quick)
    name, factory = policy_factory(f"epp:{predicted}" if label == "predicted" else POLICIES.get(label, label))
    config = replace(grid.base, kv_blocks=kv, seed=seed)
    s = summarize(Replayer(config).run(workload, factory, name))
    return {"workload": wname, "load": load, "kv": kv, "policy": label, "hit": s.hit_rate,
            "p50": s.ttft_p50_s, "p90": s.ttft_p90_s, "p99": s.ttft_p99_s,
            "err_rel": s.ttft_pred_rel_p50, "err_abs": s.ttft_pred_abs_mean_s}  # fmt: skip


def bounds_of(job: tuple[str, float, bool]) -> tuple[str, float, dict[int, float]]:
    """The TTFT lower bound's p90 at each KV size of one workload and load."""
    wname, load, quick = job
    grid = GRIDS[wname]
    cfg = grid.base
    bounds = ttft_lower_bounds(workload_at(wname, load, quick).requests(), cfg.cost,
                               cfg.block_size_tokens, cfg.model)  # fmt: skip
    return wname, load, {kv: bound_percentile(bounds, kv, 90) for kv in grid.kv_blocks}


def _pooled(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's runs over seeds: mean hit rate, median of every other figure."""
    out = dict(rs[0])
    out["hit"] = statistics.mean(r["hit"] for r in rs)
    for k in ("p50", "p90", "p99", "err_rel", "err_abs"):
        values = [r[k] for r in rs if not math.isnan(r[k])]
        out[k] = statistics.median(values) if values else math.nan
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 trace requests, smaller generators")
    ap.add_argument("--workloads", default=",".join(GRIDS), help="comma-separated: " + ", ".join(GRIDS))
    ap.add_argument("--seeds", type=int, default=3,
                    help="runs per point and policy (replayer seeds 0..N-1); medians reported")
    ap.add_argument("--predicted", default="predicted-ttft", metavar="CONFIG",
                    help="the config of the 'predicted' column (a file or a shipped profile)")
    ap.add_argument("--ttft-oracle", action="store_true",
                    help="add the ttft-oracle policy (a what-if run per replica per request: "
                         "slow on the trace)")
    args = ap.parse_args()
    if args.ttft_oracle:
        POLICIES["ttft-oracle"] = "ttft-oracle"
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in names:
        if w not in GRIDS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(GRIDS)}")
    if "mooncake" in names and not (ROOT / DEFAULT_TRACE).exists():
        print(f"(trace {ROOT / DEFAULT_TRACE} not found: the Mooncake rows are skipped)")
        names.remove("mooncake")
    jobs = [(w, load, kv, p, args.quick, args.predicted, seed) for w in names
            for load in GRIDS[w].loads for kv in GRIDS[w].kv_blocks for p in POLICIES
            for seed in range(args.seeds)]  # fmt: skip
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        rows = list(pool.map(run_one, jobs))
        bound_p90 = {(w, load, kv): p90 for w, load, by_kv in pool.map(
            bounds_of, [(w, load, args.quick) for w in names for load in GRIDS[w].loads])
            for kv, p90 in by_kv.items()}  # fmt: skip
    runs: dict[tuple[str, float, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        runs.setdefault((r["workload"], r["load"], r["kv"]), {}).setdefault(r["policy"], []).append(r)
    by = {point: {policy: _pooled(rs) for policy, rs in cell.items()} for point, cell in runs.items()}
    print(f"{args.seeds} seeded run(s) per point and policy: mean hit rate, median TTFT p50 / p90 / "
          "p99 (s);")
    print("'p90 vs default' = predicted's p90 change; 'bound p90' = no policy's p90 is lower "
          "('*': nor 10% below the default's);")
    print("'pred. err' = the predicted scorer's median relative / mean absolute TTFT error")
    head = f"{'workload':<13} {'load':>5} {'KV blocks':>9}"
    for p in POLICIES:
        head += f" | {p:^27}"
    print(head + " | p90 vs default | bound p90 | pred. err")
    met_p90 = met_hit = ruled_out = 0
    for (w, load, kv), cell in by.items():
        line = f"{w:<13} {load:>5g} {kv:>9}"
        for p in POLICIES:
            c = cell[p]
            line += f" | {c['hit']:>6.1%} {c['p50']:>6.2f} {c['p90']:>6.2f} {c['p99']:>6.2f}"
        d, pr, ca = cell["default"], cell["predicted"], cell["cache-aware"]
        change = pr["p90"] / d["p90"] - 1 if d["p90"] > 0 else math.nan
        met_p90 += change <= -0.10
        met_hit += pr["hit"] >= ca["hit"]
        bound = bound_p90[(w, load, kv)]
        out_of_reach = bound > 0.9 * d["p90"]
        ruled_out += out_of_reach
        line += (f" | {change:>+13.0%} | {bound:>8.2f}{'*' if out_of_reach else ' '}"
                 f" | {pr['err_rel']:.0%} / {pr['err_abs']:.2f}s")
        print(line, flush=True)
    n = len(by)
    if args.ttft_oracle:
        greedy = sum(c["ttft-oracle"]["p90"] <= 0.9 * c["default"]["p90"] for c in by.values())
        print(f"ttft-oracle's TTFT p90 >= 10% below the default's at {greedy} of {n} points")
    print(f"targets: predicted's TTFT p90 >= 10% below the default's at {met_p90} of {n} points; "
          f"hit rate >= cache-aware's at {met_hit} of {n}")
    print(f"the TTFT bound puts a p90 10% below the default's out of every policy's reach at "
          f"{ruled_out} of {n} points (targets met at {met_p90} of the other {n - ruled_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
