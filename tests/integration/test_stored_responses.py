"""Stored Responses through epp's ext_proc server, driven with the messages Envoy sends: the
response id is learnt from the reply (JSON, or a stream's first event), and follow-ups,
retrieval, cancel and delete reach the endpoint that holds the response, whatever else the
pool is doing; two replicas share what they learn (index sync), and a replica that starts
later fetches it."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest

from epp.framework.endpoint import EndpointId, Metrics
from epp.sync.peers import HostPort
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, inject_metrics, pool, start_epp, stop_epp
from tests.integration.test_response_observer import _synced_pair, observe, settled
from tests.integration.test_sync import connect, connected, sync_options, until

pytestmark = pytest.mark.asyncio


def response_object(rid: str, status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "object": "response", "status": status, "model": "m", "output": [],
            "usage": {"input_tokens": 5, "output_tokens": 1}}  # fmt: skip


def create(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "input": text, **extra}).encode()


async def exchange(
    e: Epp, path: str, body: bytes | None, reply: dict[str, Any] | None = None, *,
    method: str = "POST", status: int = 200,
) -> EndpointId:  # fmt: skip
    """One request through ``e``: routed, then (``reply``) answered with a JSON body.
    Returns where epp sent it."""
    s = ec.Stream(e.channel)
    if body is None:
        await s.send(ec.request_headers(path, method=method, end_of_stream=True))
        (headers,) = await s.recv_n(1)
    else:
        await s.send(ec.request_headers(path, method=method), ec.request_body(body, True))
        headers, _ = await s.recv_n(2)
    dest = ec.destination(headers)
    assert dest is not None
    if reply is not None:
        await s.send(ec.response_headers(status), ec.response_body(json.dumps(reply).encode(), True))
        await s.recv_n(2)
        await s.close()
    else:
        s.call.cancel()
    return EndpointId(dest)


async def create_stored(e: Epp, rid: str, text: str = "hello", **extra: Any) -> EndpointId:
    return await exchange(e, "/v1/responses", create(text, **extra), response_object(rid))


def outcome(e: Epp, name: str) -> float:
    return e.handle.registry.get_sample_value(
        "epp_response_affinity_requests_total", {"outcome": name}
    ) or 0.0


async def test_follow_ups_retrieve_cancel_and_delete_reach_the_home_among_other_traffic() -> None:
    e = await start_epp(pool(4))
    try:
        rid = "resp_" + "1" * 32
        home = await create_stored(e, rid)
        others: list[EndpointId] = []
        for turn in range(8):
            # other traffic between: chats, and new responses, whose picks spread the pool
            for k in range(3):
                others.append(await exchange(e, "/v1/responses", create(f"other {turn} {k}")))
            # the home looks busiest of all: load alone would send the follow-up elsewhere
            inject_metrics(e.handle)
            e.handle.datastore.update_metrics(
                home, Metrics(waiting=30, running=8, kv_usage=0.95, scraped_at_s=time.monotonic())
            )
            follow = create(f"and then {turn}?", previous_response_id=rid)
            assert await exchange(e, "/v1/responses", follow, response_object(f"resp_f{turn}")) == home
        assert len(set(others)) > 1  # the other traffic did spread
        assert await exchange(e, f"/v1/responses/{rid}", None, method="GET") == home
        assert await exchange(e, f"/v1/responses/{rid}/cancel", b"{}") == home  # with a body
        assert await exchange(e, f"/v1/responses/{rid}/cancel", None) == home  # without
        assert await exchange(e, f"/v1/responses/{rid}", None, method="DELETE") == home
        # each follow-up's own response is stored where it was produced: the chain goes on
        assert await exchange(e, "/v1/responses", create("more", previous_response_id="resp_f7")) == home
        assert outcome(e, "home") == 13 and outcome(e, "home_unavailable") == 0
    finally:
        await stop_epp(e)


async def test_a_streamed_response_is_learnt_from_its_first_event() -> None:
    """A background stream can be cancelled while it runs: its id counts from the
    ``response.created`` event, not from the stream's end."""
    e = await start_epp(pool(4))
    try:
        rid = "resp_" + "2" * 32
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers("/v1/responses"),
                     ec.request_body(create("hi", stream=True, background=True), True))  # fmt: skip
        headers, _ = await s.recv_n(2)
        home = ec.destination(headers)
        created = {"type": "response.created", "response": response_object(rid, "queued")}
        await s.send(ec.response_headers(content_type="text/event-stream"),
                     ec.response_body(f"event: response.created\ndata: {json.dumps(created)}\n\n".encode(),
                                      False))  # fmt: skip
        await s.recv_n(2)
        for _ in range(4):  # the stream is still open
            assert await exchange(e, f"/v1/responses/{rid}/cancel", None) == home
        s.call.cancel()
    finally:
        await stop_epp(e)


async def test_store_false_an_error_and_an_unknown_id_teach_nothing() -> None:
    e = await start_epp(pool(4))
    try:
        await create_stored(e, "resp_nostore", store=False)
        await exchange(e, "/v1/responses", create("x"), {"error": {"message": "no"}}, status=400)
        await exchange(e, "/v1/responses", create("y"), response_object("resp_failed"), status=500)
        for rid in ("resp_nostore", "resp_failed", "resp_never_seen"):
            await exchange(e, f"/v1/responses/{rid}", None, method="GET")
        assert outcome(e, "unknown") == 3 and outcome(e, "home") == 0
    finally:
        await stop_epp(e)


async def test_a_home_that_left_the_pool_is_routed_around_and_counted() -> None:
    e = await start_epp(pool(4))
    try:
        rid = "resp_" + "3" * 32
        home = await create_stored(e, rid)
        e.handle.datastore.remove(home)
        dest = await exchange(e, "/v1/responses", create("again", previous_response_id=rid))
        assert dest != home
        assert outcome(e, "home_unavailable") == 1
    finally:
        await stop_epp(e)


async def test_replicas_share_the_homes_and_a_replica_that_starts_later_fetches_them() -> None:
    a = await start_epp(pool(4), sync=sync_options())
    b = await start_epp(pool(4), sync=sync_options())
    c: Epp | None = None
    try:
        connect([a, b])
        await until(lambda: connected(a, [b]) and connected(b, [a]), "peers connected")
        homes = {}
        for i in range(6):
            rid = f"resp_{i:032x}"
            homes[rid] = await create_stored(a if i % 2 else b, rid, f"conversation {i}")
        learned = "epp_response_affinity_learned_total"
        await until(lambda: all(r.handle.registry.get_sample_value(learned, {"source": "peer"}) == 3
                                for r in (a, b)), "each replica learnt the other's three")  # fmt: skip
        for rid, home in homes.items():
            for r in (a, b):
                assert await exchange(r, "/v1/responses", create("next", previous_response_id=rid)) == home
        # a replica that starts later (a rolling update) fetches the table before it serves
        peers = [HostPort("127.0.0.1", a.handle.sync_port)]
        c = await start_epp(pool(4), sync=dataclasses.replace(sync_options(), peers=peers))
        assert c.handle.warm is not None
        for rid, home in homes.items():
            assert await exchange(c, f"/v1/responses/{rid}", None, method="GET") == home
    finally:
        for r in (a, b, c):
            if r is not None:
                await stop_epp(r)


async def test_a_peer_observing_the_response_reports_its_id_to_the_router() -> None:
    """--response-observer: the response reaches another replica's observer stream; the id
    it reads travels back with its report, and the router routes the follow-up home."""
    router, observer = await _synced_pair()
    try:
        rid = "resp_" + "4" * 32
        s = ec.Stream(router.channel)
        await s.send(ec.request_headers("/v1/responses"), ec.request_body(create("hi"), True))
        headers, _ = await s.recv_n(2)
        home = ec.destination(headers)
        token = ec.header_value(headers.request_headers.response.header_mutation, "x-epp-observe")
        assert token and home
        await s.close()
        created = {"type": "response.created", "response": response_object(rid, "in_progress")}
        done = {"type": "response.completed", "response": response_object(rid)}
        await observe(observer, token, (
            f"data: {json.dumps(created)}\n\n".encode(), f"data: {json.dumps(done)}\n\n".encode(),
        ))  # fmt: skip
        await settled(router)
        for _ in range(4):
            assert await exchange(router, f"/v1/responses/{rid}", None, method="GET") == home
    finally:
        for e in (router, observer):
            await stop_epp(e)
