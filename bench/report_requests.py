"""Demo runs side by side: the ``demo.json`` of several ``epp-sim stack --demo --out-dir DIR``
runs, or of one written with ``--rounds`` (each round a run).

Per run and policy: the servers' TTFT mean / p90, hit rate and throughput, and their means; in
how many runs the first policy (epp) had the lower figures; and the paired ratio of its figure
over each other's (bench/stats.py), per directory and pooled: sessions differ more than the
rounds of one session do.

    python bench/report_requests.py DIR [DIR...] [--alias NAME=COLUMN]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import table  # noqa: E402
from bench.stats import describe  # noqa: E402

FIELDS = ("server_ttft_mean_ms", "server_ttft_p90_ms", "hit_rate", "req_per_s")
"""What a run's ``demo.json`` row gives per policy, side by side."""


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
    ap.add_argument("dirs", nargs="+", type=Path, help="demo --out-dir folders (their demo.json)")
    ap.add_argument("--alias", action="append", default=[], metavar="NAME=COLUMN",
                    help="count policy NAME as COLUMN (the same policy under another label in "
                    "another experiment); repeatable")  # fmt: skip
    args = ap.parse_args()
    if bad := [a for a in args.alias if "=" not in a]:
        ap.error(f"--alias {bad[0]!r}: expected NAME=COLUMN")
    across_runs(args.dirs, dict(a.split("=", 1) for a in args.alias))


if __name__ == "__main__":
    main()
