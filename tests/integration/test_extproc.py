"""ext_proc over a real grpc.aio server: every mode and error of `epp serve`, as Envoy drives it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.framework.endpoint import Metrics
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import (
    Epp,
    config_with,
    inject_metrics,
    pool,
    start_epp,
    stop_epp,
)
from tests.integration.test_sync import until

PROMPT = "You are a helpful assistant. Ünïcödé — 日本語のテキスト 🚀 " * 40
BODY = json.dumps({"model": "m", "prompt": PROMPT}, ensure_ascii=False).encode()


@pytest.fixture
async def epp() -> AsyncIterator[Epp]:
    e = await start_epp()
    yield e
    await stop_epp(e)


def streamed(reply: object) -> tuple[bytes, bool]:
    sr = reply.request_body.response.body_mutation.streamed_response  # type: ignore[attr-defined]
    return sr.body, sr.end_of_stream


def assert_routed(reply: object, ids: set[str]) -> str:
    dest = ec.destination(reply)  # type: ignore[arg-type]
    assert dest in ids, dest
    assert ec.lb_metadata(reply) == dest  # type: ignore[arg-type]
    kind = reply.WhichOneof("response")  # type: ignore[attr-defined]
    assert getattr(reply, kind).response.clear_route_cache
    return dest


async def immediate(epp: Epp, *msgs: object) -> tuple[int, dict[str, object]]:
    s = ec.Stream(epp.channel)
    await s.send(*msgs)  # type: ignore[arg-type]
    reply = await s.recv()
    assert reply.WhichOneof("response") == "immediate_response", reply
    ir = reply.immediate_response
    assert ec.header_value(ir.headers, "content-type") == "application/json"
    assert await s.close() == grpc.StatusCode.OK
    return int(ir.status.code), json.loads(ir.body)


async def route_ok(epp: Epp, body: bytes = BODY) -> str:
    """A plain full-duplex request must still be routed (the server keeps serving)."""
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), ec.request_body(body, True))
    headers, _ = await s.recv_n(2)
    s.call.cancel()
    return assert_routed(headers, {e.id for e in epp.handle.datastore.snapshot()})


# --- FULL_DUPLEX_STREAMED ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1000, len(BODY)])
async def test_full_duplex_body_in_chunks_routes_and_forwards_body(epp: Epp, chunk: int) -> None:
    # chunk sizes 1/3/7 split the multi-byte UTF-8 characters of the prompt across messages
    ids = {e.id for e in epp.handle.datastore.snapshot()}
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), *ec.body_messages(BODY, chunk))
    headers, body = await s.recv_n(2)
    assert headers.WhichOneof("response") == "request_headers"
    dest = assert_routed(headers, ids)
    assert ec.header_value(headers.request_headers.response.header_mutation, "content-length") == str(len(BODY))
    assert streamed(body) == (BODY, True)
    assert epp.handle.datastore.in_flight()[dest] == 1
    await s.send(ec.response_headers(), ec.response_body(b'{"choices":[]}', True))
    rh, rb = await s.recv_n(2)
    assert rh.WhichOneof("response") == "response_headers"
    assert rb.response_body.response.body_mutation.streamed_response.end_of_stream
    assert await s.close() == grpc.StatusCode.OK
    assert epp.handle.datastore.in_flight()[dest] == 0


async def test_pick_is_recorded_in_the_index_after_the_reply_is_sent(epp: Epp) -> None:
    index = epp.handle.index
    assert len(index) == 0
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), ec.request_body(BODY, True))
    headers, _ = await s.recv_n(2)
    dest = assert_routed(headers, {e.id for e in epp.handle.datastore.snapshot()})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while not index.chunks_of(dest) and loop.time() < deadline:
        await asyncio.sleep(0)  # yield to the server task; no fixed delay
    assert len(index.chunks_of(dest)) > 0 and index.endpoint_ids() == [dest]
    s.call.cancel()


async def test_same_prompt_goes_to_same_endpoint(epp: Epp) -> None:
    first = await route_ok(epp)
    assert all([await route_ok(epp) == first for _ in range(5)])


async def test_request_trailers_end_the_body(epp: Epp) -> None:
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), ec.request_body(BODY[:100], False), ec.request_body(BODY[100:], False), ec.request_trailers())
    headers, body, trailers = await s.recv_n(3)
    assert_routed(headers, {e.id for e in epp.handle.datastore.snapshot()})
    assert streamed(body) == (BODY, False)  # trailers follow: not end of stream
    assert trailers.WhichOneof("response") == "request_trailers"
    s.call.cancel()


async def test_fallbacks_listed_in_header_and_metadata() -> None:
    e = await start_epp(fallbacks=2)
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(), ec.request_body(BODY, True))
        headers, _ = await s.recv_n(2)
        dest = ec.destination(headers)
        assert dest is not None and len(set(dest.split(","))) == 3
        assert ec.lb_metadata(headers) == dest
        s.call.cancel()
    finally:
        await stop_epp(e)


# --- BUFFERED ---------------------------------------------------------------------------


async def test_buffered_routes_in_body_reply(epp: Epp) -> None:
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(modes=(ec.BUFFERED, ec.BUFFERED)))
    first = await s.recv()
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers  # CONTINUE, no route yet
    await s.send(ec.request_body(BODY, True))
    reply = await s.recv()
    assert reply.WhichOneof("response") == "request_body"
    assert_routed(reply, {e.id for e in epp.handle.datastore.snapshot()})
    assert not reply.request_body.response.HasField("body_mutation")  # body unchanged
    await s.send(ec.response_headers(), ec.response_body(b'{"usage":{"prompt_tokens":3}}', True))
    _, rb = await s.recv_n(2)
    assert rb.WhichOneof("response") == "response_body"
    assert not rb.response_body.response.HasField("body_mutation")
    assert await s.close() == grpc.StatusCode.OK


async def test_a_proxy_that_sends_no_response_ends_requests_as_routed_not_cancelled() -> None:
    """Envoy's ``--response none``: response headers SKIP, body NONE. The stream ends after
    the routing reply; that is the documented mode, not a client cancel (issue 70, item 4)."""
    from epp.framework.types import ResponseInfo
    from epp.scheduling.scheduler import Scheduler

    e = await start_epp()
    heard: list[int] = []
    sched: Scheduler = e.handle.scheduler
    on_response = sched.on_response

    def told(result: object, info: ResponseInfo) -> None:
        heard.append(info.status)
        on_response(result, info)  # type: ignore[arg-type]

    sched.on_response = told  # type: ignore[method-assign]
    try:
        for _ in range(3):
            s = ec.Stream(e.channel)
            await s.send(ec.request_headers(modes=(ec.BUFFERED, ec.NONE)))
            await s.recv()
            await s.send(ec.request_body(BODY, True))
            assert ec.destination(await s.recv())
            assert await s.close() == grpc.StatusCode.OK
        reg = e.handle.registry
        await until(lambda: sum(e.handle.datastore.in_flight().values()) == 0, "released")
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "routed"}) == 3
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) is None
        assert heard == [0, 0, 0]  # the post-response hooks hear "unknown", not 499
    finally:
        await stop_epp(e)


async def test_flag_mode_used_when_envoy_sends_no_protocol_config() -> None:
    from epp.extproc import convert

    e = await start_epp(processing_mode=convert.BUFFERED)
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(modes=None))
        assert (await s.recv()).WhichOneof("response") == "request_headers"
        await s.send(ec.request_body(BODY, True))
        assert (await s.recv()).WhichOneof("response") == "request_body"
        s.call.cancel()
    finally:
        await stop_epp(e)


async def test_buffered_model_rewrite_header_replaces_body_and_maps_response_back() -> None:
    epp = await start_epp(trust_control_headers=True)
    try:
        await _rewrite_header_roundtrip(epp)
    finally:
        await stop_epp(epp)


async def _rewrite_header_roundtrip(epp: Epp) -> None:
    s = ec.Stream(epp.channel)
    await s.send(
        ec.request_headers(modes=(ec.BUFFERED, ec.BUFFERED), extra={"x-gateway-model-name-rewrite": "served-v2"}),
        ec.request_body(BODY, True),
    )
    await s.recv()
    reply = await s.recv()
    common = reply.request_body.response
    new_body = common.body_mutation.body
    assert json.loads(new_body)["model"] == "served-v2"
    assert json.loads(new_body)["prompt"] == PROMPT
    assert ec.header_value(common.header_mutation, "content-length") == str(len(new_body))
    answer = json.dumps({"model": "served-v2", "choices": [{"text": "hi"}]}).encode()
    await s.send(ec.response_headers(), ec.response_body(answer, True))
    _, rb = await s.recv_n(2)
    out = rb.response_body.response.body_mutation.body
    assert json.loads(out)["model"] == "m"
    assert ec.header_value(rb.response_body.response.header_mutation, "content-length") == str(len(out))
    s.call.cancel()


async def test_rewrite_table_full_duplex_sse_maps_model_back_and_reads_usage() -> None:
    cfg = config_with({"requestControl": {"modelRewrites": {"m": "served"}}})
    e = await start_epp(config=cfg)
    try:
        s = ec.Stream(e.channel)
        chat = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "héllo"}]}).encode()
        await s.send(ec.request_headers("/v1/chat/completions"), *ec.body_messages(chat, 5))
        _, body = await s.recv_n(2)
        assert json.loads(streamed(body)[0])["model"] == "served"
        events = [
            {"model": "served", "choices": [{"delta": {"content": "Bon"}}]},
            {"model": "served", "choices": [{"delta": {"content": "jour"}}]},
            {"model": "served", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2,
                                                      "prompt_tokens_details": {"cached_tokens": 8}}},
        ]
        sse = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events) + b"data: [DONE]\n\n"
        await s.send(ec.response_headers(content_type="text/event-stream"))
        assert (await s.recv()).WhichOneof("response") == "response_headers"
        parts = ec.chunks(sse, 17)
        out = b""
        for i, p in enumerate(parts):
            await s.send(ec.response_body(p, i == len(parts) - 1))
        while True:
            r = await s.recv()
            sr = r.response_body.response.body_mutation.streamed_response
            out += sr.body
            if sr.end_of_stream:
                break
        assert out == sse.replace(b'"model": "served"', b'"model": "m"')
        assert await s.close() == grpc.StatusCode.OK
        reg = e.handle.registry
        assert reg.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 11
        assert reg.get_sample_value("epp_usage_cached_tokens_total", {"model": "m"}) == 8
        assert reg.get_sample_value("epp_usage_completion_tokens_total", {"model": "m"}) == 2
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 1
    finally:
        await stop_epp(e)


async def test_sse_passthrough_without_rewrite_and_response_trailers(epp: Epp) -> None:
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), ec.request_body(BODY, True))
    await s.recv_n(2)
    sse = b'data: {"choices":[{"text":"x"}],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\n'
    await s.send(ec.response_headers(content_type="text/event-stream"), ec.response_body(sse[:10], False), ec.response_body(sse[10:], False), ec.response_trailers())
    replies = await s.recv_n(4)
    got = b"".join(r.response_body.response.body_mutation.streamed_response.body for r in replies[1:3])
    assert got == sse
    assert replies[3].WhichOneof("response") == "response_trailers"
    assert await s.close() == grpc.StatusCode.OK
    assert epp.handle.registry.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 4
    assert sum(epp.handle.datastore.in_flight().values()) == 0


# --- header-only, subset hint -----------------------------------------------------------


async def test_header_only_request_routed_by_load(epp: Epp) -> None:
    busy = {e.id for e in epp.handle.datastore.snapshot()[:3]}
    for e in epp.handle.datastore.snapshot():
        epp.handle.datastore.update_metrics(
            e.id, Metrics(waiting=50 if e.id in busy else 0, kv_usage=0.1, scraped_at_s=asyncio.get_running_loop().time())
        )
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers("/v1/models", method="GET", end_of_stream=True))
    reply = await s.recv()
    assert reply.WhichOneof("response") == "request_headers"
    dest = assert_routed(reply, {e.id for e in epp.handle.datastore.snapshot()})
    assert dest not in busy
    await s.send(ec.response_headers(end_of_stream=True))
    await s.recv()
    assert await s.close() == grpc.StatusCode.OK
    assert sum(epp.handle.datastore.in_flight().values()) == 0


async def test_post_without_a_body_to_an_inference_api_is_400(epp: Epp) -> None:
    status, body = await immediate(
        epp, ec.request_headers("/v1/chat/completions", end_of_stream=True)
    )
    assert status == 400 and "request body is empty" in str(body)
    assert await route_ok(epp)  # and the server keeps serving


async def test_subset_hint_limits_candidates(epp: Epp) -> None:
    allowed = [epp.handle.datastore.snapshot()[2].id]
    for _ in range(3):
        s = ec.Stream(epp.channel)
        await s.send(ec.request_headers(subset=allowed), ec.request_body(BODY, True))
        headers, _ = await s.recv_n(2)
        assert ec.destination(headers) == allowed[0]
        s.call.cancel()


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:8000"]])
async def test_empty_or_foreign_subset_hint_is_503(epp: Epp, subset: list[str]) -> None:
    status, body = await immediate(epp, ec.request_headers(subset=subset), ec.request_body(BODY, True))
    assert status == 503
    assert "subset" in body["error"]["message"]  # type: ignore[index]
    await route_ok(epp)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": ', 400, "not valid JSON"),
        ("/v1/completions", b'["not", "an", "object"]', 400, "JSON object"),
        ("/v1/completions", b'{"prompt": "hi"}', 400, "'model'"),
        ("/v1/completions", b'{"model": "m"}', 400, "'prompt'"),
        ("/v1/chat/completions", b'{"model": "m"}', 400, "'messages'"),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', 400, "messages"),
        ("/v1/completions", b'{"model": "m", "prompt": "caf\xc3"}', 400, "UTF-8"),
        ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}', 400, "UTF-8"),
        ("/v2/unknown", b'{"model": "m", "prompt": "x"}', 404, "unknown API path"),
    ],
)
async def test_errors_answer_immediately_and_server_keeps_serving(
    epp: Epp, path: str, body: bytes, status: int, words: str
) -> None:
    got, payload = await immediate(epp, ec.request_headers(path), *ec.body_messages(body, 4))
    assert got == status
    err = payload["error"]
    assert words in err["message"] and err["code"] == status  # type: ignore[index]
    assert "caf" not in err["message"]  # never echoes prompt text  # type: ignore[index]
    await route_ok(epp)


async def test_buffered_error_in_body_reply(epp: Epp) -> None:
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(modes=(ec.BUFFERED, ec.BUFFERED)))
    await s.recv()
    await s.send(ec.request_body(b"{oops", True))
    reply = await s.recv()
    assert reply.immediate_response.status.code == 400
    assert await s.close() == grpc.StatusCode.OK


async def test_body_over_cap_is_413() -> None:
    e = await start_epp(max_body_bytes=1000)
    try:
        # announced by content-length: answered at the headers
        status, _ = await immediate(e, ec.request_headers(content_length=5000))
        assert status == 413
        # no content-length (chunked): answered once the chunks pass the cap
        status, body = await immediate(e, ec.request_headers(), *ec.body_messages(BODY, 300))
        assert status == 413 and "1000" in body["error"]["message"]  # type: ignore[index]
        await route_ok(e, json.dumps({"model": "m", "prompt": "short"}).encode())
    finally:
        await stop_epp(e)


async def test_no_endpoint_is_503() -> None:
    e = await start_epp(endpoints=[])
    try:
        status, _ = await immediate(e, ec.request_headers(), ec.request_body(BODY, True))
        assert status == 503
        status, _ = await immediate(e, ec.request_headers("/v1/models", method="GET", end_of_stream=True))
        assert status == 503
    finally:
        await stop_epp(e)


async def test_sheddable_request_is_429_when_pool_saturated(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="epp.extproc.stream")
    cfg = config_with({"requestControl": {"objectives": {"batch": -1, "premium": 5}}})
    e = await start_epp(config=cfg, trust_control_headers=True)
    try:
        inject_metrics(e.handle, waiting=50, kv=0.95)
        shed = ec.request_headers(extra={"x-gateway-inference-objective": "batch"})
        status, body = await immediate(e, shed, ec.request_body(BODY, True))
        assert status == 429 and "shed" in body["error"]["message"]  # type: ignore[index]
        # shed after parsing: the log line and the counters name the body's model (QA3 #13)
        assert any("request answered by epp: status=429" in r.getMessage() and "model='m' " in r.getMessage()
                   for r in caplog.records)  # fmt: skip
        # the same pool still takes a request that is not sheddable
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(extra={"x-gateway-inference-objective": "premium"}), ec.request_body(BODY, True))
        assert ec.destination((await s.recv_n(2))[0]) is not None
        s.call.cancel()
        # and once the pool has room, the sheddable one goes through too
        inject_metrics(e.handle, waiting=0, kv=0.1)
        s = ec.Stream(e.channel)
        await s.send(shed, ec.request_body(BODY, True))
        assert ec.destination((await s.recv_n(2))[0]) is not None
        s.call.cancel()
        assert e.handle.registry.get_sample_value("epp_requests_total", {"model": "m", "status": "429"}) == 1
        answered = {"status": "429", "reason": "shed"}  # its error.reason (serve.md's shedding table)
        assert e.handle.registry.get_sample_value("epp_answered_requests_total", answered) == 1
    finally:
        await stop_epp(e)


async def test_unsupported_body_mode_is_500_with_reason(epp: Epp) -> None:
    status, body = await immediate(epp, ec.request_headers(modes=(ec.STREAMED, ec.STREAMED)))
    assert status == 500 and "FULL_DUPLEX_STREAMED" in body["error"]["message"]  # type: ignore[index]


# --- cancel ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["mid-body", "after-route", "mid-response"])
async def test_client_cancel_leaves_no_state(stage: str) -> None:
    from epp.config.loader import load_config
    from epp.plugins.ttft import PredictedTtftScorer

    e = await start_epp(config=load_config("predicted-ttft"))  # a plugin that counts in flight
    scorer = e.handle.scheduler.plugin(PredictedTtftScorer)
    assert scorer is not None
    closed = asyncio.Event()
    d = e.handle.director
    orig_abandon = d.abandon

    def abandon(routing, status):  # type: ignore[no-untyped-def]
        orig_abandon(routing, status)
        closed.set()

    d.abandon = abandon  # type: ignore[method-assign]
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(), ec.request_body(BODY[:50], False))
        if stage != "mid-body":
            await s.send(ec.request_body(BODY[50:], True))
            await s.recv_n(2)
            assert sum(e.handle.datastore.in_flight().values()) == 1
        if stage == "mid-response":
            await s.send(ec.response_headers(content_type="text/event-stream"), ec.response_body(b"data: {}\n", False))
            await s.recv_n(2)
        s.call.cancel()
        if stage != "mid-body":
            await asyncio.wait_for(closed.wait(), 5)
            assert e.handle.registry.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) == 1
        assert sum(e.handle.datastore.in_flight().values()) == 0
        assert not e.handle.datastore.prefill  # the cancel released its prefill
        await route_ok(e)
    finally:
        await stop_epp(e)


# --- health and lifecycle ----------------------------------------------------------------


async def test_health_serving_then_not_serving_on_stop() -> None:
    e = await start_epp()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{e.handle.health_port}")
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await e.handle.health.enter_graceful_shutdown()
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await ch.close()
        await stop_epp(e)


@pytest.mark.parametrize("port", ["grpc_port", "health_port"])
async def test_readiness_not_serving_until_endpoints_known_liveness_serving_throughout(
    port: str,
) -> None:
    """The Inference Extension's endpoint-picker protocol names health services ``liveness``
    and ``readiness``; ``""`` follows readiness (Envoy's ext_proc cluster checks it)."""
    e = await start_epp(endpoints=[])
    e.handle.datastore.synced = False
    await e.handle.update_health()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{getattr(e.handle, port)}")
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip

    async def status(service: str) -> int:
        return int((await stub.Check(health_pb2.HealthCheckRequest(service=service))).status)

    try:
        stub = health_pb2_grpc.HealthStub(ch)
        assert [await status(s) for s in ("liveness", "readiness", "")] == [
            serving, not_serving, not_serving]  # fmt: skip
        e.handle.datastore.replace_all(pool(2))
        await e.handle.update_health()
        assert [await status(s) for s in ("liveness", "readiness", "")] == [serving] * 3
    finally:
        await ch.close()
        await stop_epp(e)


async def test_stop_lets_open_stream_finish() -> None:
    e = await start_epp()
    s = ec.Stream(e.channel)
    await s.send(ec.request_headers(), ec.request_body(BODY, True))
    await s.recv_n(2)
    stopping = asyncio.create_task(e.handle.stop(10))
    await s.send(ec.response_headers(), ec.response_body(b"{}", True))
    assert len(await s.recv_n(2)) == 2
    assert await s.close() == grpc.StatusCode.OK
    await stopping
    await e.channel.close()


async def test_the_first_response_bytes_reach_the_scorers_before_the_response_ends() -> None:
    from epp.config.loader import load_config
    from epp.plugins.ttft import PredictedTtftScorer

    e = await start_epp(config=load_config("predicted-ttft"))
    try:
        scorer = e.handle.scheduler.plugin(PredictedTtftScorer)
        assert scorer is not None
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(), ec.request_body(BODY, True))
        headers, _ = await s.recv_n(2)
        target = assert_routed(headers, {x.id for x in e.handle.datastore.snapshot()})
        prefill = e.handle.datastore.prefill  # the one accounting the scorer reads
        assert prefill.get(target) > 0  # prefill sent, no first token yet
        await s.send(ec.response_headers())
        await s.recv()
        await s.send(ec.response_body(b'{"choices": [{"text": "o', False))
        await s.recv()
        assert target not in prefill and scorer.errors.count == 1
        await s.send(ec.response_body(b'k"}]}', True))
        await s.recv()
        assert await s.close() == grpc.StatusCode.OK
        assert scorer.errors.count == 1
    finally:
        await stop_epp(e)
