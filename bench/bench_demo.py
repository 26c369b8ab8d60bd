"""The README's demo table: ``./run demo`` (the local stack behind real Envoy, the demo
workload through epp and at random), written to docs/results/demo.md with the command, commit,
date and machine.

    ./run python bench/bench_demo.py [--result-name NAME] [stack flags, e.g.
        --engine vllm --replicas 2]

``--result-name`` (default ``demo``) names the file under docs/results/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_result  # noqa: E402

ROWS = [
    ("prefix cache hit rate (servers' counters)", lambda r: f"{100 * r['hit_rate']:.1f}%"),
    ("client TTFT p50 / p90", lambda r: f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} ms"),
    ("server TTFT mean / p90",
     lambda r: f"{r['server_ttft_mean_ms']:.0f} / {r['server_ttft_p90_ms']:.0f} ms"),
    ("throughput", lambda r: f"{r['req_per_s']:.1f} req/s, {r['output_tok_per_s']:.0f} tok/s"),
    ("requests per server", lambda r: " / ".join(str(n) for n in r["per_replica_requests"])),
    ("errors", lambda r: f"{r['errors']} of {r['requests']}"),
    ("CPU ms per request",
     lambda r: ", ".join(f"{k.replace('gateway+client', 'client')} {1e3 * v / max(1, r['requests']):.1f}" for k, v in r["cpu_s"].items()
                         if v > 0)),
]  # fmt: skip


def main() -> None:
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:
        print(__doc__.strip() + "\n\nStack flags: epp-sim stack --help")
        return
    name = "demo"
    if "--result-name" in args:
        i = args.index("--result-name")
        name = args[i + 1]
        del args[i : i + 2]
    out = Path(tempfile.mkdtemp(prefix="bench-demo-"))
    cmd = [str(Path(sys.executable).with_name("epp-sim")), "stack", "--demo", "--out-dir", str(out),
           *args]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    demo = json.loads((out / "demo.json").read_text())
    runs = demo["runs"]
    head = "| | " + " | ".join(f"via {r['policy']}" for r in runs) + " |\n"
    head += "|---|" + "---:|" * len(runs) + "\n"
    body = "".join(f"| {name} | " + " | ".join(f(r) for r in runs) + " |\n" for name, f in ROWS)
    w = demo["workload"]
    notes = (
        f"\nWorkload: {w['num_groups']} system prompts of {w['system_prompt_len']} tokens x "
        f"{w['num_prompts_per_group']} users x {w['num_turns']} turns, {w['concurrency']} "
        f"conversations at a time; {demo['replicas']} servers, fresh for each policy (cold "
        f"caches, or the same servers emptied between runs with --rounds: {demo['rounds']}); "
        f"gateway: real Envoy ({demo['mode']} request bodies). Hit rate from the servers' "
        "vllm:prefix_cache_hits_total / queries_total; client TTFT from the SSE stream; server "
        "TTFT from vllm:time_to_first_token_seconds; CPU from /proc per process role.\n"
    )
    title = ("The demo: epp vs random routing on the local stack" if name == "demo"
             else f"The demo workload on the local stack: {' '.join(args)}")  # fmt: skip
    path = write_result(name, title,
                        head + body + notes, demo, argv=[__file__, *sys.argv[1:]])  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
