"""The default bootstrap's response summary through real Envoy (epp.extproc.summary): what
epp learns from streamed and unstreamed answers, what a long answer costs it, and a client
that leaves a stream epp no longer reads."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from tests.envoy.conftest import MODEL, EppProcess, Pool, chat, pool, until_epp_routes

pytestmark = pytest.mark.e2e

HANDED = 'epp_response_observer_requests_total{outcome="handed_over"}'


async def _value(epp: EppProcess, sample: str) -> float:
    """One sample of epp's metrics page (name and labels as written), 0 when absent."""
    async with aiohttp.ClientSession() as http, http.get(
        f"http://127.0.0.1:{epp.metrics_port}/metrics"
    ) as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(what: str, check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)  # poll


async def _stream(http: aiohttp.ClientSession, p: Pool, text: str, tokens: int) -> dict[str, int]:
    """A streamed chat answer read to its end; its usage as the client saw it."""
    async with http.post(p.url + "/v1/chat/completions",
                         json=chat(text, stream=True, max_tokens=tokens)) as r:  # fmt: skip
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"  # intact to its end
    usage: dict[str, int] = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == tokens
    return usage


async def _summaries_reach(p: Pool, http: aiohttp.ClientSession) -> None:
    """Until epp leaves streamed answers to the access log: it does once entries for its own
    requests arrive (the first answers are read to the end)."""
    epp = p.epps[0]
    await until_epp_routes(p, http)

    async def handed() -> bool:
        await _stream(http, p, "warm the access log up", 4)
        return await _value(epp, HANDED) > 0  # refreshed every second

    await _until("epp never left a streamed answer to the access log", handed, 20)


async def test_usage_cached_tokens_and_first_token_time_reach_epp_for_both_kinds_of_answer(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, speedup=4.0) as p:  # a streamed answer spans several chunks
        epp = p.epps[0]
        await _summaries_reach(p, http)
        await asyncio.sleep(0.3)  # the warm-up's last entries
        prompt = await epp.metric("epp_usage_prompt_tokens_total")
        cached = await epp.metric("epp_usage_cached_tokens_total")
        completion = await epp.metric("epp_usage_completion_tokens_total")
        firsts = await epp.metric("epp_time_to_first_token_seconds_count")
        handed = await _value(epp, HANDED)
        seen = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
        text = "tell me about the history of bread " * 20
        for i in range(3):
            streamed = await _stream(http, p, text, 24 + i)
            async with http.post(p.url + "/v1/chat/completions", json=chat(text, max_tokens=6)) as r:
                assert r.status == 200
                plain = (await r.json())["usage"]
            for u in (streamed, plain):
                seen["prompt_tokens"] += u["prompt_tokens"]
                seen["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
                seen["completion_tokens"] += u["completion_tokens"]
        assert seen["cached_tokens"] > 0  # the same prompt, where epp sent it before

        async def learnt() -> bool:
            return (await epp.metric("epp_usage_completion_tokens_total") - completion
                    >= seen["completion_tokens"])  # fmt: skip

        await _until("the answers' usage never reached epp", learnt)
        assert await epp.metric("epp_usage_completion_tokens_total") - completion == seen["completion_tokens"]
        assert await epp.metric("epp_usage_prompt_tokens_total") - prompt == seen["prompt_tokens"]
        assert await epp.metric("epp_usage_cached_tokens_total") - cached == seen["cached_tokens"]
        assert await epp.metric("epp_time_to_first_token_seconds_count") - firsts == 6
        # the other APIs epp parses: the Responses API's stream (usage read by Envoy) and a
        # legacy completions stream (read to its end by epp: Envoy does not know its chunks)
        others = (("/v1/responses", {"input": text, "max_output_tokens": 12}),
                  ("/v1/completions", {"prompt": text, "max_tokens": 12}))  # fmt: skip
        for path, body in others:
            async with http.post(p.url + path, json={"model": MODEL, "stream": True,
                                 "stream_options": {"include_usage": True}, **body}) as r:  # fmt: skip
                assert r.status == 200
                await r.read()
        seen["completion_tokens"] += 24
        await _until("the other APIs' usage never reached epp", learnt)
        assert await epp.metric("epp_time_to_first_token_seconds_count") - firsts == 8

        async def streamed_answers_left_to_the_log() -> bool:
            return await _value(epp, HANDED) - handed >= 4  # three chats and the responses

        await _until("the streamed answers were read to the end", streamed_answers_left_to_the_log)


async def test_a_long_streamed_answer_costs_epp_as_many_replies_as_a_short_one(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, speedup=4.0) as p:
        await _summaries_reach(p, http)
        replies = "http.inference.ext_proc.stream_msgs_received"
        counts = []
        for tokens in (8, 400):
            before = (await p.envoy.counters(replies))[replies]
            await _stream(http, p, f"an answer of {tokens} tokens", tokens)
            counts.append((await p.envoy.counters(replies))[replies] - before)
        # request headers, request body, response headers, the first body bytes
        assert counts == [4, 4]


async def test_a_client_that_leaves_a_stream_epp_no_longer_reads_is_released(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, speedup=2.0) as p:
        epp = p.epps[0]
        await _summaries_reach(p, http)
        handed = await _value(epp, HANDED)
        async with http.post(p.url + "/v1/chat/completions",
                             json=chat("tell me a long story", stream=True, max_tokens=400)) as r:  # fmt: skip
            assert r.status == 200
            await r.content.readline()  # the first event, then the client goes away
            r.close()

        async def released() -> bool:
            return await epp.metric("epp_endpoint_in_flight_requests") == 0

        await _until("the abandoned request was never released", released)

        async def left_to_the_log() -> bool:  # it was the access log that ended it
            return await _value(epp, HANDED) > handed

        await _until("the stream was read to the end", left_to_the_log)
        assert await epp.metric('epp_requests_total{model="meta-llama/Llama-3.1-8B-Instruct",status="cancelled"}') == 1
