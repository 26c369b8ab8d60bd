"""Every shipped profile against the default, the baselines, ``ttft-oracle`` and the TTFT
bound, on every workload the replay has: the table that shows the default is the best epp
has, or where it is not.

Workloads (``simulator.replay``; ``grid`` has the points): the Mooncake trace (8 replicas);
the chat, RAG and shared-prefix generators (4 replicas; three loads x three KV sizes), each
also with four epp replicas that do not share what they learn (``routers``); ``lora``, the
support desk of docs/examples/support-desk.jsonl with 1, 2 and 4 adapters a batch. Per point
and policy: hit rate and TTFT p90 over ``--seeds`` seeds (mean hit rate, median p90); a seed
draws the workload and the replayer's random choices. ``bound``: a TTFT p90 no policy can beat
(``simulator.replay.bound``); ``ttft-oracle`` (on the generated workloads with one router)
sends each request where a what-if run gives its first token soonest.

The verdicts are issue 40's, each stated on the page. ``--quick --check`` is CI's: exit 1 when
another shipped profile's p90 beats the default's by more than seed noise (``check``). The
full sweep with ``--ttft-oracle`` takes about 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import results  # noqa: E402
from bench.stats import paired_ratio, verdict  # noqa: E402
from simulator.replay.bound import bound_percentile, ttft_lower_bounds  # noqa: E402
from simulator.replay.policies import policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer  # noqa: E402
from simulator.replay.report import PolicyStats, summarize  # noqa: E402
from simulator.replay.requestlog import RequestLog  # noqa: E402
from simulator.replay.workload import (  # noqa: E402
    DEFAULT_TRACE,
    MooncakeTrace,
    Workload,
    build_generator,
    scaled_rate,
)

PROFILES = {"default": "epp", "prefix-load": "epp:prefix-load",
            "predicted-blend": "epp:predicted-blend",
            "predicted-ttft": "epp:predicted-ttft", "filter-chain": "epp:filter-chain",
            "cache-aware-profile": "epp:cache-aware", "agentic": "epp:agentic",
            "sticky": "epp:sticky"}  # fmt: skip
BASELINES = {"sglang": "cache-aware", "least-load": "least-load", "round-robin": "round-robin",
             "random": "random", "chwbl": "chwbl"}  # fmt: skip
REPLACED = ("prefix-load", "predicted-ttft")  # the two the default must match or beat (issue 40)


@dataclass(frozen=True)
class Point:
    workload: str
    load: float
    kv_blocks: int
    replicas: int
    routers: int = 1
    # 0: the generator's or the replay's own (32 prompts a group, 8 chat system prompts)
    per_group: int = 0
    max_loras: int = 0
    system_prompts: int = 0

    @property
    def label(self) -> str:
        unit = "x" if self.workload in TRACES else "/s"
        extra = f", {self.routers} routers" if self.routers > 1 else ""
        extra += f", {self.per_group} a group" if self.per_group else ""
        extra += f", {self.max_loras} adapter{'s' if self.max_loras > 1 else ''} a batch" if self.max_loras else ""  # fmt: skip
        extra += f", {self.system_prompts} system prompts" if self.system_prompts else ""
        return f"{self.workload} {self.load:g}{unit} {self.kv_blocks} KV{extra}"


LORA_TRACE = Path("docs/examples/support-desk.jsonl")
TRACES = ("mooncake", "lora")  # fixed traces: a load is a rate multiplier, seeds vary only the replayer
WORKLOADS = ("mooncake", "chat", "rag", "shared-prefix", "lora")


def grid(names: list[str], quick: bool) -> list[Point]:
    if quick:
        full = [Point("chat", 8, 1024, 4), Point("rag", 8, 4096, 4),
                Point("shared-prefix", 16, 1024, 4), Point("shared-prefix", 8, 2048, 4, routers=4),
                Point("mooncake", 0.75, 8192, 8), Point("lora", 2.5, 1024, 4, max_loras=1)]  # fmt: skip
        return [p for p in full if p.workload in names]
    spec = {
        "mooncake": ((1.0, 0.75), (4096, 8192, 16384), 8, (1.0, 8192)),
        "chat": ((4.0, 8.0, 12.0), (1024, 2048, 4096), 4, (8.0, 2048)),
        "rag": ((2.0, 4.0, 8.0), (2048, 4096, 8192), 4, (4.0, 4096)),
        "shared-prefix": ((4.0, 8.0, 16.0), (1024, 2048, 4096), 4, (8.0, 2048)),
    }
    points = []
    for name in names:
        if name == "lora":
            points += [Point("lora", load, 1024, 4, max_loras=n) for load in (1.0, 2.5) for n in (1, 2, 4)]  # fmt: skip
            continue
        loads, kvs, replicas, (r_load, r_kv) = spec[name]
        points += [Point(name, load, kv, replicas) for load in loads for kv in kvs]
        points.append(Point(name, r_load, r_kv, replicas, routers=4))
        if name == "chat":
            points.append(Point(name, 12.0, 1024, replicas, system_prompts=6))
    return points


def workload_of(point: Point, quick: bool, seed: int = 0) -> Workload:
    """The point's workload; a generator's draws (sessions, documents, arrival times) from ``seed``."""
    if point.workload == "mooncake":
        return MooncakeTrace.load(ROOT / DEFAULT_TRACE, point.load, 1000 if quick else 0)
    if point.workload == "lora":
        return RequestLog.load(ROOT / LORA_TRACE, time_scale=1 / point.load)
    params: dict[str, Any] = {"seed": seed}
    if quick:
        params |= {"chat": {"num_sessions": 32}, "rag": {"num_requests": 192},
                   "shared-prefix": {"num_prompts_per_group": 12}}[point.workload]  # fmt: skip
    if point.per_group:
        params["num_prompts_per_group"] = point.per_group
    if point.system_prompts:
        params["num_system_prompts"] = point.system_prompts
    return scaled_rate(build_generator(point.workload, params), point.load)


def config_of(point: Point, seed: int) -> ReplayConfig:
    cfg = ReplayConfig(replicas=point.replicas, kv_blocks=point.kv_blocks, seed=seed, routers=point.routers)  # fmt: skip
    return dataclasses.replace(cfg, max_loras=point.max_loras) if point.max_loras else cfg


def replay(cfg: ReplayConfig, workload: Workload, spec: str, epp_config: Any = None) -> PolicyStats:
    """One policy (an ``epp-sim replay --policies`` name; ``epp_config`` for ``epp``) replayed
    on ``workload``: its summary. The replay benches' one way to run a policy."""
    name, factory = policy_factory(spec, epp_config)
    return summarize(Replayer(cfg).run(workload, factory, name))


def pool_map(fn: Callable[[Any], Any], jobs: Iterable[Any], workers: int = 2) -> list[Any]:
    """``fn`` over ``jobs`` in up to ``workers`` processes (the machine's cores at most), in order."""
    with ProcessPoolExecutor(max_workers=min(workers, os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, jobs))


def run_one(job: tuple[Point, str, str, int, bool]) -> tuple[Point, str, float, float]:
    point, label, spec, seed, quick = job
    s = replay(config_of(point, seed), workload_of(point, quick, seed), spec)
    return point, label, s.hit_rate, s.ttft_p90_s


def bound_p90(cfg: ReplayConfig, workload: Workload) -> float:
    """The p90 of the TTFT lower bound on ``workload`` (``simulator.replay.bound``)."""
    bounds = ttft_lower_bounds(workload.requests(), cfg.cost, cfg.block_size_tokens, cfg.model)
    return bound_percentile(bounds, cfg.kv_blocks, 90)


def bound_of(job: tuple[Point, bool, int]) -> tuple[Point, float]:
    """The TTFT bound's p90, the median over the seeds' workloads."""
    point, quick, seeds = job
    runs = range(seeds if point.workload not in TRACES else 1)
    return point, statistics.median(bound_p90(config_of(point, 0), workload_of(point, quick, s)) for s in runs)  # fmt: skip


SEEDS = 8

Table = dict[Point, dict[str, tuple[float, float]]]
PerSeed = dict[Point, dict[str, list[float]]]
"""Per point and policy, the seeds' TTFT p90s in seed order."""


def measure(points: list[Point], policies: dict[str, str], seeds: int,
            quick: bool) -> tuple[Table, dict[Point, float], PerSeed]:  # fmt: skip
    jobs = [(pt, label, spec, seed, quick) for pt in points for label, spec in policies.items()
            for seed in range(seeds)
            if not (label == "ttft-oracle" and (pt.workload == "mooncake" or pt.routers > 1))]  # fmt: skip
    runs: dict[Point, dict[str, list[tuple[float, float]]]] = {}
    for pt, label, hit, p90 in pool_map(run_one, jobs):
        runs.setdefault(pt, {}).setdefault(label, []).append((hit, p90))
    bounds = dict(pool_map(bound_of, [(pt, quick, seeds) for pt in points]))
    table = {pt: {label: (statistics.mean(h for h, _ in rs), statistics.median(p for _, p in rs))
                  for label, rs in cell.items()} for pt, cell in runs.items()}  # fmt: skip
    per_seed = {pt: {label: [p for _, p in rs] for label, rs in cell.items()}
                for pt, cell in runs.items()}  # fmt: skip
    return table, bounds, per_seed


def render(points: list[Point], table: Table, bounds: dict[Point, float], policies: dict[str, str],
           per_seed: PerSeed) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The markdown table and the verdicts."""
    others = [p for p in policies if p != "default"]
    rows = []
    fails_p90, fails_hit, fails_hit_nw, ratios, headroom, closed = [], [], [], [], 0, 0
    for pt in points:
        cell = table[pt]
        d_hit, d_p90 = cell["default"]
        best_replaced = min(cell[p][1] for p in REPLACED)
        ratio = d_p90 / best_replaced if best_replaced > 0 else math.nan
        ratios.append(ratio)
        if ratio > 1.02:
            fails_p90.append(f"{pt.label} ({ratio:.3f}x, {1000 * (d_p90 - best_replaced):+.0f} ms)")
        best = max(cell, key=lambda p: cell[p][0])
        if d_hit < cell[best][0] - 0.005:
            fails_hit.append(f"{pt.label} ({100 * d_hit:.1f}% vs {best} {100 * cell[best][0]:.1f}%)")  # fmt: skip
        # a higher hit rate bought with a worse tail is not what the default should match
        best_nw = max((p for p, (_, v) in cell.items() if v <= d_p90), key=lambda p: cell[p][0])
        if d_hit < cell[best_nw][0] - 0.005:
            fails_hit_nw.append(f"{pt.label} ({100 * d_hit:.1f}% vs {best_nw} {100 * cell[best_nw][0]:.1f}% "
                                f"at p90 {cell[best_nw][1]:.2f})")  # fmt: skip
        if "ttft-oracle" in cell and cell["ttft-oracle"][1] <= 0.9 * cell["prefix-load"][1]:
            oracle, old = cell["ttft-oracle"][1], cell["prefix-load"][1]
            headroom += 1
            closed += (old - d_p90) >= 0.5 * (old - oracle)
        cells = [cell_text(cell[p]) if p in cell else "-" for p in others]
        rows.append([pt.label, f"**{cell_text(cell['default'])}**", *cells, f"{bounds[pt]:.2f}", f"{ratio:.2f}"])  # fmt: skip
    n = len(points)
    geo = math.exp(statistics.mean(math.log(r) for r in ratios if r > 0))
    verdicts = [
        f"- TTFT p90 within 1.02x the better of {' and '.join(REPLACED)}: {n - len(fails_p90)} "
        f"of {n} points (geometric mean of the ratio {geo:.3f})" + not_at(fails_p90, ", "),
        f"- hit rate within 0.5 point of the best policy's: {n - len(fails_hit)} of {n} points" + not_at(fails_hit),
        f"- hit rate within 0.5 point of the best policy whose TTFT p90 is no worse than the default's: "
        f"{n - len(fails_hit_nw)} of {n} points" + not_at(fails_hit_nw),
    ]  # fmt: skip
    verdicts += paired_verdicts(points, per_seed)
    losses = check(points, table, per_seed)
    verdicts.append("- another shipped profile ahead of the default beyond seed noise (`--check`'s "
                    "rule): " + ("; ".join(losses) if losses else "at no point"))  # fmt: skip
    if any("ttft-oracle" in table[pt] for pt in points):
        verdicts.append(f"- points where ttft-oracle's p90 is 10% or more below prefix-load's: "
                        f"{headroom}; the default closes half of that gap or more at {closed}")  # fmt: skip
    head = ["point", "default", *others, "bound p90", "default vs best of " + " & ".join(REPLACED)]
    md = ("Each cell: hit rate / TTFT p90 (s); the default's in bold. Mean hit rate and median p90 over the "
          f"seeds.\n\n{results.table(head, rows)}\n\n" + "\n".join(verdicts) + "\n")  # fmt: skip
    data = {"points": [{"point": pt.label, **dataclasses.asdict(pt), "bound_p90": bounds[pt],
                        "policies": {p: {"hit": h, "p90": v, "p90_by_seed": per_seed[pt][p]}
                                     for p, (h, v) in table[pt].items()}} for pt in points],
            "fails_p90": fails_p90, "fails_hit": fails_hit, "fails_hit_no_worse_p90": fails_hit_nw, "geomean_ratio": geo}  # fmt: skip
    return md, data


def cell_text(figures: tuple[float, float]) -> str:
    return f"{100 * figures[0]:.1f}% / {figures[1]:.2f}"


def not_at(misses: list[str], sep: str = "; ") -> str:
    return f"; not at: {sep.join(misses)}" if misses else ""


def paired_verdicts(points: list[Point], per_seed: PerSeed) -> list[str]:
    """The default against each profile it replaced, seed by seed (``bench.stats``)."""
    behind, level = [], 0
    for pt in points:
        cell = per_seed[pt]
        for p in REPLACED:
            ratio, lo, hi = paired_ratio(cell[p], cell["default"])
            said = verdict(lo, hi)
            if said == "behind":
                behind.append(f"{pt.label} ({p} {ratio:.2f}x [{lo:.2f}, {hi:.2f}])")
            elif said == "level":
                level += 1
    if not behind and not level:
        return []
    return [f"- seed by seed (the geometric mean of {' and '.join(REPLACED)}'s p90 over the "
            f"default's on the same seed, 90% bootstrap interval): the default behind at "
            f"{len(behind)} point-profile pairs" + (f": {'; '.join(behind)}" if behind else "")
            + f"; level at {level}; ahead at the rest"]  # fmt: skip


def check(points: list[Point], table: Table, per_seed: PerSeed) -> list[str]:
    """Where the default loses to another shipped profile by more than seed noise: paired seed
    by seed, its TTFT p90 over the other's is above 1.05x (geometric mean) with the 90%
    interval above 1, and its median p90 more than 5 ms above. (Medians alone flip on one
    seed where the placement of a few prompt groups decides the p90.)"""
    losses = []
    for pt in points:
        cell, seeds = table[pt], per_seed[pt]
        d_p90 = cell["default"][1]
        for p in (p for p in PROFILES if p != "default" and p in cell):
            ratio, lo, hi = paired_ratio(seeds["default"], seeds[p])
            p90 = cell[p][1]
            if ratio > 1.05 and lo > 1.0 and d_p90 > p90 + 0.005:
                losses.append(f"{pt.label}: default p90 {d_p90:.3f}s vs {p} {p90:.3f}s, "
                              f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}] seed by seed")  # fmt: skip
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI-sized sweep: a few small points, the shipped profiles")  # fmt: skip
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the default loses to another shipped profile beyond noise")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per point ({SEEDS})")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")  # fmt: skip
    ap.add_argument("--ttft-oracle", action="store_true", help="add the ttft-oracle policy")
    ap.add_argument("--candidate", action="append", default=[], metavar="NAME=CONFIG",
                    help="also run this epp config (a file or shipped name) as column NAME: a "
                    "profile under study, not held to --check (repeatable)")  # fmt: skip
    ap.add_argument("--no-baselines", action="store_true", help="leave the non-epp baselines out")
    ap.add_argument("--profiles", default="",
                    help="comma-separated shipped profiles to run (default: all of them; the "
                    "default and the two it replaced always run)")  # fmt: skip
    ap.add_argument("--result-name", default="", help="write docs/results/NAME.md and .json")
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    keep = {p.strip() for p in args.profiles.split(",") if p.strip()} or set(PROFILES)
    candidates = [c.partition("=") for c in args.candidate]
    if set(names) - set(WORKLOADS) or keep - set(PROFILES) or args.seeds < 1:
        ap.error(f"--workloads of {', '.join(WORKLOADS)}; --profiles of {', '.join(PROFILES)}; --seeds >= 1")  # fmt: skip
    if any(not name or not sep or not spec for name, sep, spec in candidates):
        ap.error("--candidate expects NAME=CONFIG")
    if "mooncake" in names and not (ROOT / DEFAULT_TRACE).exists():
        print(f"(trace {ROOT / DEFAULT_TRACE} not found: no Mooncake points)")
        names.remove("mooncake")
    policies = {k: v for k, v in PROFILES.items() if k in keep | {"default", *REPLACED}}
    policies |= {name: f"epp:{spec}" for name, _, spec in candidates}
    if not args.quick and not args.no_baselines:
        policies.update(BASELINES)
    if args.ttft_oracle:
        policies["ttft-oracle"] = "ttft-oracle"
    points = grid(names, args.quick)
    table, bounds, per_seed = measure(points, policies, args.seeds, args.quick)
    md, data = render(points, table, bounds, policies, per_seed)
    print(md)
    if args.result_name:
        title = "The default profile against every shipped profile, the baselines and the TTFT bound, in the replay"
        path = results.write_result(args.result_name, title, md, {**data, "seeds": args.seeds, "quick": args.quick})  # fmt: skip
        print(f"wrote {path.relative_to(ROOT)}")
    if args.check:
        for loss in (losses := check(points, table, per_seed)):
            print("LOSS", loss)
        if losses:
            return 1
        print("the default is at or above every other shipped profile at every point")
    return 0


if __name__ == "__main__":
    sys.exit(main())
