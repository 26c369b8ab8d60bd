"""Where a demo run's time to first token went, from its ``requests.jsonl`` (``epp-sim stack
--demo --out-dir DIR`` writes one): per policy, client TTFT by conversation turn (turn 0
prefills the group's system prompt cold), by how many requests were still waiting for their
first token on the same server when it arrived (the client's view: start to first token; the
SGLang router names no upstream, so its requests count against the whole pool), and the
conversations moved to another server than their turn before.

With several run directories, or one written with ``--rounds`` (each round a run), it ends
with the runs side by side (their ``demo.json``): per run and policy the servers' TTFT mean /
p90, hit rate and throughput, the mean over runs, in how many runs the first policy (epp) had
the lower figures, and the paired ratio of the first policy's figure over each other's (the
geometric mean over runs with a 90% interval: bench/stats.py), per directory and pooled: one
run's spread on this machine is as large as the differences between policies, and sessions
differ more than the rounds of one session do.

    python bench/report_requests.py DIR_OR_FILE [...] [--alias NAME=COLUMN] [--across-only]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stats import describe  # noqa: E402
from simulator.fitlog import stack_rows  # noqa: E402

BUCKETS = 6
"""Arrivals with this many or more requests ahead share the last bucket."""


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def waiting_at_arrival(rows: list[dict[str, Any]]) -> list[int]:
    """For each row, the requests of the same upstream that started before it and had not
    had their first token when it started."""
    by_upstream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        by_upstream[r["upstream"]].append((r["start_s"], r["start_s"] + r["ttft_s"]))
    starts = {u: sorted(s for s, _ in spans) for u, spans in by_upstream.items()}
    out = []
    for r in rows:
        t = r["start_s"]
        spans = by_upstream[r["upstream"]]
        earlier = bisect.bisect_left(starts[r["upstream"]], t)
        done = sum(1 for s, first in spans if s < t and first <= t)
        out.append(earlier - done)
    return out


def moves(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(turns sent to another server than the conversation's turn before, those of them
    that found less than half their prompt cached, turns after the first)."""
    by = {(r.get("round", 0), r["user"], r["turn"]): r for r in rows}
    moved = lost = later = 0
    for (k, user, turn), r in by.items():
        before = by.get((k, user, turn - 1))
        if before is None:
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
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    print(f"== {name}")
    for policy in policies:
        ok = [r for r in rows if r["policy"] == policy and r["status"] == 200 and r["ttft_s"]]
        if not ok:
            print(f"{policy}: no successful requests")
            continue
        ttft = [r["ttft_s"] * 1e3 for r in ok]
        print(f"{policy}: {len(ok)} requests, client TTFT mean {statistics.fmean(ttft):.0f} ms, "
              f"p50 {pct(ttft, 0.5):.0f}, p90 {pct(ttft, 0.9):.0f}")
        for turn in sorted({r["turn"] for r in ok}):
            sel = [r for r in ok if r["turn"] == turn]
            t = [r["ttft_s"] * 1e3 for r in sel]
            prompt = sum(r["prompt_tokens"] for r in sel)
            cached = sum(r["cached_tokens"] for r in sel) / prompt if prompt else 0.0
            print(f"  turn {turn}: {len(sel):>4} requests, TTFT mean {statistics.fmean(t):>5.0f} "
                  f"p90 {pct(t, 0.9):>5.0f} ms, {cached:.0%} of prompt tokens cached")
        ahead = []  # start_s counts from its own run's start: one round at a time
        for k in sorted({r.get("round", 0) for r in ok}):
            ahead += waiting_at_arrival([r for r in ok if r.get("round", 0) == k])
        ok.sort(key=lambda r: r.get("round", 0))
        buckets: dict[int, list[float]] = defaultdict(list)
        for n, r in zip(ahead, ok, strict=True):
            buckets[min(n, BUCKETS)].append(r["ttft_s"] * 1e3)
        cells = ", ".join(
            f"{k}{'+' if k == BUCKETS else ''}: {len(v)} at {statistics.fmean(v):.0f} ms"
            for k, v in sorted(buckets.items())
        )
        pool = " (whole pool: no upstream)" if all(not r["upstream"] for r in ok) else ""
        print(f"  by requests still waiting for a first token on that server at arrival{pool}: "
              f"{cells}")
        print(f"  arrivals with 3 or more ahead: {sum(1 for n in ahead if n >= 3)} of {len(ok)}")
        per_round = splits(ok)
        print("  per round, prompt tokens the servers found uncached: "
              + ", ".join(f"{u:.0f}k" for _, u in per_round))
        rounds = {r.get("round", 0) for r in ok}
        fronts = {k: {r["upstream"] for r in ok if r.get("round", 0) == k} for k in rounds}
        if all(len(f) > 1 for f in fronts.values()):  # behind one front (a router): unknown
            moved, lost, later = moves(ok)
            print(f"  conversations moved: {moved} of {later} later turns went to another server "
                  f"than the turn before, {lost} of them with under half the prompt cached")
            print("  per round, groups on more than one server: "
                  + ", ".join(str(n) for n, _ in per_round))


def across_runs(dirs: list[Path], alias: dict[str, str] | None = None) -> None:
    """The runs' demo.json side by side, and how often the first policy came out ahead.
    ``alias`` renames columns (one policy named differently in different experiments)."""
    alias = alias or {}
    runs: list[tuple[str, dict[str, dict[str, Any]]]] = []
    session: dict[str, str] = {}
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # several ``.../demo``: name them by their parents
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    for d, dir_name in zip(dirs, names, strict=True):
        file = d / "demo.json"
        if not file.is_file():
            continue
        doc = json.loads(file.read_text())
        rows = [{**r, "round": r.get("round", 0)} for r in doc.get("by_round", doc["runs"])]
        for k in sorted({r["round"] for r in rows}):  # --rounds: each round its own run
            name = dir_name if "by_round" not in doc else f"{dir_name}#{k + 1}"
            runs.append((name, {alias.get(r["policy"], r["policy"]): r
                                for r in rows if r["round"] == k}))  # fmt: skip
            session[name] = dir_name
    if len(runs) < 2:
        return
    policies = list(dict.fromkeys(p for _, by in runs for p in by))
    print("== across runs: server TTFT mean / p90 (ms), hit rate, req/s")
    print(f"{'run':>24}  " + "  ".join(f"{p[:26]:>26}" for p in policies))
    for name, by in runs:
        cells = []
        for p in policies:
            r = by.get(p)
            cells.append("-" if r is None else
                         f"{r['server_ttft_mean_ms']:.0f} / {r['server_ttft_p90_ms']:.0f}, "
                         f"{r['hit_rate']:.1%}, {r['req_per_s']:.1f}"
                         + (f", steal {r['cpu_steal']:.0%}" if r.get("cpu_steal", 0) > 0.005 else ""))
        print(f"{name[-24:]:>24}  " + "  ".join(f"{c:>26}" for c in cells))
    means = []
    for p in policies:
        rs = [by[p] for _, by in runs if p in by]
        means.append(f"{statistics.fmean(r['server_ttft_mean_ms'] for r in rs):.0f} / "
                     f"{statistics.fmean(r['server_ttft_p90_ms'] for r in rs):.0f}, "
                     f"{statistics.fmean(r['hit_rate'] for r in rs):.1%}, "
                     f"{statistics.fmean(r['req_per_s'] for r in rs):.1f}")
    print(f"{'mean':>24}  " + "  ".join(f"{c:>26}" for c in means))
    first = policies[0]
    for other in policies[1:]:
        both = [by for _, by in runs if first in by and other in by]
        mean = sum(by[first]["server_ttft_mean_ms"] < by[other]["server_ttft_mean_ms"] for by in both)
        p90 = sum(by[first]["server_ttft_p90_ms"] < by[other]["server_ttft_p90_ms"] for by in both)
        print(f"{first} below {other}: server TTFT mean in {mean} of {len(both)} runs, "
              f"p90 in {p90} of {len(both)}")
    by_name = dict(runs)
    for other in policies[1:]:
        print(f"{first} / {other}, paired by run (server TTFT mean; p90):")
        paired = {n for n, by in runs if first in by and other in by}
        groups = {s: [n for n, _ in runs if session[n] == s and n in paired]
                  for s in dict.fromkeys(session.values())}  # fmt: skip
        groups = {s: names for s, names in groups.items() if names}
        if len(groups) > 1:  # with one directory "all" says the same
            groups["all"] = [n for n, _ in runs if n in paired]
        for label, names in groups.items():
            both = [by_name[n] for n in names]
            cells = [describe([by[first][f"server_ttft_{k}_ms"] for by in both],
                              [by[other][f"server_ttft_{k}_ms"] for by in both], other)
                     for k in ("mean", "p90")]  # fmt: skip
            print(f"  {label[-32:]:>32} ({len(both)} runs): {cells[0]}; {cells[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="demo --out-dir or requests.jsonl")
    ap.add_argument("--alias", action="append", default=[], metavar="NAME=COLUMN",
                    help="in the runs side by side, count policy NAME as COLUMN (the same "
                    "policy under another label in another experiment); repeatable")
    ap.add_argument("--across-only", action="store_true",
                    help="only the runs side by side, not each run's requests")
    args = ap.parse_args()
    alias = {}
    for item in args.alias:
        name, sep, column = item.partition("=")
        if not sep:
            ap.error(f"--alias {item!r}: expected NAME=COLUMN")
        alias[name] = column
    if not args.across_only:
        for path in args.paths:
            log = path / "requests.jsonl" if path.is_dir() else path
            report(str(path), stack_rows(log if log.exists() else log.with_suffix(".jsonl.gz")))
    across_runs([p for p in args.paths if p.is_dir()], alias)


if __name__ == "__main__":
    main()
