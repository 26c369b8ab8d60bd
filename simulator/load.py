"""``epp-sim load``: send a trace or a generated workload to a running gateway or server at
the trace's times, and measure what a client sees.

The same workloads the replay reads (request logs, Mooncake traces, the generators: an
agent's sessions, chats, RAG) go live: each request is sent at its arrival time (open loop,
as a recorded trace is: a turn does not wait for the previous answer) to
``/v1/completions`` with its text as the prompt (a request log's ``messages`` rows to their
API as recorded; ``--api chat`` or ``--api messages``: every request in that API's form, an
agent's sessions as Anthropic Messages with tool_use / tool_result turns), streamed, its output length as
``max_tokens`` (``ignore_eos``, so servers generate exactly that), its adapter as the model,
its session in ``x-session-id`` and its tenant in ``x-llm-d-inference-fairness-id`` (flow
control's fairness id). What comes back, per request: status, the upstream that served it,
TTFT (first text chunk), time per output token, end to end, and the server's ``usage``
(prompt, cached and completion tokens). The summary prints; ``--out``
writes every request as JSON lines.

Bounds: at most ``--max-in-flight`` requests at once (a request due while the client is at
the bound waits, and is counted late), each cut after ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from epp.flowcontrol.controller import DEFAULT_FAIRNESS_HEADER
from epp.framework.request import ApiKind
from simulator.clihelp import HelpFormatter
from simulator.forms import APIS, PATHS, request_as
from simulator.replay.workload import TraceRequest, Workload
from simulator.stack.driver import RequestRecord, stream_one

SESSION_HEADER = "x-session-id"


@dataclass(slots=True, frozen=True)
class LoadOptions:
    model: str
    """The model a request asks for when it names no adapter."""
    max_in_flight: int = 256
    timeout_s: float = 300.0
    ignore_eos: bool = True
    api: ApiKind | None = None
    """The API requests are sent to, in its form (``simulator.forms``); None: as recorded (a
    request log's ``messages`` rows to their API, text prompts to ``/v1/completions``)."""


@dataclass(slots=True)
class Sent:
    request: TraceRequest
    record: RequestRecord
    late_s: float = 0.0
    """How long after its arrival time it went out (the in-flight bound)."""


def body_of(req: TraceRequest, options: LoadOptions) -> tuple[str, dict[str, Any]]:
    """The path and body of ``req``: its API's form, its output length as ``max_tokens``,
    streamed with usage."""
    common: dict[str, Any] = {
        "model": req.adapter or options.model, "max_tokens": max(1, req.output_tokens), "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if options.ignore_eos:
        common["ignore_eos"] = True
    return request_as(req, options.api, common)


async def run_load(url: str, workload: Workload, options: LoadOptions) -> list[Sent]:
    """Send every request of ``workload`` to ``url`` (a gateway or server base URL) at its
    arrival time; returns them with what came back, in arrival order."""
    base = url.rstrip("/")
    gate = asyncio.Semaphore(options.max_in_flight)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    sent: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=options.max_in_flight)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t0 = time.perf_counter()

        async def send(item: Sent) -> None:
            async with gate:
                item.late_s = max(0.0, time.perf_counter() - t0 - item.request.arrival_s)
                item.record.start_s = time.perf_counter() - t0
                headers = {SESSION_HEADER: item.request.session_id} if item.request.session_id else {}
                if item.request.tenant:
                    headers[DEFAULT_FAIRNESS_HEADER] = item.request.tenant
                path, body = body_of(item.request, options)
                await stream_one(http, base + path, body, item.record, chat=path == PATHS[ApiKind.CHAT],
                                 headers=headers)  # fmt: skip

        for i, req in enumerate(workload.requests()):
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            item = Sent(req, RequestRecord(user=i, turn=0, group=0, start_s=0.0))
            sent.append(item)
            tasks.append(asyncio.create_task(send(item)))
        await asyncio.gather(*tasks)
    return sent


@dataclass(slots=True, frozen=True)
class LoadSummary:
    requests: int
    ok: int
    errors: dict[str, int]
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    hit_rate: float
    """``sum(cached_tokens) / sum(prompt_tokens)`` from the servers' usage."""
    late: int
    """Requests sent more than 100 ms after their time (the in-flight bound)."""
    upstreams: dict[str, int]
    wall_s: float


def _pct(values: list[float], q: float) -> float:
    """As the replay's report computes percentiles (linear interpolation)."""
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(sent: list[Sent]) -> LoadSummary:
    ok = [s.record for s in sent if s.record.ok]
    errors = Counter(
        f"{s.record.status or 'no response'}: {s.record.error[:60]}" for s in sent if not s.record.ok
    )
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
            if r.ttft_s is not None and r.completion_tokens > 1]  # fmt: skip
    e2e = [r.e2e_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    wall = max((s.record.start_s + s.record.e2e_s for s in sent), default=0.0)
    return LoadSummary(
        len(sent), len(ok), dict(errors), _pct(ttft, 50), _pct(ttft, 90), _pct(ttft, 99),
        _pct(tpot, 50), _pct(tpot, 90), _pct(e2e, 50), _pct(e2e, 99),
        sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        sum(s.late_s > 0.1 for s in sent), dict(Counter(r.upstream or "-" for r in ok)), wall,
    )  # fmt: skip


def describe(s: LoadSummary) -> str:
    lines = [
        f"{s.requests} requests in {s.wall_s:.1f} s: {s.ok} ok"
        + (f", {s.requests - s.ok} failed" if s.requests > s.ok else "")
        + (f", {s.late} sent late (--max-in-flight)" if s.late else ""),
        f"TTFT p50 {s.ttft_p50_s:.3f} s, p90 {s.ttft_p90_s:.3f} s, p99 {s.ttft_p99_s:.3f} s; "
        f"TPOT p50 {s.tpot_p50_s * 1e3:.1f} ms, p90 {s.tpot_p90_s * 1e3:.1f} ms; "
        f"e2e p50 {s.e2e_p50_s:.2f} s, p99 {s.e2e_p99_s:.2f} s",
        f"prefix-cache hit rate (servers' usage): {s.hit_rate:.1%}",
        "served by: " + ", ".join(f"{u} {n}" for u, n in sorted(s.upstreams.items())),
    ]
    for what, n in sorted(s.errors.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"  failed {n}x: {what}")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    from simulator.replay.cli import add_workload_args

    p = subparsers.add_parser(
        "load",
        help="send a trace or a generated workload to a running gateway or server, live",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", "") if __doc__ else "",
        formatter_class=HelpFormatter,
    )
    p.add_argument("url", help="the gateway's (or a server's) base URL, e.g. the stack's gateway_url")
    add_workload_args(p)
    p.add_argument("--model", default="", help="the model requests without an adapter ask for "
                   "(default: the first the server lists at /v1/models)")  # fmt: skip
    p.add_argument("--max-in-flight", type=int, default=256, help="most requests open at once")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request is cut after this")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let servers stop at an end-of-sequence token (default: exactly the "
                   "trace's output length)")  # fmt: skip
    p.add_argument("--api", choices=sorted(APIS), default=None,
                   help="send every request to this API, in its form: a conversation's turns "
                   "as messages, a tool's output after an assistant turn as a tool call and its "
                   "result (chat: tool_calls and a tool message; messages: Anthropic tool_use and "
                   "tool_result blocks). Default: a request log's messages rows as recorded, "
                   "text prompts as completions")
    p.add_argument("--out", help="write every request and what came back as JSON lines")
    p.set_defaults(run=run)


async def first_model(url: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        http.get(url.rstrip("/") + "/v1/models") as r,
    ):
        if r.status != 200:
            raise ValueError(f"GET {url}/v1/models answered {r.status}: pass --model")
        data = (await r.json()).get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model: pass --model")
    return str(data[0]["id"])


def run(args: argparse.Namespace) -> int:
    from simulator.replay.cli import build_workload

    try:
        if args.max_in_flight < 1 or args.timeout_s <= 0:
            raise ValueError("--max-in-flight must be >= 1 and --timeout-s > 0")
        workload = build_workload(args)
        if not len(workload):
            raise ValueError(f"workload {workload.name} has no requests")
        model = args.model or asyncio.run(first_model(args.url))
    except (ValueError, OSError, aiohttp.ClientError) as exc:
        print(f"epp-sim load: {exc}", file=sys.stderr)
        return 2
    options = LoadOptions(model, args.max_in_flight, args.timeout_s, not args.no_ignore_eos,
                          APIS[args.api] if args.api else None)  # fmt: skip
    print(f"epp-sim load: {len(workload)} requests of {workload.name} to {args.url} ({model})",
          file=sys.stderr)  # fmt: skip
    sent = asyncio.run(run_load(args.url, workload, options))
    summary = summarize(sent)
    print(describe(summary))
    if args.out:
        with Path(args.out).open("w", encoding="utf-8") as f:
            for s in sent:
                f.write(json.dumps({"request_id": s.request.request_id, "arrival_s": s.request.arrival_s,
                                    "session_id": s.request.session_id, "late_s": s.late_s,
                                    **asdict(s.record)}) + "\n")  # fmt: skip
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if summary.ok == summary.requests else 1

