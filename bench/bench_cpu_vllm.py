"""Where the CPU goes on the real-vLLM stack: CPU per request of epp, the gateway and the vLLM
servers, in the background and on the request path, per routing and ext_proc response mode.

Each configuration starts a fresh stack (``epp-sim stack``, 2 servers) in its own process and
reads its processes' CPU by role (``simulator.stack.cpu``) over a 5 s idle window (the
background, per second) and over the workload driven from this process (the request path:
its CPU less the background rate, per request). ``--configs``: ``random`` (no ext_proc) and
``epp:MODE``, MODE one of ``epp-sim stack --response``'s. Skips without real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import spawn  # noqa: E402
from bench.results import table  # noqa: E402

IDLE_S, KV_MIB = 5.0, 16


async def measure(policy: str, mode: str, args: argparse.Namespace) -> list[list[str]]:
    """The table's rows of one configuration: a component a row."""
    from simulator.stack import cpu
    from simulator.stack.driver import run_workload
    from simulator.stack.report import scrape_replicas, summarize
    from simulator.stack.stack import DEFAULT_MODEL
    from simulator.stack.workload import SharedPrefixWorkload

    proc, line = spawn("-m", "simulator.cli", "stack", "--engine", args.engine, "--replicas", "2",
                       "--routing", policy, "--response", mode, "--kv-mib", str(KV_MIB),
                       "--vllm-stream-interval", str(args.stream_interval), quiet=True)  # fmt: skip
    stack = json.loads(line)  # what the stack printed of itself: its URLs
    try:
        roles = cpu.roles(proc.pid)  # the gateway is the stack's own process
        await asyncio.sleep(2.0)  # first scrapes, connections
        c0, t0 = cpu.sample(roles), time.monotonic()
        await asyncio.sleep(IDLE_S)  # the idle window: background cost only
        c1, t1 = cpu.sample(roles), time.monotonic()
        before = await scrape_replicas(stack["replica_urls"])
        w = SharedPrefixWorkload(num_groups=8, num_prompts_per_group=4, num_turns=3, concurrency=4)
        records = await run_workload(stack["gateway_url"], w, DEFAULT_MODEL)
        c2, t2 = cpu.sample(roles), time.monotonic()
        after = await scrape_replicas(stack["replica_urls"])
    finally:
        proc.terminate()
        proc.wait()
    s = summarize("", records, [a.minus(b) for a, b in zip(after, before, strict=True)])
    idle, busy = t1 - t0, t2 - t1
    config = policy + ("" if policy == "random" else f" / response {mode}")
    print(f"{config}: {s.requests} requests ({s.errors} errors) in {busy:.1f} s; hit rate {s.hit_rate:.1%}; "
          f"TTFT client p50 {s.ttft_p50_ms:.0f} ms, vLLM server mean {s.server_ttft_mean_ms:.0f} ms", flush=True)  # fmt: skip
    rows = []
    for i, role in enumerate(roles):
        background, work = (c1[role] - c0[role]) / idle, (c2[role] - c1[role]) / s.requests
        rows.append([config if i == 0 else "", role, f"{background:.3f}",
                     f"{(work - background * busy / s.requests) * 1e3:.1f}", f"{work * 1e3:.1f}"])
    return rows


async def main_async(args: argparse.Namespace) -> None:
    print(f"CPU breakdown on the {args.engine} stack: 2 servers ({KV_MIB} MiB KV each), 8 system prompts "
          f"x 4 users x 3 turns, 4 conversations at a time, stream interval {args.stream_interval}; "
          f"{os.cpu_count()} CPUs shared by all")  # fmt: skip
    configs = [(c.partition(":")[0], c.partition(":")[2] or "full-duplex") for c in args.configs.split(",") if c]  # fmt: skip
    rows = [row for policy, mode in configs for row in await measure(policy, mode, args)]
    print(table(["configuration", "component", "background CPU s/s", "request path CPU ms a request",
                 "total CPU ms a request"], rows, 2))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the vLLM servers' --stream-interval (tokens per streamed chunk)")  # fmt: skip
    ap.add_argument("--engine", choices=("vllm", "emulator"), default="vllm",
                    help="emulator: 2 emulated replicas (one process) instead of real vLLM, for "
                    "a quick look at the gateway's and epp's share (default: vllm)")  # fmt: skip
    ap.add_argument("--configs", default="random,epp:summary,epp:full-duplex,epp:none,epp:observer",
                    help="which to run, comma-separated: random, epp:<response mode> (summary, "
                    "full-duplex, none, observer) (default: all)")  # fmt: skip
    args = ap.parse_args()
    from simulator.vllm import setup_missing

    if args.engine == "vllm" and (missing := setup_missing()):
        print(f"skipped: {missing}")
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
