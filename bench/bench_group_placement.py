"""Where a policy puts each new prompt group, against random balanced placements (issue 40's
shared-prefix points with room in the caches).

At shared-prefix 16 req/s with 2,048 KV blocks a replica every policy reaches the same hit
rate: each group's system prompt is prefilled once, where its first request goes, and the
rest follow. A run's TTFT p90 is then a function of the 16 group homes. Per seed: the p90 of
``--maps`` random balanced maps (min / median / max), and each policy's p90 with the share of
those maps that beat it (50%: a random map's; lower is better). Policies: epp's ``default``,
``prefix-load`` and ``predicted-ttft``, ``session-affinity``, and three rules that send a new
group to the replica with the fewest in flight, the fewest homes, or round-robin.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from simulator.replay.policies import Arrival, Cluster, Policy, policy_factory
from simulator.replay.replayer import Replayer
from simulator.replay.report import summarize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_profiles import Point, config_of, pool_map, workload_of
from bench.harness import count, ints
from bench.stats import paired_ratio

PROFILES = {"default": "epp", "prefix-load": "epp:prefix-load",
            "predicted-ttft": "epp:predicted-ttft", "session-affinity": "session-affinity"}  # fmt: skip
RULES = ("least-in-flight", "fewest-homes", "round-robin")
GROUPS = 16  # the shared-prefix generator's num_groups
REPLICAS, RATE, KV_BLOCKS = 4, 16.0, 2048


class Placement(Policy):
    """A group's first request by ``rule`` (or a fixed ``homes`` map); the rest follow it."""

    def __init__(self, cluster: Cluster, rule: str, homes: dict[str, int] | None = None) -> None:
        self.rule = rule
        self.homes = dict(homes or {})
        self.in_flight = cluster.in_flight
        self.rng = random.Random(cluster.seed)

    def pick(self, arrival: Arrival, now_s: float) -> int:
        group = arrival.request.session_id
        if (home := self.homes.get(group)) is None:
            n, homes = len(self.in_flight), Counter(self.homes.values())
            if self.rule == "round-robin":
                home = len(self.homes) % n
            elif self.rule == "fewest-homes":
                home = min(range(n), key=lambda r: (homes[r], self.in_flight[r], self.rng.random()))
            else:  # least-in-flight
                home = min(range(n), key=lambda r: (self.in_flight[r], self.rng.random()))
            self.homes[group] = home
        return home


def random_map(seed: int, k: int) -> dict[str, int]:
    rng = random.Random(1_000 * seed + k)
    homes = [r for r in range(REPLICAS) for _ in range(GROUPS // REPLICAS)]
    rng.shuffle(homes)
    return {f"g{g}": homes[g] for g in range(GROUPS)}


Job = tuple[int, int, str | int]
"""(prompts a group, seed, map index or policy)"""


def run(job: Job) -> tuple[int, str | int, float]:
    per_group, seed, what = job
    point = Point("shared-prefix", RATE, KV_BLOCKS, REPLICAS, per_group=per_group)
    factory: Callable[[Cluster], Policy]
    if isinstance(what, int):
        homes = random_map(seed, what)
        name, factory = "map", lambda c: Placement(c, "", homes)
    elif what in PROFILES:
        name, factory = policy_factory(PROFILES[what])
    else:
        name, factory = what, lambda c: Placement(c, what)
    result = Replayer(config_of(point, seed)).run(workload_of(point, False, seed), factory, name)
    return seed, what, summarize(result).ttft_p90_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=count, default=8, help="workload seeds (8)")
    ap.add_argument("--maps", type=count, default=20, help="random balanced maps per seed (20)")
    ap.add_argument("--prompts-per-group", type=ints, default=[32],
                    help="comma-separated prompts per group, one table each (32: the sweep's)")  # fmt: skip
    args = ap.parse_args()
    for per_group in args.prompts_per_group:
        table(per_group, args.seeds, args.maps)
    return 0


def table(per_group: int, seeds: int, n_maps: int) -> None:
    policies: list[str] = [*PROFILES, *RULES]
    names: list[str | int] = [*range(n_maps), *policies]
    jobs: list[Job] = [(per_group, seed, what) for seed in range(seeds) for what in names]
    p90: dict[int, dict[str | int, float]] = {}
    for seed, what, value in pool_map(run, jobs):
        p90.setdefault(seed, {})[what] = value
    print(f"# shared-prefix {RATE:g} req/s, {KV_BLOCKS} KV blocks, {REPLICAS} replicas, {GROUPS} groups of "
          f"{per_group} prompts: TTFT p90 (ms) against {n_maps} random balanced maps per seed\n")  # fmt: skip
    print("| seed | random maps min / median / max | " + " | ".join(policies) + " |")
    print("|---:|---:|" + "---:|" * len(policies))
    shares: dict[str, list[float]] = {p: [] for p in policies}
    for seed, cell in sorted(p90.items()):
        maps = sorted(v for k, v in cell.items() if isinstance(k, int))
        row = f"| {seed} | {1e3 * maps[0]:.0f} / {1e3 * statistics.median(maps):.0f} / {1e3 * maps[-1]:.0f} |"
        for p in policies:
            shares[p].append(sum(v < cell[p] for v in maps) / len(maps))
            row += f" {1e3 * cell[p]:.0f} ({100 * shares[p][-1]:.0f}%) |"
        print(row)
    print("\nShare of random balanced maps with a lower p90, mean over the seeds (50%: a random "
          "balanced map's; lower is better), and the default's p90 over the policy's, paired by "
          "seed [90% interval]:")  # fmt: skip
    default = [p90[s]["default"] for s in sorted(p90)]
    for p in policies:
        ratio, lo, hi = paired_ratio(default, [p90[s][p] for s in sorted(p90)])
        interval = f"[{lo:.3f}, {hi:.3f}]" if lo == lo else "(too few seeds for an interval)"  # NaN: < 3 seeds
        vs = "" if p == "default" else f"; default / {p} {ratio:.3f} {interval}"
        print(f"- {p}: {100 * statistics.mean(shares[p]):.0f}%{vs}")
    print()


if __name__ == "__main__":
    sys.exit(main())
