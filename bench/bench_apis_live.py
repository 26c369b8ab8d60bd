"""The APIs production clients speak, on real vLLM behind real Envoy (issue 68): a coding
agent's sessions in Anthropic Messages form, routed by epp and at random; vLLM's own prefix
hit rate and server-side TTFT.

Two real vLLM servers (the tiny model, ``--vllm-tools``), real Envoy, and epp's default or
``agentic`` profile (token load added) or its random picker on the same path. Each of
``--rounds`` runs every policy, in turn, on the same servers with their prefix caches emptied.
``--sessions`` sessions (4 at a time) over one system prompt and tool set (4,000 + 6,000
characters): ``count_tokens``, then ``--turns`` streamed ``/v1/messages`` calls, each adding
the reply, a ``tool_use`` and its ``tool_result``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import count, live_rounds  # noqa: E402
from bench.results import table  # noqa: E402
from simulator.stack.driver import RequestRecord, RunRecords, stream_one  # noqa: E402
from simulator.stack.report import ReplicaCounters, scrape_replicas, summarize  # noqa: E402
from simulator.stack.stack import Stack, StackOptions  # noqa: E402
from simulator.stack.workload import word_text as words  # noqa: E402

MODEL = "tiny"
POLICIES = {"epp": ("epp", ""), "epp agentic": ("epp", "agentic"), "random": ("random", "")}
"""label: (the stack's policy, epp's config: '' = the default profile)."""
CONCURRENCY, MAX_TOKENS = 4, 24
SYSTEM_CHARS, TOOLS_CHARS, TASK_CHARS, TOOL_OUTPUT_CHARS = 4000, 6000, 400, 2400
SYSTEM = "You are a coding agent in a large repository. " + words(random.Random(0), SYSTEM_CHARS)


def agent_tools(rng: random.Random, chars: int) -> list[dict[str, Any]]:
    """Anthropic tool definitions (name, description, JSON schema) of about ``chars``."""
    tools: list[dict[str, Any]] = []
    while len(json.dumps(tools)) < chars:
        tools.append({"name": f"tool_{len(tools)}", "description": words(rng, 240), "input_schema": {
            "type": "object", "properties": {"path": {"type": "string", "description": words(rng, 80)},
                                             "limit": {"type": "integer"}}, "required": ["path"]}})  # fmt: skip
    return tools


TOOLS = agent_tools(random.Random(1), TOOLS_CHARS)


@dataclass(slots=True)
class Run:
    records: list[RequestRecord] = field(default_factory=list)
    counted: int = 0
    count_errors: int = 0


async def session(http: aiohttp.ClientSession, url: str, s: int, turns: int, run: Run, t0: float) -> None:  # fmt: skip
    rng, head = random.Random(s), {"x-session-id": f"s{s}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {s}: " + words(rng, TASK_CHARS)}]  # fmt: skip
    async with http.post(url + "/v1/messages/count_tokens", headers=head,
                         json={"model": MODEL, "system": SYSTEM, "tools": TOOLS, "messages": messages}) as r:  # fmt: skip
        run.counted += 1
        run.count_errors += r.status != 200 or "input_tokens" not in await r.json()
    for t in range(turns):
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True, "system": SYSTEM, "tools": TOOLS,
                "messages": messages}  # fmt: skip
        rec = RequestRecord(s, t, 0, time.perf_counter() - t0, request_id=uuid.uuid4().hex)
        reply = await stream_one(http, url + "/v1/messages", body, rec, chat=False, headers=head)
        run.records.append(rec)
        call = f"toolu_{s:03d}_{t:02d}"
        messages = [*messages,
                    {"role": "assistant", "content": [
                        {"type": "text", "text": reply or "(no text)"},
                        {"type": "tool_use", "id": call, "name": f"tool_{t % 4}", "input": {"path": f"src/m{t}.py"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call, "content": words(rng, TOOL_OUTPUT_CHARS)}]}]  # fmt: skip


def figures(run: Run, counters: list[ReplicaCounters]) -> dict[str, float]:
    """Milliseconds for times, shares for rates."""
    s = summarize("", RunRecords(run.records), counters)
    ok = [r for r in s.records if r.ok]
    home = {r.user: r.upstream for r in run.records if r.turn == 0}
    later = [(r.user, r) for r in ok if r.turn > 0]
    return {
        "requests": s.requests, "ok": len(ok), "count_tokens": run.counted, "counted_ok": run.counted - run.count_errors,
        "hit": s.hit_rate, "usage_hit": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "server_ttft_mean": s.server_ttft_mean_ms, "server_ttft_p90": s.server_ttft_p90_ms,
        "client_ttft_p50": s.ttft_p50_ms, "client_ttft_p90": s.ttft_p90_ms,
        "home": sum(rec.upstream == home.get(sid) for sid, rec in later) / max(1, len(later)),
        "spread": max(Counter(home.values()).values()) / max(1, len(home)),
        "prompt_max": max((r.prompt_tokens for r in ok), default=0),
    }  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    base = StackOptions(replicas=2, engine="vllm", vllm_tools=True, vllm_kv_cache_bytes=args.kv_mib << 20,
                        vllm_stream_interval=8, fair=True, model=MODEL, ready_timeout_s=600)  # fmt: skip
    print(f"# {args.sessions} agent sessions ({CONCURRENCY} at a time) x {args.turns} turns in Anthropic Messages "
          f"form, system prompt {SYSTEM_CHARS:,} + tools {TOOLS_CHARS:,} characters; 2 real vLLM servers "
          f"({args.kv_mib} MiB of KV each, the tiny model, --vllm-tools) behind real Envoy; "
          f"{args.rounds} round(s), caches emptied before each run\n", flush=True)  # fmt: skip

    async def drive(stack: Stack, http: aiohttp.ClientSession) -> dict[str, float]:
        run, gate, t0 = Run(), asyncio.Semaphore(CONCURRENCY), time.perf_counter()
        before = await scrape_replicas(stack.replica_urls)

        async def one(s: int) -> None:
            async with gate:
                await session(http, stack.gateway_url, s, args.turns, run, t0)

        await asyncio.gather(*(one(s) for s in range(args.sessions)))
        after = await scrape_replicas(stack.replica_urls)
        return figures(run, [a.minus(b) for a, b in zip(after, before, strict=True)])

    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    async for r, label, g in live_rounds(base, POLICIES, args.rounds, drive):
        runs[label].append(g)
        print(f"round {r + 1} {label}: {g['ok']:.0f} of {g['requests']:.0f} ok (count_tokens "
              f"{g['counted_ok']:.0f} of {g['count_tokens']:.0f}), vLLM hit {g['hit']:.1%}, "
              f"server TTFT mean {g['server_ttft_mean']:.0f} ms / p90 {g['server_ttft_p90']:.0f} ms, client "
              f"TTFT p50 {g['client_ttft_p50']:.0f} ms, later turns home {g['home']:.0%}, busiest server has "
              f"{g['spread']:.0%} of the sessions, longest prompt {g['prompt_max']:,.0f} tokens", flush=True)  # fmt: skip
    med = {label: {k: statistics.median(g[k] for g in got) for k in got[0]} for label, got in runs.items()}  # fmt: skip

    def total(label: str, ok: str, n: str) -> str:
        return f"{sum(g[ok] for g in runs[label]):.0f} of {sum(g[n] for g in runs[label]):.0f}"

    print("\n" + table(["policy", "runs", "requests ok", "count_tokens ok", "vLLM prefix hit rate", "hit (usage)",
                        "server TTFT mean", "server TTFT p90", "client TTFT p50 / p90",
                        "later turns on the session's server"],
                       [[label, len(runs[label]), total(label, "ok", "requests"), total(label, "counted_ok", "count_tokens"),
                         f"{m['hit']:.1%}", f"{m['usage_hit']:.1%}", f"{m['server_ttft_mean']:.0f} ms",
                         f"{m['server_ttft_p90']:.0f} ms", f"{m['client_ttft_p50']:.0f} / {m['client_ttft_p90']:.0f} ms",
                         f"{m['home']:.0%}"] for label, m in med.items()]))  # fmt: skip
    rnd = med["random"]
    for label, e in med.items():
        if label != "random":
            print(f"\n{label} / random: prefix hit rate {e['hit']:.1%} vs {rnd['hit']:.1%} (prompt tokens computed, "
                  f"not found cached: {(1 - e['hit']) / max(1 - rnd['hit'], 1e-9):.2f}x); server TTFT mean "
                  f"{e['server_ttft_mean'] / max(rnd['server_ttft_mean'], 1e-9):.2f}x, p90 "
                  f"{e['server_ttft_p90'] / max(rnd['server_ttft_p90'], 1e-9):.2f}x (medians over the runs)", end="")  # fmt: skip
    print("\nhit rate = vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over both servers; hit (usage) "
          "= the replies' cache_read_input_tokens / (input + cache reads); server TTFT: vllm:time_to_first_token_seconds.")  # fmt: skip
    return 0 if all(g["ok"] == g["requests"] for got in runs.values() for g in got) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--sessions", type=count, default=8)
    ap.add_argument("--turns", type=count, default=8, help="requests a session sends after count_tokens")  # fmt: skip
    ap.add_argument("--kv-mib", type=count, default=32, help="KV cache per server, MiB (1 KiB a token)")  # fmt: skip
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
