"""The demo: the local stack behind real Envoy (emulated servers, or real vLLM with
``--engine vllm``), the demo workload routed by epp and at random (``--baseline``: the SGLang
router too); writes docs/results/NAME.md (default ``demo``).

With several ``--rounds``, each policy's server TTFT against the first policy's, round by round.
``--across DIR...``: no run; earlier runs' ``demo.json`` (``--out-dir``) side by side, each round
a run: per run and policy the servers' TTFT mean / p90, hit rate and throughput; in how many
runs the first policy had the lower TTFT; its paired ratio over each other policy's, per
directory and pooled (sessions differ more than the rounds of one session do).

    ./run bench demo [--result-name NAME] [stack flags, e.g. --engine vllm --replicas 2]
    ./run bench demo --across DIR [DIR...] [--alias NAME=COLUMN]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

Runs = dict[str, dict[str, dict[str, Any]]]
"""Per run (a round), per policy: its figures (a row of ``demo.json``)."""

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import table, write_result  # noqa: E402
from bench.stats import describe  # noqa: E402

FIELDS = ("server_ttft_mean_ms", "server_ttft_p90_ms", "hit_rate", "req_per_s")
"""What a run's ``demo.json`` row gives per policy, side by side."""

ROWS = [
    ("prefix cache hit rate (servers' counters)", lambda r: f"{100 * r['hit_rate']:.1f}%"),
    ("client TTFT p50 / p90", lambda r: f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} ms"),
    ("server TTFT mean / p90",
     lambda r: f"{r['server_ttft_mean_ms']:.0f} / {r['server_ttft_p90_ms']:.0f} ms"),
    ("engine steps per request, tokens a step",
     lambda r: f"{r['engine_steps'] / max(1, r['requests']):.1f}, {r['engine_step_tokens']:.0f}"
     if r.get("engine_steps") else "n/a"),
    ("throughput", lambda r: f"{r['req_per_s']:.1f} req/s, {r['output_tok_per_s']:.0f} tok/s"),
    ("requests per server", lambda r: " / ".join(str(n) for n in r["per_replica_requests"])),
    ("errors", lambda r: f"{r['errors']} of {r['requests']}"),
    ("CPU ms per request",
     lambda r: ", ".join(f"{k.replace('gateway+client', 'client')} {1e3 * v / max(1, r['requests']):.1f}" for k, v in r["cpu_s"].items()
                         if v > 0)),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Other flags go to epp-sim stack --demo (epp-sim stack --help).")  # fmt: skip
    ap.add_argument("--result-name", default="demo", metavar="NAME", help="the page: docs/results/NAME.md")
    ap.add_argument("--out-dir", type=Path, help="keep the run's files here (default: a temporary folder)")
    ap.add_argument("--across", nargs="+", type=Path, metavar="DIR", help="earlier runs' --out-dir folders, compared")
    ap.add_argument("--alias", action="append", default=[], metavar="NAME=COLUMN",
                    help="--across: count policy NAME as COLUMN (one policy under two labels); repeatable")  # fmt: skip
    args, stack_args = ap.parse_known_args()
    if args.across:
        if bad := [a for a in args.alias if "=" not in a] + stack_args:
            ap.error(f"--across: unexpected {bad[0]!r} (--alias takes NAME=COLUMN)")
        if missing := [str(d) for d in args.across if not (d / "demo.json").is_file()]:
            ap.error(f"--across: no demo.json in {', '.join(missing)}")
        return across(args.across, dict(a.split("=", 1) for a in args.alias))
    out = args.out_dir or Path(tempfile.mkdtemp(prefix="bench-demo-"))
    epp_sim = str(Path(sys.executable).with_name("epp-sim"))
    subprocess.run([epp_sim, "stack", "--demo", "--out-dir", str(out), *stack_args], check=True, cwd=ROOT)
    demo = json.loads((out / "demo.json").read_text())
    runs = demo["runs"]
    md = table(["", *(f"via {r['policy']}" for r in runs)],  # rows the servers report nothing for left out
               [[name, *cells] for name, f in ROWS if set(cells := [f(r) for r in runs]) != {"n/a"}])
    w = demo["workload"]
    md += (
        f"\n\nWorkload: {w['num_groups']} system prompts of {w['system_prompt_len']} tokens x "
        f"{w['num_prompts_per_group']} users x {w['num_turns']} turns, {w['concurrency']} "
        f"conversations at a time; {demo['replicas']} servers, "
        + ("fresh for each policy (cold caches); " if demo["rounds"] < 2 else
           f"the same for every run, their prefix caches emptied between runs ({demo['rounds']} rounds); ")
        + f"gateway: real Envoy ({demo['mode']} request bodies). Hit rate from the servers' "
        "vllm:prefix_cache_hits_total / queries_total; client TTFT from the SSE stream; server "
        "TTFT from vllm:time_to_first_token_seconds; CPU from /proc per process role.\n"
    )
    title = ("The demo: epp vs random routing on the local stack" if args.result_name == "demo"
             else f"The demo workload on the local stack: {' '.join(stack_args)}")  # fmt: skip
    path = write_result(args.result_name, title, md + paired(demo), demo, argv=[__file__, *sys.argv[1:]])
    print(f"wrote {path.relative_to(ROOT)}")


def rounds(doc: dict[str, Any], name: str, alias: dict[str, str]) -> Runs:
    """A ``demo.json``'s runs, each round one (``NAME#ROUND``; the run itself without rounds)."""
    rows, out = doc.get("by_round") or doc["runs"], {}
    for k in sorted({r.get("round", 0) for r in rows}):
        run = f"{name}#{k + 1}" if doc.get("by_round") else name
        out[run] = {alias.get(r["policy"], r["policy"]): r for r in rows if r.get("round", 0) == k}
    return out


def ratios(runs: Runs, a: str, b: str, label: str) -> tuple[str, int]:
    """``a``'s server TTFT mean and p90 over ``b``'s in the same runs (``bench.stats``; ``label``
    names ``b``), and how many runs had both."""
    both = [by for by in runs.values() if a in by and b in by]
    cells = (f"{name} " + describe([by[a][k] for by in both], [by[b][k] for by in both], label)
             for name, k in (("mean", FIELDS[0]), ("p90", FIELDS[1])))  # fmt: skip
    return ", ".join(cells), len(both)


def paired(demo: dict[str, Any]) -> str:
    """With several rounds: each policy's server TTFT against the first policy's in the same
    round (the rounds' geometric mean, 90% bootstrap interval). A round's figures move 15-20%
    from the next round's; the same round's policies ran on the same servers minutes apart."""
    if not demo.get("by_round") or demo.get("rounds", 1) < 2:
        return ""
    runs, first = rounds(demo, "", {}), demo["runs"][0]["policy"]
    lines = ["- via {}: server TTFT {} over {} rounds".format(p, *ratios(runs, p, first, f"via {first}"))
             for p in runs["#1"] if p != first]  # fmt: skip
    return (f"\nRound by round, each policy's server TTFT over via {first}'s in the same round (geometric mean "
            "over the rounds, 90% bootstrap interval; \"behind\" when the interval lies wholly below 1):\n\n"
            + "\n".join(lines) + "\n") if lines else ""  # fmt: skip


def across(dirs: list[Path], alias: dict[str, str]) -> None:
    """``--across``: the runs side by side, and how the first policy fared against the others."""
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # several ``.../demo``: name them by their parents
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    sessions = {n: rounds(json.loads((d / "demo.json").read_text()), n, alias) for d, n in zip(dirs, names, strict=True)}  # fmt: skip
    runs: Runs = {run: by for got in sessions.values() for run, by in got.items()}
    policies = list(dict.fromkeys(p for by in runs.values() for p in by))

    def cell(r: dict[str, Any] | None) -> str:
        return "-" if r is None else f"{r[FIELDS[0]]:.0f} / {r[FIELDS[1]]:.0f}, {r['hit_rate']:.1%}, {r['req_per_s']:.1f}"

    means = [{k: statistics.fmean(by[p][k] for by in runs.values() if p in by) for k in FIELDS} for p in policies]
    print("== across runs: server TTFT mean / p90 (ms), hit rate, req/s")
    print(table(["run", *policies], [*([n, *(cell(by.get(p)) for p in policies)] for n, by in runs.items()),
                                     ["mean", *map(cell, means)]]))  # fmt: skip
    first = policies[0]
    groups = sessions | ({"all": runs} if len(sessions) > 1 else {})
    for other in policies[1:]:
        both = [by for by in runs.values() if first in by and other in by]
        below = [sum(by[first][k] < by[other][k] for by in both) for k in FIELDS[:2]]
        print(f"{first} below {other}: server TTFT mean in {below[0]} of {len(both)} runs, p90 in {below[1]} of {len(both)}")  # fmt: skip
        print(f"{first} / {other}, paired by run (server TTFT):")
        for label, got in groups.items():
            text, n = ratios(got, first, other, other)
            print(f"  {label[-32:]:>32} ({n} runs): {text}")


if __name__ == "__main__":
    main()
