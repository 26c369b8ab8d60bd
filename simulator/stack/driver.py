"""Drive a ``SharedPrefixWorkload`` through the gateway and time every request.

Every request streams (SSE, ``stream_options.include_usage``); the client measures TTFT as
the time to the first chunk carrying text, and checks that the stream is intact (every
``data:`` line is JSON, the stream ends with ``[DONE]``). Turn ``t`` of a user is sent after
turn ``t-1`` finished, with the answer it received in its history. Each request carries an
``x-request-id`` of its own, which Envoy's access log (the stack's) records beside its timings,
and its conversation in ``x-session-id`` (``u<user>``), as a chat client sends it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from epp.request.parse import REQUEST_ID_HEADER
from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.replay.policies import SESSION_HEADER
from simulator.stack.workload import SharedPrefixWorkload, Texts, group_of, make_texts


@dataclass(slots=True)
class RequestRecord:
    user: int
    turn: int
    group: int
    start_s: float
    """Seconds from the start of the run."""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    status: int = 0
    upstream: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    request_id: str = ""
    """Sent as ``x-request-id``: the key of Envoy's access log line for this request."""
    upstream_ttft_s: float | None = None
    """Seen by Envoy (its access log): from the request's first byte to the server's first
    response body bytes. ``ttft_s`` minus this is the response path's share (Envoy, epp's
    response processing, the client), plus the request's trip to Envoy."""
    routed_s: float | None = None
    """Seen by Envoy: from the request's first byte to its first byte sent to the server
    (epp's headers and body exchange and its pick)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass(slots=True)
class RunRecords:
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass(slots=True)
class _Conversation:
    user: int
    history: list[tuple[str, str]] = field(default_factory=list)
    """(question, answer) of finished turns."""
    turn_done: list[asyncio.Event] = field(default_factory=list)


def request_body(
    w: SharedPrefixWorkload, texts: Texts, conv: _Conversation, turn: int, model: str
) -> tuple[str, dict[str, object]]:
    system = texts.system_prompts[group_of(w, conv.user)]
    question = texts.questions[conv.user][turn if w.multi_turn else 0]
    history = conv.history if w.multi_turn else []
    common: dict[str, object] = {
        "model": model,
        "max_tokens": w.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if w.api == "chat":
        messages = [{"role": "system", "content": system}]
        for q, a in history:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        return "/v1/chat/completions", {**common, "messages": messages}
    prompt = " ".join([system, *(f"{q} {a}" for q, a in history), question])
    return "/v1/completions", {**common, "prompt": prompt}


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    rec: RequestRecord,
    chat: bool,
    headers: dict[str, str] | None = None,
) -> str:
    """Send one streaming request; fill ``rec``; return the generated text."""
    t0 = time.perf_counter()
    text: list[str] = []
    if rec.request_id:
        headers = {**(headers or {}), REQUEST_ID_HEADER: rec.request_id}
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            rec.status = resp.status
            rec.upstream = resp.headers.get(UPSTREAM_HOST_HEADER, "")
            if resp.status != 200:
                rec.error = (await resp.text())[:200]
                return ""
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "type" in chunk and "choices" not in chunk:  # Anthropic Messages events
                    said, stop = _anthropic_event(chunk, rec)
                    done = done or stop
                    if said:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        text.append(said)
                    continue
                for choice in chunk.get("choices") or ():
                    piece = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
            if not done:
                rec.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        rec.e2e_s = time.perf_counter() - t0
    return "".join(text)


def _anthropic_event(event: dict[str, Any], rec: RequestRecord) -> tuple[str, bool]:
    """One event of an Anthropic Messages stream: its text, and whether the stream is done
    (``message_stop``); usage into ``rec`` (the prompt is ``input_tokens`` plus the cache
    reads and writes, the cached part the reads)."""
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        return (delta.get("text") or "") if delta.get("type") == "text_delta" else "", False
    usage = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
    if isinstance(usage, dict):
        if "input_tokens" in usage:
            read = usage.get("cache_read_input_tokens") or 0
            rec.prompt_tokens = usage["input_tokens"] + read + (usage.get("cache_creation_input_tokens") or 0)
            rec.cached_tokens = read
        if "output_tokens" in usage:
            rec.completion_tokens = usage["output_tokens"]
    if kind == "error":
        rec.error = json.dumps(event)[:200]
    return "", kind == "message_stop"


async def run_workload(
    gateway_url: str,
    w: SharedPrefixWorkload,
    model: str,
    on_done: Callable[[RequestRecord], None] | None = None,
    servers: list[str] | None = None,
) -> RunRecords:
    """``servers``: the model servers' URLs, for ``w.bypass_share``."""
    texts = make_texts(w, w.num_turns)
    convs = [
        _Conversation(u, turn_done=[asyncio.Event() for _ in range(w.num_turns)])
        for u in range(w.users)
    ]
    out = RunRecords()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    t_start = time.perf_counter()
    if w.bypass_share and not servers:
        raise ValueError("bypass_share needs the servers' URLs")
    def target(user: int, t: int) -> str:
        # decided per (user, turn), so every policy sends the same requests past epp
        rng = random.Random(w.seed * 1_000_003 + user * 1_009 + t)
        if servers and w.bypass_share and rng.random() < w.bypass_share:
            return servers[rng.randrange(len(servers))]
        return gateway_url

    async def turn(session: aiohttp.ClientSession, conv: _Conversation, t: int) -> None:
        path, body = request_body(w, texts, conv, t, model)
        rec = RequestRecord(conv.user, t, group_of(w, conv.user), time.perf_counter() - t_start,
                            request_id=uuid.uuid4().hex)
        base = target(conv.user, t)
        answer = await stream_one(session, base + path, body, rec, w.api == "chat",
                                  {SESSION_HEADER: f"u{conv.user}"})
        if base != gateway_url:
            rec.upstream = base.removeprefix("http://")
        conv.history.append((texts.questions[conv.user][t], answer))
        out.records.append(rec)
        if on_done is not None:
            on_done(rec)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if w.stages:
            await _open_loop(session, w, convs, turn, t_start)
        else:
            order = list(range(w.users))
            random.Random(w.seed).shuffle(order)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for u in order:
                queue.put_nowait(u)

            async def worker() -> None:
                while not queue.empty():
                    conv = convs[queue.get_nowait()]
                    for t in range(w.num_turns):
                        await turn(session, conv, t)

            await asyncio.gather(*(worker() for _ in range(min(w.concurrency, w.users))))
    out.wall_s = time.perf_counter() - t_start
    return out


def arrival_order(w: SharedPrefixWorkload) -> list[int]:
    """Single-turn open loop: users (system prompt g, question q) in the order ``epp-sim
    replay``'s shared-prefix generator sends them (a shuffle seeded by the workload's seed),
    so the replay and the live stack run the same request sequence from one recipe."""
    pairs = [(g, q) for g in range(w.num_groups) for q in range(w.num_prompts_per_group)]
    random.Random(w.seed).shuffle(pairs)
    return [g * w.num_prompts_per_group + q for g, q in pairs]


async def _open_loop(
    session: aiohttp.ClientSession,
    w: SharedPrefixWorkload,
    convs: list[_Conversation],
    turn: Callable[..., object],
    t_start: float,
) -> None:
    rng = random.Random(w.seed)
    users = len(convs)
    order = list(range(users)) if w.multi_turn else arrival_order(w)
    tasks: list[asyncio.Task[None]] = []
    at = 0.0
    k = 0
    for rate, duration in w.stages:
        n = round(rate * duration)
        stage_end = at + duration
        for _ in range(n):
            gap = rng.expovariate(rate) if w.poisson else 1.0 / rate
            delay = t_start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule itself
            conv, t = convs[order[k % users]], k // users
            if not w.multi_turn:
                t = 0

            async def send(conv: _Conversation = conv, t: int = t) -> None:
                if w.multi_turn and t > 0:
                    await conv.turn_done[t - 1].wait()
                await turn(session, conv, min(t, w.num_turns - 1))  # type: ignore[misc]
                if w.multi_turn:
                    conv.turn_done[t].set()

            tasks.append(asyncio.create_task(send()))
            at += gap
            k += 1
        at = max(at, stage_end) if not w.poisson else at
    await asyncio.gather(*tasks)
