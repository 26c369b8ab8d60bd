"""The shortlist in large pools: the default profile as shipped against the same profile
scoring every candidate (``shortlist: {enabled: false}``), in the replay, at pool sizes where
the shortlist runs (the profile sweep's 4 and 8 replicas are scored whole).

Points: chat, RAG, shared-prefix and the Mooncake trace at 32 replicas, chat at 64. Per point
and policy: mean hit rate and median TTFT p90 over ``--seeds``, the p90 ratio seed by seed
with its 90% interval, and how often the shortlist's pick had the best total of all when the
same decision was scored over every candidate in its shadow (nothing committed).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import pool_map, replay  # noqa: E402
from bench.harness import count  # noqa: E402
from bench.results import table, write_result  # noqa: E402
from bench.stats import paired_ratio  # noqa: E402
from epp.config.loader import default_config, loads_config  # noqa: E402
from epp.framework.endpoint import Endpoint  # noqa: E402
from epp.framework.types import CycleState, ProfileResult  # noqa: E402
from epp.scheduling.profile import Profile  # noqa: E402
from simulator.replay import workload as wl  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402

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
)  # fmt: skip
QUICK = {"chat 64/s, 32 replicas": (("num_sessions", 128), ("num_system_prompts", 64)),
         "rag 64/s, 32 replicas": (("num_requests", 768), ("num_docs", 1024))}  # fmt: skip


def workload_of(point: Point, quick: bool, seed: int) -> wl.Workload:
    if point.workload == "mooncake":
        return wl.MooncakeTrace.load(ROOT / wl.DEFAULT_TRACE, 1 / point.rate, 2000 if quick else 0)
    params: dict[str, Any] = dict(QUICK.get(point.label, point.params) if quick else point.params)
    params["seed"] = seed
    return wl.scaled_rate(wl.build_generator(point.workload, params), point.rate)


AGREEMENT: Counter[str] = Counter()
"""Per worker: shortlisted ``decisions``, those whose pick had the best total of all
(``agreed``), and the endpoints the shortlist ``scored``."""


def _shadowed(run: Any) -> Any:
    """``Profile.run`` that also counts a shortlisted decision into ``AGREEMENT``."""

    def shadow_run(self: Profile, state: CycleState, endpoints: Sequence[Endpoint], n: int) -> ProfileResult:  # fmt: skip
        result: ProfileResult = run(self, state, endpoints, n)
        if len(result.candidates) == len(endpoints) or not result.targets:
            return result
        everyone = Profile("shadow", self.filters, self.scorers, self.picker,
                           dataclasses.replace(self.shortlist_config, enabled=False))  # fmt: skip
        rng, state.rng = state.rng, random.Random(0)
        full = run(everyone, state, endpoints, n)
        state.rng = rng
        totals = dict(zip((e.id for e in full.candidates), full.totals, strict=True))
        agreed = totals[result.targets[0].id] >= max(full.totals) - 1e-9
        AGREEMENT.update(decisions=1, scored=len(result.candidates), agreed=agreed)
        return result

    return shadow_run


def run_one(job: tuple[Point, str, int, bool]) -> tuple[Point, str, float, float, Counter[str]]:
    point, policy, seed, quick = job
    AGREEMENT.clear()  # a worker runs many jobs
    cfg = loads_config(POLICIES[policy]) if POLICIES[policy] else default_config()
    run = _shadowed(Profile.run) if policy == "shipped" else Profile.run
    with patch.object(Profile, "run", run):
        s = replay(ReplayConfig(replicas=point.replicas, kv_blocks=point.kv_blocks, seed=seed),
                   workload_of(point, quick, seed), "epp", cfg)  # fmt: skip
    return point, policy, s.hit_rate, s.ttft_p90_s, Counter(AGREEMENT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, three points, no page")
    ap.add_argument("--seeds", type=count, default=3)
    args = ap.parse_args()
    seeds = 1 if args.quick else args.seeds
    points = [p for p in POINTS if not args.quick or p.label in QUICK or p.workload == "shared-prefix"]  # fmt: skip
    jobs = [(p, pol, seed, args.quick) for p in points for pol in POLICIES for seed in range(seeds)]
    runs: dict[tuple[Point, str], list[tuple[float, float]]] = {}  # seed by seed (pool_map keeps the order)
    agree: dict[Point, Counter[str]] = {p: Counter() for p in points}
    for point, policy, hit, p90, ag in pool_map(run_one, jobs):
        runs.setdefault((point, policy), []).append((hit, p90))
        agree[point] += ag
    rows, data = [], {}
    for p in points:
        cells = {}
        for pol in POLICIES:
            hits, p90s = zip(*runs[p, pol], strict=True)
            cells[pol] = (statistics.mean(hits), statistics.median(p90s), list(p90s))
        r, lo, hi = paired_ratio(cells["shipped"][2], cells["all scored"][2])
        a, n = agree[p], agree[p]["decisions"] or float("nan")
        rows.append([p.label, f"{100 * cells['shipped'][0]:.1f}% / {cells['shipped'][1]:.3f}",
                     f"{100 * cells['all scored'][0]:.1f}% / {cells['all scored'][1]:.3f}",
                     f"{r:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo == lo else ""),
                     f"{100 * a['agreed'] / n:.2f}% of {a['decisions']:,}", f"{a['scored'] / n:.1f} of {p.replicas}"])  # fmt: skip
        data[p.label] = {pol: {"hit_rate": c[0], "ttft_p90_s": c[1], "p90_by_seed": c[2]} for pol, c in cells.items()}  # fmt: skip
        data[p.label]["agreement"] = {k: a[k] for k in ("decisions", "agreed", "scored")}
    md = table(["point", "shipped: hit rate / TTFT p90 (s)", "every candidate scored",
                "p90 shipped / all scored, seed by seed", "pick as good as the full set's",
                "endpoints scored a decision"], rows)  # fmt: skip
    print(md)
    if not args.quick:
        md = f"{seeds} seeds a point; cells are the mean hit rate and the median TTFT p90.\n\n{md}\n"  # fmt: skip
        title = "The shortlist in large pools: the default as shipped against every candidate scored"  # fmt: skip
        print(f"wrote {write_result('shortlist', title, md, data)}")


if __name__ == "__main__":
    main()
