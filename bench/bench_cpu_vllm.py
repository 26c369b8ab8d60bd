"""Where the CPU goes on the real-vLLM stack: CPU per request of epp, the gateway and the vLLM
servers, in the background and on the request path, per routing and ext_proc response mode.

Each configuration starts a fresh stack in its own process (``epp-sim stack``) and reads its
processes' CPU by role (``simulator.stack.cpu``) over an idle window (the background: scrapes,
housekeeping, vLLM's idle loop; per second) and over the workload driven from this process
(the request path: the workload's CPU less the background rate, per request). Configurations
(``--configs``): ``random`` (no ext_proc) and ``epp:MODE``, MODE the response mode of
``epp-sim stack --response`` (``summary``, ``full-duplex``, ``none``, or
``observer``: a second stream Envoy does not wait on). vLLM's own
server-side TTFT is printed beside the client's. ``--stream-interval N``: vLLM's (fewer
streamed chunks); ``--engine emulator``: emulated replicas, no vLLM needed. Skips when real
vLLM is not set up (``./run vllm-setup``).

    ./run bench cpu_vllm [--idle-s 5] [--groups 8] [--users 4] [--turns 3]
        [--stream-interval 1] [--configs random,epp:full-duplex] [--engine vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import pct, spawn, table  # noqa: E402

CONFIGS = "random,epp:summary,epp:full-duplex,epp:none,epp:observer"


async def server_ttft(urls: list[str]) -> tuple[float, float]:
    """vLLM's own time_to_first_token histogram, summed over the servers: (sum, count)."""
    from simulator.eppproc import page_metric

    name = "vllm:time_to_first_token_seconds"
    pages = [f"{url}/metrics" for url in urls]
    return (sum([await page_metric(p, name + "_sum") for p in pages]),
            sum([await page_metric(p, name + "_count") for p in pages]))


def start_stack(policy: str, response_mode: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], Any]:
    """``epp-sim stack`` in its own process, and what it printed of itself (its URLs)."""
    proc, line = spawn("-m", "simulator.cli", "stack", "--engine", args.engine, "--replicas", "2",
                       "--routing", policy, "--response", response_mode, "--kv-mib", str(args.kv_mib),
                       "--vllm-stream-interval", str(args.stream_interval), quiet=True)  # fmt: skip
    return proc, json.loads(line)


async def measure(policy: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from simulator.stack.cpu import roles as by_role
    from simulator.stack.cpu import sample
    from simulator.stack.driver import run_workload
    from simulator.stack.stack import DEFAULT_MODEL
    from simulator.stack.workload import SharedPrefixWorkload

    proc, described = start_stack(policy, mode, args)
    try:
        roles = by_role(proc.pid)  # the gateway is the stack's own process
        await asyncio.sleep(2.0)  # first scrapes, connections
        c0, t0 = sample(roles), time.monotonic()
        await asyncio.sleep(args.idle_s)  # the idle window: background cost only
        c1, t1 = sample(roles), time.monotonic()
        urls = described["replica_urls"]
        ttft0 = await server_ttft(urls)
        w = SharedPrefixWorkload(num_groups=args.groups, num_prompts_per_group=args.users,
                                 num_turns=args.turns, concurrency=args.concurrency)  # fmt: skip
        records = await run_workload(described["gateway_url"], w, DEFAULT_MODEL)
        c2, t2 = sample(roles), time.monotonic()
        ttft1 = await server_ttft(urls)
    finally:
        proc.terminate()
        proc.wait()
    n = len(records.records)
    ok = [r for r in records.records if r.ok]
    client = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    idle, busy = t1 - t0, t2 - t1
    rows = {}
    for role in roles:
        background = (c1[role] - c0[role]) / idle
        work = c2[role] - c1[role]
        rows[role] = (background, (work - background * busy) / n, work / n)
    return {
        "config": f"{policy}" + ("" if policy == "random" else f" / response {mode}"),
        "requests": n, "errors": n - len(ok), "wall_s": busy, "rows": rows,
        "hit": cached / prompt if prompt else 0.0,
        "client_ttft_p50": pct(client, 0.5),
        "server_ttft_mean": (ttft1[0] - ttft0[0]) / max(1.0, ttft1[1] - ttft0[1]),
    }


def report(results: list[dict[str, Any]]) -> None:
    rows = [[r["config"] if i == 0 else "", role, f"{bg:.3f}", f"{req * 1e3:.1f}", f"{total * 1e3:.1f}"]
            for r in results for i, (role, (bg, req, total)) in enumerate(r["rows"].items())]
    print(table(["configuration", "component", "background CPU s/s", "request path CPU ms a request",
                 "total CPU ms a request"], rows, 2))  # fmt: skip
    for r in results:
        print(f"{r['config']}: {r['requests']} requests ({r['errors']} errors) in {r['wall_s']:.1f} s; hit rate "
              f"{r['hit']:.1%}; TTFT client p50 {r['client_ttft_p50'] * 1e3:.0f} ms, vLLM server mean "
              f"{r['server_ttft_mean'] * 1e3:.0f} ms")  # fmt: skip


async def main_async(args: argparse.Namespace) -> None:
    print(f"CPU breakdown on the {args.engine} stack: 2 servers ({args.kv_mib} MiB KV each), {args.groups} "
          f"system prompts x {args.users} users x {args.turns} turns, {args.concurrency} conversations at a time, "
          f"stream interval {args.stream_interval}; {os.cpu_count()} CPUs shared by all")  # fmt: skip
    report([await measure(policy, mode, args) for policy, mode in args.configs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-mib", type=int, default=16)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the vLLM servers' --stream-interval (tokens per streamed chunk)")
    ap.add_argument("--engine", choices=("vllm", "emulator"), default="vllm",
                    help="emulator: 2 emulated replicas (one process) instead of real vLLM, for "
                    "a quick look at the gateway's and epp's share (default: vllm)")
    ap.add_argument("--configs", default=CONFIGS,
                    help="which to run, comma-separated: random, epp:<response mode> (full-duplex, "
                    "none, observer) (default: all)")
    args = ap.parse_args()
    args.configs = [(c.partition(":")[0], c.partition(":")[2] or "full-duplex")
                    for c in args.configs.split(",") if c]
    from simulator.vllm import setup_missing

    if args.engine == "vllm" and (missing := setup_missing()):
        print(f"skipped: {missing}")
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
