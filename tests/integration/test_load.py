"""``epp-sim load``: a workload sent live at its arrival times, every request measured, and
what a request carries (its session, its tenant, its adapter, exact output lengths)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

from aiohttp import web

from epp.framework.request import ApiKind
from simulator.emulator import EmulatorConfig, start_emulator
from simulator.load import LoadOptions, body_of, run_load, summarize
from simulator.replay.workload import TraceRequest, build_generator
from tests.http_app import serve_app
from tests.unit.simulator.test_replay import ListWorkload


async def test_a_chat_workload_sent_live_is_measured_and_cached() -> None:
    server = await start_emulator(EmulatorConfig(speedup=50.0, model="m"))
    try:
        workload = build_generator("chat", {"num_sessions": 6, "turns_per_session": 3, "rate": 40.0,
                                            "output_len": 12, "system_prompt_len": 256})  # fmt: skip
        sent = await run_load(server.url, workload, LoadOptions("m"))
    finally:
        await server.close()
    assert len(sent) == len(workload) == 18
    assert all(s.record.ok for s in sent), [s.record.error for s in sent if not s.record.ok]
    assert all(s.record.completion_tokens == 12 for s in sent)  # ignore_eos: exact lengths
    # open loop at the trace's times: the last request went out no sooner than it was due
    last = max(sent, key=lambda s: s.request.arrival_s)
    assert last.record.start_s >= last.request.arrival_s - 0.01
    s = summarize(sent)
    assert s.ok == 18 and s.hit_rate > 0.3  # later turns and shared system prompts hit
    assert 0 < s.ttft_p50_s <= s.ttft_p90_s and s.tpot_p50_s > 0


async def test_sessions_tenants_and_adapters_go_with_the_request(tmp_path: Path) -> None:
    seen: list[tuple[str, dict[str, object]]] = []
    tenants: dict[str, str] = {}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((request.headers.get("x-session-id", ""), body))
        tenants[body["prompt"]] = request.headers.get("x-llm-d-inference-fairness-id", "")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "hi"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                          "prompt_tokens_details": {"cached_tokens": 4}}}  # fmt: skip
        for data in (json.dumps(chunk), json.dumps(usage), "[DONE]"):
            await resp.write(f"data: {data}\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner, port = await serve_app(app)
    items = [TraceRequest("a", 0.0, 5, 3, "hello", session_id="s1", adapter="sql-lora", tenant="acme"),
             TraceRequest("b", 0.05, 5, 0, "hello again")]  # fmt: skip
    try:
        sent = await run_load(f"http://127.0.0.1:{port}", ListWorkload(items), LoadOptions("base"))
    finally:
        await runner.cleanup()
    by_prompt = {body["prompt"]: (session, body) for session, body in seen}
    session, body = by_prompt["hello"]
    assert session == "s1" and body["model"] == "sql-lora" and body["max_tokens"] == 3
    assert body["ignore_eos"] is True and body["stream"] is True
    session, body = by_prompt["hello again"]
    assert session == "" and body["model"] == "base" and body["max_tokens"] == 1  # at least one
    assert tenants == {"hello": "acme", "hello again": ""}  # flow control's fairness id
    assert summarize(sent).hit_rate == 0.8
    assert body_of(items[0], LoadOptions("base", ignore_eos=False))[1].get("ignore_eos") is None
    await asyncio.sleep(0)


async def test_agent_sessions_sent_in_messages_form_are_cached_turn_by_turn() -> None:
    server = await start_emulator(EmulatorConfig(speedup=50.0, model="m", num_gpu_blocks=4096))
    try:
        workload = build_generator("agentic", {"num_sessions": 3, "rate": 20.0, "min_turns": 4, "max_turns": 4,
                                               "turn_gap_s": 0.05, "system_prompt_len": 512, "tool_output_len": 64,
                                               "output_len": 8, "subagents": 0, "num_system_prompts": 1})  # fmt: skip
        sent = await run_load(server.url, workload, LoadOptions("m", api=ApiKind.MESSAGES))
    finally:
        await server.close()
    assert len(sent) == 12 and all(s.record.ok for s in sent), [s.record.error for s in sent]
    assert all(s.record.completion_tokens == 8 for s in sent)  # Anthropic usage read
    _, *rest = sorted(sent, key=lambda s: s.request.arrival_s)
    assert all(s.record.cached_tokens >= 512 for s in rest)  # the shared system prompt, at least
    by_session: dict[str, list[int]] = {}
    for s in sorted(sent, key=lambda s: s.request.arrival_s):
        by_session.setdefault(s.request.session_id, []).append(s.record.cached_tokens)
    # each next turn finds its previous turn's prompt: the Messages form keeps the prefix
    assert all(b > a for cached in by_session.values() for a, b in itertools.pairwise(cached))
