"""The demo: the local stack behind real Envoy (emulated servers, or real vLLM with
``--engine vllm``), the demo workload routed by epp and at random (``--baseline``: the SGLang
router too); writes docs/results/NAME.md (default ``demo``).

With several ``--rounds``, each policy's server TTFT against the first policy's, round by round.

    ./run bench demo [--result-name NAME] [stack flags, e.g. --engine vllm --replicas 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import table, write_result  # noqa: E402
from bench.stats import describe  # noqa: E402

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
    args, stack_args = ap.parse_known_args()
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
        f"conversations at a time; {demo['replicas']} servers, fresh for each policy (cold "
        f"caches, or the same servers emptied between runs with --rounds: {demo['rounds']}); "
        f"gateway: real Envoy ({demo['mode']} request bodies). Hit rate from the servers' "
        "vllm:prefix_cache_hits_total / queries_total; client TTFT from the SSE stream; server "
        "TTFT from vllm:time_to_first_token_seconds; CPU from /proc per process role.\n"
    )
    title = ("The demo: epp vs random routing on the local stack" if args.result_name == "demo"
             else f"The demo workload on the local stack: {' '.join(stack_args)}")  # fmt: skip
    path = write_result(args.result_name, title, md + paired(demo), demo, argv=[__file__, *sys.argv[1:]])
    print(f"wrote {path.relative_to(ROOT)}")


def paired(demo: dict[str, Any]) -> str:
    """With several rounds: each policy's server TTFT against the first policy's in the same
    round (the rounds' geometric mean, 90% bootstrap interval). A round's figures move 15-20%
    from the next round's; the same round's policies ran on the same servers minutes apart."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in demo.get("by_round") or []:
        by.setdefault(r["policy"], {})[r["round"]] = r
    first = demo["runs"][0]["policy"]
    lines = []
    for policy, runs in by.items():
        common = sorted(set(runs) & set(by[first]))
        cells = [f"{label} " + describe([runs[i][key] for i in common], [by[first][i][key] for i in common], f"via {first}")
                 for key, label in (("server_ttft_mean_ms", "mean"), ("server_ttft_p90_ms", "p90"))]  # fmt: skip
        if policy != first:
            lines.append(f"- via {policy}: server TTFT " + ", ".join(cells) + f" over {len(common)} rounds")
    return (f"\nRound by round, each policy's server TTFT over via {first}'s in the same round (geometric mean "
            "over the rounds, 90% bootstrap interval; \"behind\" when the interval lies wholly below 1):\n\n"
            + "\n".join(lines) + "\n") if lines else ""  # fmt: skip


if __name__ == "__main__":
    main()
