"""``epp-sim trace``: request logs for the replay (docs/replay.md, "Request logs").

    epp-sim trace export --workload agentic --set num_sessions=16 --out agents.jsonl
    epp-sim trace convert --from burstgpt BurstGPT_1.csv --out burst.jsonl
    epp-sim trace check my-requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from simulator.clihelp import HelpFormatter, deprecated_alias
from simulator.replay.convert import FORMATS, convert, left_out_note
from simulator.replay.requestlog import RequestLog, write_request_log


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace", help="write, convert and check request logs for the replay",
        description="Request logs (JSONL or CSV, one request per row: docs/replay.md) for "
        "epp-sim replay --trace: write a generated workload as one, convert another format to "
        "one, or check one.", formatter_class=HelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    ex = sub.add_parser("export", help="write a generated workload as a request log",
                        formatter_class=HelpFormatter)  # fmt: skip
    from simulator.replay.workload import GENERATORS

    ex.add_argument("--workload", required=True, choices=sorted(GENERATORS),
                    help="the generator (as epp-sim replay --workload)")
    ex.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                    help="generator parameter (repeatable)")
    ex.add_argument("--workload-file", help="YAML generator parameters")
    ex.add_argument("--out", required=True, help="the JSONL file to write")
    ex.set_defaults(run=_export)
    cv = sub.add_parser("convert", help="convert another log format to a request log",
                        formatter_class=HelpFormatter)  # fmt: skip
    cv.add_argument("--from", dest="fmt", required=True, choices=FORMATS,
                    help="mooncake (JSONL), azure (Azure LLM inference CSV), burstgpt (CSV), "
                    "stack (the local stack's requests.jsonl)")
    cv.add_argument("input", help="the log to convert")
    run = cv.add_argument("--run", dest="runs", default="", metavar="POLICY",
                          help="stack: the run to take, by its policy column (a demo log holds "
                          "several), as epp-sim calibrate --run")
    deprecated_alias(cv, "--policy", run)
    cv.add_argument("--round", type=int, default=None,
                    help="stack: the round to take (a demo run with --rounds; the first by default)")
    cv.add_argument("--open-loop", action="store_true",
                    help="stack: rows keep the log's send times only, without 'after' (by default "
                    "each waits for the answer that let it go, as the demo's client did)")
    cv.add_argument("--out", required=True, help="the JSONL file to write")
    cv.set_defaults(run=_convert)
    ck = sub.add_parser("check", help="read a request log and summarise it (errors name the line)",
                        formatter_class=HelpFormatter)  # fmt: skip
    ck.add_argument("input")
    ck.add_argument("--skip-bad-rows", action="store_true", help="count bad rows instead of stopping")
    ck.set_defaults(run=_check)


def _export(args: argparse.Namespace) -> int:
    from simulator.replay.cli import build_workload

    ns = argparse.Namespace(workload=args.workload, params=args.params,
                            workload_file=args.workload_file, trace=None)  # fmt: skip
    try:
        workload = build_workload(ns)
        n = write_request_log(workload.requests(), args.out)
    except (ValueError, OSError) as exc:
        print(f"epp-sim trace export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} requests of the {args.workload} workload to {args.out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    n = 0
    left_out: list[int] = []
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            for row in convert(args.fmt, args.input, args.runs, args.round, not args.open_loop,
                               left_out):  # fmt: skip
                f.write(json.dumps(row) + "\n")
                n += 1
    except (ValueError, KeyError, TypeError, OSError) as exc:
        Path(args.out).unlink(missing_ok=True)
        print(f"epp-sim trace convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} requests to {args.out}" + left_out_note(left_out, n))
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        log = RequestLog.load(args.input, skip_bad_rows=args.skip_bad_rows)
    except (ValueError, OSError) as exc:
        print(f"epp-sim trace check: {exc}", file=sys.stderr)
        return 2
    reqs = list(log.requests())
    sessions = {r.session_id for r in reqs if r.session_id}
    adapters = Counter(r.adapter for r in reqs if r.adapter)
    span = reqs[-1].arrival_s if reqs else 0.0
    print(f"{args.input}: {len(reqs)} requests over {span:.1f} s ({len(reqs) / max(span, 1e-9):.2f}/s), "
          f"prompts {sum(r.prompt_tokens for r in reqs) / len(reqs):.0f} tokens on average, "
          f"{len(sessions)} sessions, adapters {dict(adapters) or 'none'}"
          + (f"; {len(log.skipped)} bad rows skipped, the first: {log.skipped[0]}" if log.skipped else ""))  # fmt: skip
    return 0
