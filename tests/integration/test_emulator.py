"""The vLLM emulator over real HTTP: API shapes, streaming, cache reporting, metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.emulator import EmulatorConfig, RunningEmulator, start_emulator

MODEL = "test-model"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12

VLLM_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_success",
}


@pytest.fixture
async def emulator() -> AsyncIterator[RunningEmulator]:
    config = EmulatorConfig(
        model=MODEL,
        speedup=100.0,
        num_gpu_blocks=2048,
        max_num_seqs=1,
        lora_adapters=("sql", "chat"),
        max_loras=2,
    )
    server = await start_emulator(config)
    try:
        yield server
    finally:
        await server.close()


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield each ``data:`` payload of a server-sent event stream."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: ") :]


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, sample_name: str | None = None) -> float:
    samples = [s for s in families[name].samples if s.name == (sample_name or name)]
    assert len(samples) == 1, samples
    return float(samples[0].value)


async def test_completion_reports_usage_and_deterministic_text(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7}
    status, first = await post(http, emulator.url + "/v1/completions", body)
    assert status == 200
    assert first["object"] == "text_completion"
    text = first["choices"][0]["text"]
    assert len(text) == 28 and first["choices"][0]["finish_reason"] == "length"
    assert first["usage"] == {
        "prompt_tokens": len(PROMPT) // 4 + (len(PROMPT) % 4 > 0),
        "completion_tokens": 7,
        "total_tokens": first["usage"]["prompt_tokens"] + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    _, second = await post(http, emulator.url + "/v1/completions", body)
    assert second["choices"][0]["text"] == text
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_failing_engine_step_answers_500_and_the_engine_loop_restarts(
    emulator: RunningEmulator, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    engine = emulator.emulator.engine
    real_advance = engine.advance
    failures = []

    def advance_once_broken(now: float) -> Any:
        engine.advance = real_advance  # type: ignore[method-assign]
        failures.append(now)
        raise RuntimeError("injected engine fault")

    engine.advance = advance_once_broken  # type: ignore[method-assign]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    status, failed = await post(http, emulator.url + "/v1/completions", body)
    assert failures and status == 500
    assert "engine failed" in failed["error"]["message"]
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert "background task emulator-engine failed" in caplog.text
    # the supervised loop restarted: the next request is served
    status, served = await post(http, emulator.url + "/v1/completions", body)
    assert status == 200 and served["usage"]["completion_tokens"] == 3


async def test_reset_prefix_cache_empties_the_cache_and_keeps_the_counters(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    await post(http, emulator.url + "/v1/completions", body)
    _, warm = await post(http, emulator.url + "/v1/completions", body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    queries = value(await scrape(http, emulator.url), "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_queries_total")
    status, reply = await post(http, emulator.url + "/reset_prefix_cache", None)
    assert (status, reply) == (200, {"success": True})  # as vLLM's dev-mode endpoint
    _, cold = await post(http, emulator.url + "/v1/completions", body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert value(await scrape(http, emulator.url), "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_queries_total") > queries


async def test_chat_completion_shape(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, out = await post(http, emulator.url + "/v1/chat/completions", body)
    assert status == 200
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 12
    assert out["usage"]["completion_tokens"] == 3


async def test_next_chat_turn_hits_the_cached_answer(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    url = emulator.url + "/v1/chat/completions"
    turn1 = [{"role": "user", "content": PROMPT}]
    _, out1 = await post(http, url, {"model": MODEL, "messages": turn1, "max_tokens": 64})
    answer = out1["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then? " * 20}]
    _, out2 = await post(http, url, {"model": MODEL, "messages": turn2, "max_tokens": 4})
    cached = out2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > out1["usage"]["prompt_tokens"]  # beyond turn 1's prompt: the answer too


async def test_streaming_chat_with_usage(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    _, plain = await post(
        http,
        emulator.url + "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 20},
    )
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(emulator.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        payloads = [p async for p in sse_events(resp)]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == plain["choices"][0]["message"]["content"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 20
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_streaming_completion_without_usage_option(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "count", "max_tokens": 5, "stream": True}
    async with http.post(emulator.url + "/v1/completions", json=body) as resp:
        payloads = [p async for p in sse_events(resp)]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("usage" not in c for c in chunks)
    assert len("".join(c["choices"][0]["text"] for c in chunks)) == 20


async def test_metrics_expose_vllm_names(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for _ in range(2):
        await post(http, emulator.url + "/v1/completions", body)
    families = await scrape(http, emulator.url)
    assert families.keys() >= VLLM_METRICS
    assert value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") > 0
    assert value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") >= 2 * (
        len(PROMPT) // 4
    )
    assert value(families, "vllm:request_success", "vllm:request_success_total") == 2
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "2048"
    lora = families["vllm:lora_requests_info"].samples[0]
    assert lora.labels["max_lora"] == "2" and lora.labels["model_name"] == MODEL
    ttft = families["vllm:time_to_first_token_seconds"]
    count = [s for s in ttft.samples if s.name.endswith("_count")]
    assert count[0].value == 2


async def test_running_adapter_and_queue_show_in_metrics_until_client_leaves(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    long_body = {"model": "sql", "prompt": PROMPT, "max_tokens": 30000, "stream": True}
    queued = {"model": "chat", "prompt": "queued", "max_tokens": 2}
    async with http.post(emulator.url + "/v1/completions", json=long_body) as resp:
        stream = sse_events(resp)
        await anext(stream)  # first token: the adapter request is running
        waiter = asyncio.create_task(post(http, emulator.url + "/v1/completions", queued))
        families = await scrape(http, emulator.url)
        while value(families, "vllm:num_requests_waiting") == 0:
            families = await scrape(http, emulator.url)
        assert value(families, "vllm:num_requests_running") == 1
        assert value(families, "vllm:kv_cache_usage_perc") > 0
        lora = families["vllm:lora_requests_info"].samples[0].labels
        assert lora["running_lora_adapters"] == "sql"
        assert lora["waiting_lora_adapters"] == "chat"
        resp.close()  # the client gives up: the server aborts the request and frees the slot
    # With max_num_seqs=1 the queued request runs only once the abandoned one is gone
    # (left to run, it would stream for minutes).
    status, out = await waiter
    assert status == 200 and out["model"] == "chat"
    families = await scrape(http, emulator.url)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:request_success", "vllm:request_success_total") == 1


@pytest.mark.parametrize(
    ("path", "raw", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"model": "test-model"}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', 400),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
        ("/v1/unknown", b"{}", 404),
    ],
)
async def test_errors_are_openai_shaped(
    emulator: RunningEmulator, http: aiohttp.ClientSession, path: str, raw: bytes, status: int
) -> None:
    async with http.post(
        emulator.url + path, data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == status
        body = await resp.json()
    assert body["error"]["code"] == status and body["error"]["message"]


async def test_prompt_beyond_kv_capacity_is_rejected(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http, emulator.url + "/v1/completions", {"prompt": "x" * 4 * 2048 * 17, "max_tokens": 1}
    )
    assert status == 400 and "error" in body


async def test_models_health_embeddings_responses(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    async with http.get(emulator.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(emulator.url + "/v1/models") as resp:
        ids = [m["id"] for m in (await resp.json())["data"]]
    assert ids == [MODEL, "sql", "chat"]
    status, emb = await post(
        http, emulator.url + "/v1/embeddings", {"model": MODEL, "input": ["one two", "three"]}
    )
    assert status == 200 and len(emb["data"]) == 2
    assert emb["usage"]["prompt_tokens"] == 2 + 2
    status, out = await post(
        http,
        emulator.url + "/v1/responses",
        {"model": MODEL, "input": "hello", "max_output_tokens": 3},
    )
    assert status == 200 and out["status"] == "completed"
    assert len(out["output"][0]["content"][0]["text"]) == 12
    assert out["usage"]["output_tokens"] == 3


def test_cli_prints_bound_url_and_serves() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "simulator.cli", "emulate", "--port", "0", "--model", "m"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        assert line["url"].startswith("http://127.0.0.1:")

        async def health() -> int:
            async with aiohttp.ClientSession() as s, s.get(line["url"] + "/v1/models") as r:
                return (await r.json())["data"][0]["id"]

        assert asyncio.run(health()) == "m"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


async def test_stored_responses_continue_retrieve_cancel_and_delete_on_their_server(
    http: aiohttp.ClientSession,
) -> None:
    """As vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1: a stored response is continued,
    returned and cancelled only by the server that holds it; another answers 404."""
    config = EmulatorConfig(model=MODEL, speedup=100.0, num_gpu_blocks=2048)
    home, other = await start_emulator(config), await start_emulator(config)
    try:
        status, first = await post(http, home.url + "/v1/responses",
                                   {"model": MODEL, "input": PROMPT, "max_output_tokens": 4})  # fmt: skip
        assert status == 200 and first["id"].startswith("resp_") and len(first["id"]) == 37
        follow = {"model": MODEL, "input": "and then?", "previous_response_id": first["id"],
                  "max_output_tokens": 4}  # fmt: skip
        status, err = await post(http, other.url + "/v1/responses", follow)
        assert status == 404 and first["id"] in err["error"]["message"]
        status, second = await post(http, home.url + "/v1/responses", follow)
        assert status == 200 and second["id"] != first["id"]
        # the follow-up's prompt is the stored conversation plus the new input: cached
        assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 16
        async with http.get(f"{home.url}/v1/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["status"] == "completed"
        async with http.get(f"{other.url}/v1/responses/{first['id']}") as r:
            assert r.status == 404
        async with http.post(f"{home.url}/v1/responses/{first['id']}/cancel") as r:
            assert r.status == 400  # finished: not cancellable, as vLLM says

        # a background response: queued at once, cancelled while it runs
        status, queued = await post(http, home.url + "/v1/responses", {
            "model": MODEL, "input": PROMPT, "max_output_tokens": 4000, "background": True,
        })  # fmt: skip
        assert status == 200 and queued["status"] == "queued"
        async with http.post(f"{other.url}/v1/responses/{queued['id']}/cancel") as r:
            assert r.status == 404
        async with http.post(f"{home.url}/v1/responses/{queued['id']}/cancel") as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
        async with http.get(f"{home.url}/v1/responses/{queued['id']}") as r:
            assert (await r.json())["status"] == "cancelled"
        assert not home.emulator._pending  # out of the engine

        # store false: nothing kept; delete forgets
        status, unstored = await post(http, home.url + "/v1/responses",
                                      {"model": MODEL, "input": "x", "store": False})  # fmt: skip
        async with http.get(f"{home.url}/v1/responses/{unstored['id']}") as r:
            assert r.status == 404
        async with http.delete(f"{home.url}/v1/responses/{second['id']}") as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        async with http.get(f"{home.url}/v1/responses/{second['id']}") as r:
            assert r.status == 404
    finally:
        await home.close()
        await other.close()


async def test_a_streamed_stored_response_names_its_id_first_and_is_kept(
    emulator: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    async with http.post(emulator.url + "/v1/responses",
                         json={"model": MODEL, "input": "hi", "stream": True}) as resp:  # fmt: skip
        events = [json.loads(e) async for e in sse_events(resp)]
    assert events[0]["type"] == "response.created"
    rid = events[0]["response"]["id"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["id"] == rid
    async with http.get(f"{emulator.url}/v1/responses/{rid}") as r:
        assert r.status == 200 and (await r.json())["status"] == "completed"
