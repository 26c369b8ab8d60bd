"""The emulator's Anthropic Messages, auxiliary and token-in APIs over real HTTP, and epp's
response reader on what they send."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from epp.requestcontrol.response import ResponseReader
from simulator.emulator import EmulatorConfig, RunningEmulator, start_emulator

MODEL = "test-model"
SYSTEM = "You are a careful coding agent. " * 40
TOOLS = [{"name": "read_file", "description": "Read a file from the repository. " * 10,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]  # fmt: skip


@pytest.fixture
async def emulator() -> AsyncIterator[RunningEmulator]:
    server = await start_emulator(EmulatorConfig(model=MODEL, speedup=100.0, num_gpu_blocks=2048))
    try:
        yield server
    finally:
        await server.close()


def messages(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug in parser.py."}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": f"tu_{i}", "name": "read_file", "input": {"path": "parser.py"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"tu_{i}", "content": "def parse(x): ... " * 30}]})  # fmt: skip
    return msgs


async def read_through_epp(resp: aiohttp.ClientResponse) -> tuple[bytes, ResponseReader]:
    """The body as it arrives, fed to epp's response reader as Envoy would hand it over."""
    reader = ResponseReader(resp.status, "text/event-stream" in resp.headers.get("content-type", ""))
    data = b""
    async for chunk in resp.content.iter_any():
        data += chunk
        reader.feed(chunk, False)
    reader.feed(b"", True)
    return data, reader


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_answer_in_anthropic_shapes_with_cache_usage(
    emulator: RunningEmulator, http: aiohttp.ClientSession, stream: bool
) -> None:
    url = emulator.url + "/v1/messages"
    infos = []
    for turns in (1, 2):  # the second request extends the first: its prefix is cached
        body = {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "tools": TOOLS,
                "messages": messages(turns), "stream": stream}  # fmt: skip
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            data, reader = await read_through_epp(resp)
        if stream:
            events = [line[7:] for line in data.decode().splitlines() if line.startswith("event: ")]
            assert events[0] == "message_start" and events[-1] == "message_stop"
            assert "content_block_delta" in events and "message_delta" in events
        else:
            doc = json.loads(data)
            assert (doc["type"], doc["role"], doc["content"][0]["type"]) == ("message", "assistant", "text")
            assert set(doc["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens"}
        infos.append(reader.info())
    first, second = infos
    assert first.completion_tokens == 12 and len(first.generated_text) == 12 * 4
    assert second.prompt_tokens > first.prompt_tokens
    assert second.cached_tokens is not None and second.cached_tokens >= first.prompt_tokens // 2


async def test_count_tokens_counts_what_messages_would_prefill(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "system": SYSTEM, "tools": TOOLS, "messages": messages(1)}
    async with http.post(emulator.url + "/v1/messages/count_tokens", json=body) as resp:
        assert resp.status == 200
        counted = (await resp.json())["input_tokens"]
    async with http.post(emulator.url + "/v1/messages", json={**body, "max_tokens": 4}) as resp:
        assert (await resp.json())["usage"]["input_tokens"] == counted


@pytest.mark.parametrize("block", [{"type": "thinking", "thinking": "hm"}, {"type": "no-such-block"}])
async def test_messages_of_blocks_vllm_drops_are_refused_naming_them(
    emulator: RunningEmulator, http: aiohttp.ClientSession, block: dict[str, Any]
) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
    async with http.post(emulator.url + "/v1/messages", json=body) as resp:
        assert resp.status == 400
        answer = await resp.json()
    assert answer["type"] == "error"  # Anthropic's shape, as vLLM answers on /v1/messages
    assert block["type"] in answer["error"]["message"] and answer["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": MODEL, "prompt": "hello world"}),
        ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
        ("/v2/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
        ("/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
        ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
        ("/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
        ("/pooling", {"model": MODEL, "input": "a"}),
        ("/classify", {"model": MODEL, "input": ["a", "b"]}),
        ("/v2/embed", {"model": MODEL, "texts": ["a"]}),
        ("/encode", {"text": "a"}),
        ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3}}),
        ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}),
        ("/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}),
    ],
)
async def test_auxiliary_and_token_in_apis_answer(
    emulator: RunningEmulator, http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    async with http.post(emulator.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert isinstance(await resp.json(), dict)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": list(range(100, 400)), "sampling_params": {"max_new_tokens": 4}}),
        ("/inference/v1/generate", {"token_ids": list(range(100, 400)), "sampling_params": {"max_tokens": 4}}),
    ],
)
async def test_token_in_usage_reaches_epp(
    emulator: RunningEmulator, http: aiohttp.ClientSession, path: str, body: dict[str, Any], stream: bool
) -> None:
    for _ in range(2):
        async with http.post(emulator.url + path, json={**body, "stream": stream}) as resp:
            assert resp.status == 200
            _, reader = await read_through_epp(resp)
    info = reader.info()  # the second request: all but its last block cached
    assert info.prompt_tokens == 300 and info.completion_tokens == 4
    assert info.cached_tokens is not None and info.cached_tokens >= 256


async def test_audio_upload_is_transcribed(emulator: RunningEmulator, http: aiohttp.ClientSession) -> None:
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        form = aiohttp.FormData()
        form.add_field("file", b"RIFF" + bytes(8192), filename="a.wav", content_type="audio/wav")
        form.add_field("model", MODEL)
        async with http.post(emulator.url + path, data=form) as resp:
            assert resp.status == 200
            assert (await resp.json())["text"]
