"""Replay vs live stack: one inference-perf shared-prefix recipe through ``epp-sim replay``
(simulated time) and through the live local stack on emulated replicas (real processes,
wall clock), per policy. Target: hit rates within 2 points and the same ranking.

Both read the same recipe and send the same request sequence (the stack's single-turn open
loop follows the replay's seeded order); texts, arrival jitter and the random policies' draws
differ. 4 replicas of 256 KV blocks (4k tokens) against 8 system prompts of 1,000 tokens, so
routing decides what stays cached.

    python bench/bench_replay_vs_stack.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """\
load:
  type: constant
  stages:
  - {rate: 8, duration: 16}
api: {type: completion}
data:
  type: shared_prefix
  shared_prefix:
    num_groups: 8
    num_prompts_per_group: 16
    system_prompt_len: 1000
    question_len: 50
    output_len: 20
"""
REPLICAS, KV_BLOCKS, SEED = 4, 256, 1
POLICIES = ("epp", "random", "round-robin")


def sim(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "simulator.cli", *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp, "recipe.yaml")
        recipe.write_text(RECIPE)
        out = Path(tmp, "replay.json")
        sim("replay", "--workload", "shared-prefix", "--workload-file", str(recipe),
            "--set", f"seed={SEED}", "--policies", ",".join(POLICIES), "--replicas",
            str(REPLICAS), "--kv-blocks", str(KV_BLOCKS), "--no-progress", "--out", str(out))  # fmt: skip
        replay = {r["policy"]: r["hit_rate"] for r in json.loads(out.read_text())}
        live: dict[str, float] = {}
        for baseline in POLICIES[1:]:
            run_dir = Path(tmp, baseline)
            sim("stack", "--demo", "--workload", str(recipe), "--replicas", str(REPLICAS),
                "--kv-blocks", str(KV_BLOCKS), "--baseline", baseline, "--out-dir", str(run_dir))  # fmt: skip
            for run in json.loads(Path(run_dir, "demo.json").read_text())["runs"]:
                live.setdefault(run["policy"], run["hit_rate"])
    print(f"replay vs live stack: {REPLICAS} emulated replicas x {KV_BLOCKS} KV blocks, "
          "8 system prompts x 16 questions (1,000 + 50 tokens), 8 req/s")
    print(f"{'policy':12} {'replay':>8} {'live':>8} {'apart':>8}")
    for p in POLICIES:
        print(f"{p:12} {replay[p]:>8.1%} {live[p]:>8.1%} {abs(replay[p] - live[p]) * 100:>6.1f} pt")
    same = sorted(POLICIES, key=replay.__getitem__) == sorted(POLICIES, key=live.__getitem__)
    worst = max(abs(replay[p] - live[p]) for p in POLICIES) * 100
    print(f"largest gap {worst:.1f} points (target <= 2); same ranking: {same}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
