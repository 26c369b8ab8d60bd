"""``--response-observer``: the routing filter's stream routes, a second filter's stream in
Envoy's observability_mode carries the response (send and go). The streams are linked by the
``x-epp-observe`` token epp sets on the request."""

from __future__ import annotations

import json

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, pool, start_epp, stop_epp
from tests.integration.test_sync import connect, connected, sync_options, until

BODY = json.dumps({"model": "m", "prompt": "observe this please " * 40}).encode()
SSE = (
    b'data: {"choices":[{"text":"hel"}]}\n\n',
    b'data: {"choices":[{"text":"lo"}],"usage":{"prompt_tokens":9,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":6}}}\n\ndata: [DONE]\n\n',
)


def outcome(e: Epp, name: str) -> float | None:
    return e.handle.registry.get_sample_value(
        "epp_response_observer_requests_total", {"outcome": name}
    )


def in_flight(e: Epp) -> int:
    return sum(e.handle.datastore.in_flight().values())


def observed(msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    msg.observability_mode = True
    return msg


async def route(e: Epp, extra: dict[str, str] | None = None) -> tuple[str, str]:
    """The routing filter's stream: request headers and body, then it ends (response
    headers SKIP, body NONE). Returns the destination and the token."""
    s = ec.Stream(e.channel)
    await s.send(ec.request_headers(extra=extra), ec.request_body(BODY, True))
    headers, _ = await s.recv_n(2)
    mutation = headers.request_headers.response.header_mutation
    token = ec.header_value(mutation, "x-epp-observe")
    assert token
    assert await s.close() == grpc.StatusCode.OK
    return ec.destination(headers) or "", token


async def observe(e: Epp, token: str, chunks: tuple[bytes, ...] = SSE, complete: bool = True) -> None:
    """The observer filter's stream: everything with observability_mode, no reply read."""
    s = ec.Stream(e.channel)
    msgs = [observed(ec.request_headers(extra={"x-epp-observe": token}, end_of_stream=True,
                                        modes=(ec.NONE, ec.STREAMED)))]  # fmt: skip
    msgs.append(observed(ec.response_headers(content_type="text/event-stream")))
    for i, chunk in enumerate(chunks):
        msgs.append(observed(ec.response_body(chunk, complete and i == len(chunks) - 1)))
    await s.send(*msgs)
    if complete:
        await s.call.done_writing()
        assert await s.call.read() is grpc.aio.EOF  # epp answers nothing in this mode
        assert await s.call.code() == grpc.StatusCode.OK
    else:  # the client goes away mid-response, once epp has the response in hand
        handoff = e.handle.service.handoff
        assert handoff is not None
        await until(lambda: handoff.claimed > 0, "the observer stream claimed the request")
        s.call.cancel()


async def route_and_stay(e: Epp) -> tuple[ec.Stream, str]:
    """A routing stream that stays open (the proxy sends it the response too): the stream
    and its token."""
    s = ec.Stream(e.channel)
    await s.send(ec.request_headers(), ec.request_body(BODY, True))
    headers, _ = await s.recv_n(2)
    token = ec.header_value(headers.request_headers.response.header_mutation, "x-epp-observe")
    assert token
    return s, token


async def settled(e: Epp) -> None:
    await until(lambda: in_flight(e) == 0, "the request released")


async def test_the_observer_stream_carries_the_response_and_releases_the_request() -> None:
    e = await start_epp(response_observer_wait_s=30.0)
    try:
        dest, token = await route(e)
        # the routing stream ended; the request is still in flight, waiting for its response
        assert e.handle.datastore.in_flight()[dest] == 1
        await observe(e, token)
        await settled(e)
        reg = e.handle.registry
        assert reg.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 9
        assert reg.get_sample_value("epp_usage_cached_tokens_total", {"model": "m"}) == 6
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 1
        handoff = e.handle.service.handoff
        assert handoff is not None and handoff.claimed == 1 and len(handoff) == 0
        # the same prompt again goes where the first went (the pick was recorded)
        assert (await route(e))[0] == dest
    finally:
        await stop_epp(e)


async def test_a_client_that_leaves_mid_response_is_released_as_cancelled() -> None:
    e = await start_epp(response_observer_wait_s=30.0)
    try:
        _, token = await route(e)
        await observe(e, token, SSE[:1], complete=False)
        await settled(e)
        reg = e.handle.registry
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) == 1
    finally:
        await stop_epp(e)


async def test_an_unclaimed_request_is_released_as_unobserved_and_a_stale_token_claims_nothing() -> None:
    e = await start_epp(response_observer_wait_s=0.05)
    try:
        _, token = await route(e)
        handoff = e.handle.service.handoff
        assert handoff is not None
        # the housekeeping loop expires it without traffic
        await until(lambda: handoff.unobserved > 0, "the request expired")
        assert in_flight(e) == 0
        await observe(e, token)  # too late: observed, nothing to release, nothing breaks
        assert handoff.claimed == 0 and in_flight(e) == 0 and handoff.foreign == 0
    finally:
        await stop_epp(e)


async def test_a_client_cannot_choose_the_token() -> None:
    e = await start_epp(response_observer_wait_s=30.0)
    try:
        _, token = await route(e, extra={"x-epp-observe": "mine"})
        assert token != "mine"
        await observe(e, "mine")  # names nothing (and is no token of this epp's)
        handoff = e.handle.service.handoff
        assert handoff is not None and handoff.claimed == 0 and in_flight(e) == 1
        assert handoff.foreign == 1
        await observe(e, token)
        await settled(e)
    finally:
        await stop_epp(e)


async def test_a_response_sent_to_the_routing_stream_is_observed_there_once() -> None:
    """A proxy that still sends the response to the routing filter: that stream observes
    it; the observer stream, if any, then finds nothing to claim."""
    e = await start_epp(response_observer_wait_s=30.0)
    try:
        s, token = await route_and_stay(e)
        await s.send(ec.response_headers(content_type="text/event-stream"),
                     ec.response_body(SSE[0] + SSE[1], True))  # fmt: skip
        await s.recv_n(2)
        assert await s.close() == grpc.StatusCode.OK
        await settled(e)
        handoff = e.handle.service.handoff
        assert handoff is not None and len(handoff) == 0
        await observe(e, token)
        assert handoff.claimed == 1  # the routing stream's own claim
        assert e.handle.registry.get_sample_value(
            "epp_requests_total", {"model": "m", "status": "200"}) == 1
    finally:
        await stop_epp(e)


async def test_a_response_sent_to_both_streams_is_observed_by_the_one_that_claimed_it() -> None:
    """The observer stream claimed the request first; the routing stream then gets the same
    response too (a proxy that sends it to both filters): only the claimant observes it, so
    the first-token hooks and the release run once (issue 70, item 3)."""
    e = await start_epp(response_observer_wait_s=30.0)
    director = e.handle.director
    firsts: list[float] = []
    first_token = director.first_token

    def counted(routing: object, ttft_s: float, status: int = 0) -> None:
        firsts.append(ttft_s)
        first_token(routing, ttft_s, status)  # type: ignore[arg-type]

    director.first_token = counted  # type: ignore[method-assign]
    try:
        s, token = await route_and_stay(e)
        o = ec.Stream(e.channel)
        await o.send(
            observed(ec.request_headers(extra={"x-epp-observe": token}, end_of_stream=True,
                                        modes=(ec.NONE, ec.STREAMED))),
            observed(ec.response_headers(content_type="text/event-stream")),
            observed(ec.response_body(SSE[0], False)),
        )  # fmt: skip
        handoff = e.handle.service.handoff
        assert handoff is not None
        await until(lambda: len(firsts) == 1, "the observer stream saw the first bytes")
        await s.send(ec.response_headers(content_type="text/event-stream"),
                     ec.response_body(SSE[0] + SSE[1], True))  # fmt: skip
        await s.recv_n(2)  # the routing stream still forwards the response
        assert await s.close() == grpc.StatusCode.OK
        await o.send(observed(ec.response_body(SSE[1], True)))
        await o.call.done_writing()
        assert await o.call.read() is grpc.aio.EOF
        await settled(e)
        assert len(firsts) == 1 and handoff.claimed == 1
        reg = e.handle.registry
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 1
        assert reg.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 9
    finally:
        await stop_epp(e)


async def test_without_the_flag_no_token_is_set() -> None:
    e = await start_epp()
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(), ec.request_body(BODY, True))
        headers, _ = await s.recv_n(2)
        assert ec.header_value(headers.request_headers.response.header_mutation, "x-epp-observe") is None
        handoff = e.handle.service.handoff
        assert handoff is not None and not handoff.observing and len(handoff) == 0
        s.call.cancel()
    finally:
        await stop_epp(e)


# --- several replicas: the observer stream reaches one that did not route ---------------


async def _synced_pair() -> list[Epp]:
    pair = [await start_epp(pool(4), sync=sync_options(), response_observer_wait_s=30.0)
            for _ in range(2)]  # fmt: skip
    connect(pair)
    await until(lambda: connected(pair[0], pair[1:]) and connected(pair[1], pair[:1]),
                "peers connected")  # fmt: skip
    return pair


async def test_a_peer_observes_what_another_replica_routed_and_reports_it_back() -> None:
    router, observer = await _synced_pair()
    try:
        dest, token = await route(router)
        await observe(observer, token)
        await settled(router)  # released on the router, by the peer's report
        reg = router.handle.registry
        assert reg.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 9
        assert reg.get_sample_value("epp_usage_cached_tokens_total", {"model": "m"}) == 6
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 1
        mine, theirs = router.handle.service.handoff, observer.handle.service.handoff
        assert mine is not None and theirs is not None
        assert mine.claimed == 1 and mine.remote_applied == 2 and len(mine) == 0
        assert theirs.forwarded == 3 and theirs.foreign == 0 and in_flight(observer) == 0
        # the pick was recorded on the router: the same prompt goes there again
        assert (await route(router))[0] == dest
        # the housekeeping loops export the counts
        await until(lambda: outcome(router, "claimed_by_peer") == 1, "the router's count")
        await until(lambda: outcome(observer, "forwarded") == 3, "the observer's count")
    finally:
        for e in (router, observer):
            await stop_epp(e)


async def test_a_peer_that_loses_the_client_mid_response_releases_the_request_as_cancelled() -> None:
    router, observer = await _synced_pair()
    try:
        _, token = await route(router)
        s = ec.Stream(observer.channel)
        await s.send(observed(ec.request_headers(extra={"x-epp-observe": token}, end_of_stream=True,
                                                 modes=(ec.NONE, ec.STREAMED))),
                     observed(ec.response_headers(content_type="text/event-stream")),
                     observed(ec.response_body(SSE[0], False)))  # fmt: skip
        handoff = observer.handle.service.handoff
        assert handoff is not None
        await until(lambda: handoff.forwarded >= 2, "claimed and first bytes forwarded")
        s.call.cancel()
        await settled(router)
        reg = router.handle.registry
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) == 1
    finally:
        for e in (router, observer):
            await stop_epp(e)
