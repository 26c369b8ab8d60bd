"""The shortlist in large pools: the default profile as shipped against the same profile
scoring every candidate (``shortlist: {enabled: false}``), in the replay, at pool sizes where
the shortlist runs (the profile sweep's 4 and 8 replicas are scored whole).

Points: the chat, RAG and shared-prefix generators and the Mooncake trace scaled to 32
replicas, and chat at 64. Per point and policy: mean hit rate and median TTFT p90 over
``--seeds`` seeds, the p90 ratio seed by seed with its 90% interval (``bench.stats``), and how
often the shortlist's pick was as good as the full scorer set's: each shortlisted decision is
also scored over every candidate in its shadow (same cycle state, its own random numbers,
nothing committed) and agrees when the shortlist's pick has the best total of all.

Run: ./run bench shortlist [--quick] [--seeds 3] [--per-scorer K] [--result-name shortlist]
(``--per-scorer``: ``shortlist.perScorer`` K, printed only, as is ``--quick``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import pool_map, replay  # noqa: E402
from bench.results import write_result  # noqa: E402
from bench.stats import paired_ratio  # noqa: E402
from epp.config.loader import default_config, loads_config  # noqa: E402
from epp.framework.endpoint import Endpoint  # noqa: E402
from epp.framework.types import CycleState, ProfileResult  # noqa: E402
from epp.scheduling.profile import Profile  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402
from simulator.replay.workload import (  # noqa: E402
    DEFAULT_TRACE,
    MooncakeTrace,
    Workload,
    build_generator,
    scaled_rate,
)

POLICIES = {"shipped": "", "all scored": "shortlist: {enabled: false}"}


@dataclass(frozen=True)
class Point:
    label: str
    workload: str
    replicas: int
    kv_blocks: int
    rate: float
    """Requests a second (generators), or the pace multiplier (the trace)."""
    params: tuple[tuple[str, int], ...] = ()


POINTS = (
    Point("chat 64/s, 32 replicas", "chat", 32, 1024, 64, (("num_sessions", 512), ("num_system_prompts", 64))),
    Point("chat 96/s, 32 replicas", "chat", 32, 1024, 96, (("num_sessions", 512), ("num_system_prompts", 64))),
    Point("rag 64/s, 32 replicas", "rag", 32, 2048, 64, (("num_requests", 4096), ("num_docs", 2048))),
    Point("shared-prefix 128/s, 32 replicas", "shared-prefix", 32, 1024, 128, (("num_groups", 128),)),
    Point("mooncake 4x, 32 replicas", "mooncake", 32, 8192, 4.0),
    Point("chat 192/s, 64 replicas", "chat", 64, 1024, 192, (("num_sessions", 1024), ("num_system_prompts", 128))),
)
QUICK = {"chat 64/s, 32 replicas": (("num_sessions", 128), ("num_system_prompts", 64)),
         "rag 64/s, 32 replicas": (("num_requests", 768), ("num_docs", 1024))}  # fmt: skip


def workload_of(point: Point, quick: bool, seed: int) -> Workload:
    if point.workload == "mooncake":
        return MooncakeTrace.load(ROOT / DEFAULT_TRACE, 1 / point.rate, 2000 if quick else 0)
    params: dict[str, Any] = {"seed": seed, **dict(QUICK.get(point.label, point.params) if quick else point.params)}
    return scaled_rate(build_generator(point.workload, params), point.rate)


@dataclass
class Agreement:
    decisions: int = 0
    agreed: int = 0
    scored: int = 0


AGREEMENT = Agreement()


def _shadowed(run: Any) -> Any:
    """``Profile.run`` that also scores every candidate in the shadow of a shortlisted
    decision and counts whether the shortlist's pick has the best total of all."""

    def shadow_run(self: Profile, state: CycleState, endpoints: Sequence[Endpoint], count: int) -> ProfileResult:
        result: ProfileResult = run(self, state, endpoints, count)
        if len(result.candidates) == len(endpoints) or not result.targets:
            return result
        everyone = Profile("shadow", self.filters, self.scorers, self.picker,
                           dataclasses.replace(self.shortlist_config, enabled=False))  # fmt: skip
        rng, state.rng = state.rng, random.Random(0)
        full = run(everyone, state, endpoints, count)
        state.rng = rng
        totals = dict(zip((e.id for e in full.candidates), full.totals, strict=True))
        AGREEMENT.decisions += 1
        AGREEMENT.scored += len(result.candidates)
        AGREEMENT.agreed += totals[result.targets[0].id] >= max(full.totals) - 1e-9
        return result

    return shadow_run


def run_one(job: tuple[Point, str, int, bool, int]) -> tuple[Point, str, int, float, float, Agreement]:
    point, policy, seed, quick, per_scorer = job
    AGREEMENT.decisions = AGREEMENT.agreed = AGREEMENT.scored = 0  # a worker runs many jobs
    text = POLICIES[policy]
    if per_scorer and policy == "shipped":
        text = f"shortlist: {{perScorer: {per_scorer}}}"
    cfg = loads_config(text) if text else default_config()
    original = Profile.run
    if policy == "shipped":
        Profile.run = _shadowed(original)  # type: ignore[method-assign]
    try:
        s = replay(ReplayConfig(replicas=point.replicas, kv_blocks=point.kv_blocks, seed=seed),
                   workload_of(point, quick, seed), "epp", cfg)  # fmt: skip
    finally:
        Profile.run = original  # type: ignore[method-assign]
    return point, policy, seed, s.hit_rate, s.ttft_p90_s, dataclasses.replace(AGREEMENT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed, three points, fewer requests")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--per-scorer", type=int, default=0,
                    help="shortlist.perScorer for the shipped profile (0: as shipped)")
    ap.add_argument("--result-name", default="shortlist")
    args = ap.parse_args()
    seeds = 1 if args.quick else args.seeds
    points = [p for p in POINTS if not args.quick or p.label in QUICK or p.workload == "shared-prefix"]
    jobs = [(p, pol, seed, args.quick, args.per_scorer) for p in points for pol in POLICIES
            for seed in range(seeds)]  # fmt: skip
    runs: dict[tuple[Point, str], list[tuple[int, float, float]]] = {}
    agree: dict[Point, Agreement] = {p: Agreement() for p in points}
    for point, policy, seed, hit, p90, ag in pool_map(run_one, jobs):
        runs.setdefault((point, policy), []).append((seed, hit, p90))
        a = agree[point]
        a.decisions, a.agreed, a.scored = a.decisions + ag.decisions, a.agreed + ag.agreed, a.scored + ag.scored
    head = ("| point | shipped: hit rate / TTFT p90 (s) | every candidate scored | p90 shipped / all "
            "scored, seed by seed | pick as good as the full set's | endpoints scored a decision |")
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    data: dict[str, Any] = {}
    for p in points:
        cells = {}
        for pol in POLICIES:
            rs = sorted(runs[p, pol])
            cells[pol] = (statistics.mean(h for _, h, _ in rs), statistics.median(v for _, _, v in rs), [v for _, _, v in rs])
        r, lo, hi = paired_ratio(cells["shipped"][2], cells["all scored"][2])
        ratio = f"{r:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo == lo else "")
        a = agree[p]
        share = a.agreed / a.decisions if a.decisions else float("nan")
        size = a.scored / a.decisions if a.decisions else float("nan")
        lines.append(f"| {p.label} | {100 * cells['shipped'][0]:.1f}% / {cells['shipped'][1]:.3f} | "
                     f"{100 * cells['all scored'][0]:.1f}% / {cells['all scored'][1]:.3f} | {ratio} | "
                     f"{100 * share:.2f}% of {a.decisions:,} | {size:.1f} of {p.replicas} |")
        data[p.label] = {pol: {"hit_rate": c[0], "ttft_p90_s": c[1], "p90_by_seed": c[2]} for pol, c in cells.items()}
        data[p.label]["agreement"] = {"decisions": a.decisions, "agreed": a.agreed, "scored": a.scored}
    table = "\n".join(lines)
    print(table)
    if not args.quick and not args.per_scorer:
        md = (f"{seeds} seeds a point; cells are the mean hit rate and the median TTFT p90.\n\n{table}\n")
        print(f"wrote {write_result(args.result_name, 'The shortlist in large pools: the default as shipped against every candidate scored', md, data)}")


if __name__ == "__main__":
    main()
