"""The whole local stack (emulated replicas + real epp + gateway), in both ext_proc modes."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import random

import aiohttp
import pytest

from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import Stack
from simulator.stack.demo import run_policy
from simulator.stack.workload import SharedPrefixWorkload
from tests.e2e.conftest import FAST, model_of, post

pytestmark = pytest.mark.e2e


def _sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, asserting the framing is intact."""
    text = raw.decode()
    assert text.endswith("\n\n"), "SSE stream must end with a blank line"
    out = []
    for event in text.split("\n\n")[:-1]:
        lines = [ln for ln in event.split("\n") if ln.startswith("data:")]
        assert lines, f"event without data: {event!r}"
        out.append("".join(ln[5:].strip() for ln in lines))
    return out


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Say hello to the gateway", "max_tokens": 6}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 6},
        ),
        ("/v1/responses", {"input": "Say hello", "max_output_tokens": 6}),
        ("/v1/embeddings", {"input": ["one text", "another text"]}),
    ],
    ids=["completions", "chat", "responses", "embeddings"],
)
async def test_every_api_kind_succeeds_through_the_gateway(
    stack: Stack, http: aiohttp.ClientSession, path: str, body: dict[str, object]
) -> None:
    status, headers, raw = await post(
        http, stack.gateway_url + path, {"model": model_of(stack), **body}
    )
    assert status == 200, raw
    assert headers[UPSTREAM_HOST_HEADER] in stack.endpoints()
    doc = json.loads(raw)
    if path == "/v1/embeddings":
        assert len(doc["data"]) == 2
    else:
        assert doc["usage"]
        assert doc["model"] == model_of(stack)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_sse_stream_arrives_intact_and_matches_the_non_streamed_answer(
    stack: Stack, http: aiohttp.ClientSession, chat: bool
) -> None:
    prompt = "Tell me about prefix caches. " * 20
    if chat:
        path, base = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, base = "/v1/completions", {"prompt": prompt}
    body = {"model": model_of(stack), "max_tokens": 40, **base}
    status, _, plain = await post(http, stack.gateway_url + path, body)
    assert status == 200
    choice = json.loads(plain)["choices"][0]
    expected = choice["message"]["content"] if chat else choice["text"]

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = await post(http, stack.gateway_url + path, stream_body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
        for c in chunks
        if c["choices"]
    )
    assert text == expected
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 40


async def test_a_shared_prefix_lands_on_the_same_replica(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    system = "You are the support assistant of a bakery. " * 60
    picked = []
    for i in range(6):
        body = {
            "model": model_of(stack),
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question number {i}"},
            ],
        }
        status, headers, raw = await post(http, stack.gateway_url + "/v1/chat/completions", body)
        assert status == 200, raw
        picked.append(headers[UPSTREAM_HOST_HEADER])
        if i:
            cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 500  # the system prompt's blocks were found on that replica
    assert len(set(picked)) == 1, picked


@pytest.mark.parametrize(
    ("path", "data", "status", "error_type"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": ', 400, "invalid_request_error"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "invalid_request_error"),
        ("/v1/unknown/path", b'{"model": "m"}', 404, "not_found_error"),
    ],
    ids=["malformed-json", "missing-model", "unknown-path"],
)
async def test_errors_from_epp_reach_the_client_with_their_status(
    stack: Stack,
    http: aiohttp.ClientSession,
    path: str,
    data: bytes,
    status: int,
    error_type: str,
) -> None:
    got, headers, raw = await post(http, stack.gateway_url + path, data=data)
    assert got == status
    assert headers["Content-Type"].startswith("application/json")
    assert UPSTREAM_HOST_HEADER not in headers  # answered by epp, no replica involved
    assert json.loads(raw)["error"]["type"] == error_type



@pytest.mark.parametrize(
    "data",
    [gzip.compress(b'{"model": "m", "prompt": "hello"}'), b'{"model": "m", "prompt": "hello"}'],
    ids=["gzip-body", "plain-body-labelled-gzip"],
)
async def test_a_compressed_request_body_gets_epps_400_not_a_gateway_500(
    stack: Stack, http: aiohttp.ClientSession, data: bytes
) -> None:
    # the gateway passes the body and its content-encoding through, as Envoy does; epp routes
    # only bodies it can read and says so (it once decoded gzip itself and failed with a 500)
    async with http.post(
        stack.gateway_url + "/v1/completions", data=data,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    ) as r:  # fmt: skip
        assert r.status == 400
        error = json.loads(await r.read())["error"]
    assert error["type"] == "invalid_request_error"
    assert "content-encoding 'gzip'" in error["message"]

SMALL = SharedPrefixWorkload(
    num_groups=6,
    num_prompts_per_group=3,
    system_prompt_len=800,
    question_len=30,
    output_len=4,
    num_turns=3,
    concurrency=6,
    seed=5,
)
"""6 x 800-token system prompts against 3 replicas holding 2,048 tokens each: random routing
cannot keep them all everywhere; epp keeps each on one replica."""


async def test_hit_rate_through_epp_beats_random_routing_by_a_wide_margin(mode: str) -> None:
    base = dataclasses.replace(FAST, kv_blocks=128, request_mode=mode)
    epp = await run_policy(dataclasses.replace(base, policy="epp"), SMALL)
    rnd = await run_policy(dataclasses.replace(base, policy="random"), SMALL)
    assert epp.errors == 0 and rnd.errors == 0
    assert epp.requests == rnd.requests == SMALL.total_requests
    assert epp.hit_rate > 0.6, epp
    assert epp.hit_rate > rnd.hit_rate + 0.25, (epp.hit_rate, rnd.hit_rate)
    if base.gateway == "envoy":  # Envoy's access log timed every request, by its id
        for rec in epp.records + rnd.records:
            assert rec.routed_s is not None and rec.upstream_ttft_s is not None, rec
            assert rec.ttft_s is not None and 0 <= rec.routed_s <= rec.upstream_ttft_s <= rec.ttft_s, rec
    print(f"{mode}: hit rate epp {epp.hit_rate:.1%} vs random {rnd.hit_rate:.1%}")


async def test_precise_mode_feeds_every_epp_replica_with_every_servers_events(
    tmp_path: object,
) -> None:
    """--prefix precise with 2 epp replicas and no sync: the emulated servers publish their
    KV events to both replicas' sockets, so each replica's precise index knows the blocks the
    other one routed; and the same chat routes the same way from either replica."""
    from pathlib import Path

    from epp.plugins.preciseprefix import PrecisePrefixProducer
    from simulator.stack import start_stack
    from tests.wordlevel import write_tokenizer

    tok = write_tokenizer(Path(str(tmp_path)) / "tok")
    options = dataclasses.replace(FAST, replicas=2, prefix="precise", epp_replicas=2, sync=False,
                                  tokenizer=str(tok), model="m")  # fmt: skip
    stack = await start_stack(options)
    try:
        epps = [h for h in stack._inline if hasattr(h, "grpc_port")]
        producers = [h.scheduler.plugin(PrecisePrefixProducer) for h in epps]
        assert len(producers) == 2 and all(p is not None for p in producers)
        servers = set(stack.endpoints())
        for _ in range(200):  # the first scrapes make the endpoints known (200 ms period)
            if all(p._known == servers for p in producers):  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.02)
        system = "the shipping desk is late " * 30
        words = ["hello", "world", "how", "are", "you", "parcel", "order", "late"]
        rng = random.Random(5)
        reps = [r for r in stack._inline if hasattr(r, "emulator")]

        def heard(p: PrecisePrefixProducer) -> set[str]:
            return {eid for (eid, _), n in p.stats.events.items() if n}

        def every_replica_hears_every_publishing_server() -> bool:
            # servers that stored blocks several times (the first batches may be lost while a
            # connection forms; one server may get all the traffic)
            published = {f"127.0.0.1:{r.port}" for r in reps if r.emulator.publisher.seq >= 3}
            return bool(published) and all(published <= heard(p) for p in producers)  # type: ignore[arg-type]

        async with aiohttp.ClientSession() as http:
            for i in range(400):  # the gateway alternates ext_proc streams between replicas
                question = " ".join(rng.choice(words) for _ in range(60))  # new blocks each time
                body = {"model": "m", "max_tokens": 2, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question}]}  # fmt: skip
                status, _, raw = await post(http, stack.gateway_url + "/v1/chat/completions", body)
                assert status == 200, raw
                if i >= 20 and every_replica_hears_every_publishing_server():
                    break
        assert every_replica_hears_every_publishing_server(), (
            [r.emulator.publisher.seq for r in reps], [heard(p) for p in producers])  # type: ignore[arg-type]
    finally:
        await stack.stop()


async def test_the_stack_gives_epp_its_scrape_period() -> None:
    from simulator.stack import start_stack

    stack = await start_stack(dataclasses.replace(FAST, replicas=1, scrape_interval_s=2.5))
    try:
        scrapers = [h._scraper for h in stack._inline if hasattr(h, "grpc_port")]
        assert [s.options.interval_s for s in scrapers] == [2.5]
    finally:
        await stack.stop()
    # without one, epp scrapes at the period its config asks for
    stack = await start_stack(dataclasses.replace(FAST, replicas=1, config="predicted-ttft"))
    try:
        scrapers = [h._scraper for h in stack._inline if hasattr(h, "grpc_port")]
        assert [s.options.interval_s for s in scrapers] == [1.0]
    finally:
        await stack.stop()


async def test_responses_observed_on_a_second_stream_route_learn_and_release(
    http: aiohttp.ClientSession, mode: str
) -> None:
    """--response observer through the gateway (epp serve --response-observer): the routing
    stream skips the response, an observability-mode stream carries it; every request is
    claimed, learnt from (usage) and released, and the streamed answer reaches the client
    intact."""
    from simulator.stack import start_stack

    stack = await start_stack(
        dataclasses.replace(FAST, replicas=2, response_observer=True, request_mode=mode)
    )
    try:
        (epp,) = [h for h in stack._inline if hasattr(h, "grpc_port")]
        body = {"model": model_of(stack), "messages": [{"role": "user", "content": "hi " * 200}],
                "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        destinations = set()
        for _ in range(3):
            status, headers, raw = await post(http, stack.gateway_url + "/v1/chat/completions", body)
            assert status == 200
            events = _sse_events(raw)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
            destinations.add(headers[UPSTREAM_HOST_HEADER])
        assert len(destinations) == 1  # the same prompt stays where its prefix is
        handoff = epp.service.handoff
        async with asyncio.timeout(5):  # the observer streams end just after the replies
            while sum(epp.datastore.in_flight().values()):
                await asyncio.sleep(0.01)
        assert handoff.claimed >= 3 and handoff.unobserved == 0 and handoff.foreign == 0
        usage = epp.registry.get_sample_value(
            "epp_usage_completion_tokens_total", {"model": model_of(stack)})
        assert usage is not None and usage >= 24
    finally:
        await stack.stop()


async def test_observer_streams_on_the_other_replica_report_over_sync(
    http: aiohttp.ClientSession,
) -> None:
    """Two epp replicas: the gateway sends each observer stream to the next ext_proc host,
    i.e. always the replica that did not route; it reports to the router over index sync."""
    from simulator.stack import start_stack

    stack = await start_stack(
        dataclasses.replace(FAST, replicas=2, response_observer=True, epp_replicas=2)
    )
    try:
        epps = [h for h in stack._inline if hasattr(h, "grpc_port")]
        body = {"model": model_of(stack), "messages": [{"role": "user", "content": "ho " * 200}],
                "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        for _ in range(4):
            status, _, raw = await post(http, stack.gateway_url + "/v1/chat/completions", body)
            assert status == 200 and _sse_events(raw)[-1] == "[DONE]"
        async with asyncio.timeout(5):
            while any(sum(e.datastore.in_flight().values()) for e in epps):
                await asyncio.sleep(0.01)
        handoffs = [e.service.handoff for e in epps]
        assert sum(h.forwarded for h in handoffs) >= 4 * 3  # claimed, first bytes, finished
        assert sum(h.remote_applied for h in handoffs) >= 4 * 2
        assert all(h.unobserved == 0 and h.foreign == 0 for h in handoffs)
        learnt = sum(e.registry.get_sample_value("epp_usage_completion_tokens_total",
                                                 {"model": model_of(stack)}) or 0 for e in epps)  # fmt: skip
        assert learnt >= 4 * 8
    finally:
        await stack.stop()


async def test_the_stack_refuses_an_observer_over_replicas_without_sync() -> None:
    from simulator.stack import start_stack

    with pytest.raises(ValueError, match="needs their index sync"):
        await start_stack(
            dataclasses.replace(FAST, response_observer=True, epp_replicas=2, sync=False)
        )


def test_the_demo_runs_observers_over_replicas_with_sync_only() -> None:
    from simulator.stack.demo import variants

    base = dataclasses.replace(FAST, epp_replicas=2)
    assert [o.sync for o in variants(base, ("epp",))] == [True, False]
    observed = variants(dataclasses.replace(base, response_observer=True), ("epp",))
    assert [(o.sync, o.response_observer) for o in observed] == [(True, True)]


async def test_the_stack_serves_lora_adapters_with_the_batch_limit_asked_for(http: aiohttp.ClientSession) -> None:
    """--lora-adapters / --max-loras reach the emulated servers: an adapter's request is
    served through the gateway, and each server reports the limit (vLLM's lora_requests_info)."""
    from simulator.stack import start_stack

    stack = await start_stack(dataclasses.replace(FAST, replicas=2, lora_adapters=("desk-0", "desk-1"), max_loras=1))
    try:
        status, _, body = await post(http, f"{stack.gateway_url}/v1/completions",
                                     {"model": "desk-1", "prompt": "hello there", "max_tokens": 4})  # fmt: skip
        assert status == 200, body
        for url in stack.replica_urls:
            async with http.get(f"{url}/metrics") as r:
                page = await r.text()
            assert 'max_lora="1"' in page
    finally:
        await stack.stop()
