"""Where a demo run's time to first token went, from its ``requests.jsonl`` (``epp-sim stack
--demo --out-dir DIR`` writes one): per policy, client TTFT by conversation turn (turn 0
prefills the group's system prompt cold), the prompt tokens the servers found uncached, and
the conversations moved to another server than their turn before.

With several run directories, or one written with ``--rounds`` (each round a run), it ends
with the runs side by side (their ``demo.json``): per run and policy the servers' TTFT mean /
p90, hit rate and throughput, in how many runs the first policy (epp) had the lower figures,
and the paired ratio of its figure over each other's (bench/stats.py), per directory and
pooled: sessions differ more than the rounds of one session do.

    python bench/report_requests.py DIR_OR_FILE [...] [--alias NAME=COLUMN] [--across-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import pct, table  # noqa: E402
from bench.stats import describe  # noqa: E402
from simulator.fitlog import stack_rows  # noqa: E402

FIELDS = ("server_ttft_mean_ms", "server_ttft_p90_ms", "hit_rate", "req_per_s")
"""What a run's ``demo.json`` row gives per policy, side by side."""


def moves(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(turns sent to another server than the conversation's turn before, those of them
    that found less than half their prompt cached, turns after the first)."""
    by = {(r.get("round", 0), r["user"], r["turn"]): r for r in rows}
    moved = lost = later = 0
    for (k, user, turn), r in by.items():
        if (before := by.get((k, user, turn - 1))) is None:
            continue
        later += 1
        if r["upstream"] != before["upstream"]:
            moved += 1
            lost += r["cached_tokens"] < r["prompt_tokens"] / 2
    return moved, lost, later


def splits(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Per round: the conversation groups (one system prompt each) whose requests went to more
    than one server, and the prompt tokens the servers found uncached, in thousands."""
    out = []
    for k in sorted({r.get("round", 0) for r in rows}):
        run = [r for r in rows if r.get("round", 0) == k]
        servers: dict[Any, set[str]] = defaultdict(set)
        for r in run:
            servers[r["group"]].add(r["upstream"])
        uncached = sum(r["prompt_tokens"] - r["cached_tokens"] for r in run) / 1e3
        out.append((sum(len(s) > 1 for s in servers.values()), uncached))
    return out


def report(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"== {name}")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        ok = [r for r in rows if r["policy"] == policy and r["status"] == 200 and r["ttft_s"]]
        if not ok:
            print(f"{policy}: no successful requests")
            continue
        ttft = [r["ttft_s"] * 1e3 for r in ok]
        print(f"{policy}: {len(ok)} requests, client TTFT mean {statistics.fmean(ttft):.0f} ms, "
              f"p50 {pct(ttft, 0.5):.0f}, p90 {pct(ttft, 0.9):.0f}")  # fmt: skip
        for turn in sorted({r["turn"] for r in ok}):
            sel = [r for r in ok if r["turn"] == turn]
            t = [r["ttft_s"] * 1e3 for r in sel]
            prompt = sum(r["prompt_tokens"] for r in sel)
            cached = sum(r["cached_tokens"] for r in sel) / max(1, prompt)
            print(f"  turn {turn}: {len(sel):>4} requests, TTFT mean {statistics.fmean(t):>5.0f} "
                  f"p90 {pct(t, 0.9):>5.0f} ms, {cached:.0%} of prompt tokens cached")  # fmt: skip
        per_round = splits(ok)
        uncached = ", ".join(f"{u:.0f}k" for _, u in per_round)
        print(f"  per round, prompt tokens the servers found uncached: {uncached}")
        fronts: dict[int, set[str]] = defaultdict(set)
        for r in ok:
            fronts[r.get("round", 0)].add(r["upstream"])
        if all(len(f) > 1 for f in fronts.values()):  # behind one front (a router): unknown
            moved, lost, later = moves(ok)
            print(f"  conversations moved: {moved} of {later} later turns went to another server "
                  f"than the turn before, {lost} of them with under half the prompt cached")  # fmt: skip
            split = ", ".join(str(n) for n, _ in per_round)
            print(f"  per round, groups on more than one server: {split}")


def across_runs(dirs: list[Path], alias: dict[str, str] | None = None) -> None:
    """The runs' demo.json side by side, and how often the first policy came out ahead.
    ``alias`` renames columns (one policy named differently in different experiments)."""
    alias = alias or {}
    runs: dict[str, dict[str, dict[str, Any]]] = {}  # run: policy: figures
    session: dict[str, str] = {}
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # several ``.../demo``: name them by their parents
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    for d, dir_name in zip(dirs, names, strict=True):
        if not (d / "demo.json").is_file():
            continue
        doc = json.loads((d / "demo.json").read_text())
        rows = doc.get("by_round", doc["runs"])
        for k in sorted({r.get("round", 0) for r in rows}):  # --rounds: each round its own run
            name = dir_name if "by_round" not in doc else f"{dir_name}#{k + 1}"
            mine = [r for r in rows if r.get("round", 0) == k]
            runs[name] = {alias.get(r["policy"], r["policy"]): r for r in mine}
            session[name] = dir_name
    if len(runs) < 2:
        return
    policies = list(dict.fromkeys(p for by in runs.values() for p in by))

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        steal = f", steal {r['cpu_steal']:.0%}" if r.get("cpu_steal", 0) > 0.005 else ""
        return f"{r[FIELDS[0]]:.0f} / {r[FIELDS[1]]:.0f}, {r['hit_rate']:.1%}, {r['req_per_s']:.1f}{steal}"

    means = [{k: statistics.fmean(by[p][k] for by in runs.values() if p in by) for k in FIELDS}
             for p in policies]  # fmt: skip
    print("== across runs: server TTFT mean / p90 (ms), hit rate, req/s")
    print(table(["run", *policies], [*([n, *(cell(by.get(p)) for p in policies)] for n, by in runs.items()),
                                     ["mean", *map(cell, means)]]))  # fmt: skip
    first = policies[0]
    for other in policies[1:]:
        paired = {n: by for n, by in runs.items() if first in by and other in by}
        below = [sum(by[first][k] < by[other][k] for by in paired.values()) for k in FIELDS[:2]]
        print(f"{first} below {other}: server TTFT mean in {below[0]} of {len(paired)} runs, "
              f"p90 in {below[1]} of {len(paired)}")  # fmt: skip
        print(f"{first} / {other}, paired by run (server TTFT mean; p90):")
        groups = {s: [by for n, by in paired.items() if session[n] == s]
                  for s in dict.fromkeys(session.values())}  # fmt: skip
        groups = {s: both for s, both in groups.items() if both}
        if len(groups) > 1:  # with one directory "all" says the same
            groups["all"] = list(paired.values())
        for label, both in groups.items():
            cells = [describe([by[first][k] for by in both], [by[other][k] for by in both], other)
                     for k in FIELDS[:2]]  # fmt: skip
            print(f"  {label[-32:]:>32} ({len(both)} runs): {cells[0]}; {cells[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="demo --out-dir or requests.jsonl")
    ap.add_argument("--alias", action="append", default=[], metavar="NAME=COLUMN",
                    help="in the runs side by side, count policy NAME as COLUMN (the same "
                    "policy under another label in another experiment); repeatable")  # fmt: skip
    ap.add_argument("--across-only", action="store_true",
                    help="only the runs side by side, not each run's requests")  # fmt: skip
    args = ap.parse_args()
    if bad := [a for a in args.alias if "=" not in a]:
        ap.error(f"--alias {bad[0]!r}: expected NAME=COLUMN")
    if not args.across_only:
        for path in args.paths:
            log = path / "requests.jsonl" if path.is_dir() else path
            report(str(path), stack_rows(log if log.exists() else log.with_suffix(".jsonl.gz")))
    across_runs([p for p in args.paths if p.is_dir()], dict(a.split("=", 1) for a in args.alias))


if __name__ == "__main__":
    main()
