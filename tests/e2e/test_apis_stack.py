"""The APIs beyond OpenAI's text ones through the whole local stack (real Envoy, epp,
emulated servers): Anthropic Messages as a coding agent sends it, the auxiliary and token-in
APIs, an audio upload."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import Stack
from tests.e2e.conftest import model_of

SYSTEM = "You are a coding agent working in a large repository. " * 40
TOOLS = [{"name": f"tool_{i}", "description": "Reads and edits files of the repository. " * 6,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for i in range(6)]  # fmt: skip


def turn(messages: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    return [*messages,
            {"role": "assistant", "content": [{"type": "text", "text": f"Step {i}."},
                                              {"type": "tool_use", "id": f"tu_{i}", "name": "tool_1",
                                               "input": {"path": f"f{i}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"tu_{i}",
                                          "content": f"contents of f{i}.py " * 40}]}]  # fmt: skip


async def test_an_agent_session_in_messages_form_stays_on_its_replica_and_hits(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    picked, cached = [], []
    for i in range(4):
        body = {"model": model_of(stack), "max_tokens": 8, "system": SYSTEM, "tools": TOOLS,
                "messages": messages, "stream": i % 2 == 1}  # fmt: skip
        async with http.post(stack.gateway_url + "/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            picked.append(r.headers[UPSTREAM_HOST_HEADER])
            raw = await r.read()
        if body["stream"]:
            events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
            assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
            usage = next(e["usage"] for e in events if e["type"] == "message_delta")
        else:
            usage = json.loads(raw)["usage"]
        cached.append(usage["cache_read_input_tokens"])
        messages = turn(messages, i)
    assert len(set(picked)) == 1, picked  # each turn found its session's replica
    assert all(c > 600 for c in cached[1:]), cached  # and the turns before it, cached there
    status = 0
    async with http.post(stack.gateway_url + "/v1/messages/count_tokens",
                         json={"model": model_of(stack), "system": SYSTEM, "messages": messages}) as r:  # fmt: skip
        status = r.status
        assert (await r.json())["input_tokens"] > 0
    assert status == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hello"}),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/pooling", {"input": "a"}),
        ("/classify", {"input": "a"}),
        ("/generate", {"text": "hello " * 40, "sampling_params": {"max_new_tokens": 4}}),
        ("/inference/v1/generate", {"token_ids": list(range(10, 90)), "sampling_params": {"max_tokens": 4}}),
    ],
)
async def test_auxiliary_and_token_in_apis_go_through(
    stack: Stack, http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    if path not in ("/generate",):
        body = {"model": model_of(stack), **body}
    async with http.post(stack.gateway_url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers[UPSTREAM_HOST_HEADER] in stack.endpoints()


async def test_an_audio_upload_is_routed_by_its_form(stack: Stack, http: aiohttp.ClientSession) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF" + bytes(16_384), filename="a.wav", content_type="audio/wav")
    form.add_field("model", model_of(stack))
    async with http.post(stack.gateway_url + "/v1/audio/transcriptions", data=form) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["text"]
