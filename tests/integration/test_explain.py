"""Why that endpoint, over epp's real gRPC server: the request id (made up when missing, sent
to the model server and echoed to the client), the one-line pick reason on request, and the
fail-open marker epp removes from what it routed."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc

from epp.framework.endpoint import Metrics
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, config_with, start_epp, stop_epp

BODY = json.dumps({"model": "m", "prompt": "hello " * 200}).encode()


async def exchange(epp: Epp, headers: dict[str, str] | None = None, drop_id: bool = False) -> tuple[Any, Any]:
    msg = ec.request_headers(extra=headers)
    if drop_id:
        kept = [h for h in msg.request_headers.headers.headers if h.key != "x-request-id"]
        del msg.request_headers.headers.headers[:]
        msg.request_headers.headers.headers.extend(kept)
    s = ec.Stream(epp.channel)
    await s.send(msg, ec.request_body(BODY, True))
    routing, _ = await s.recv_n(2)
    await s.send(ec.response_headers(), ec.response_body(b'{"choices":[]}', True))
    reply, _ = await s.recv_n(2)
    assert await s.close() == grpc.StatusCode.OK
    return routing, reply


def set_on(reply: Any, key: str) -> str | None:
    return ec.header_value(reply.response_headers.response.header_mutation, key)


async def test_a_request_id_is_made_up_when_missing_sent_upstream_and_echoed() -> None:
    epp = await start_epp()
    try:
        routing, reply = await exchange(epp, drop_id=True)
        _, given = await exchange(epp, {"x-request-id": "client-42"})
    finally:
        await stop_epp(epp)
    made = ec.header_value(routing.request_headers.response.header_mutation, "x-request-id")
    assert made is not None and re.fullmatch(r"[0-9a-f-]{36}", made)
    assert set_on(reply, "x-request-id") == made
    assert set_on(given, "x-request-id") == "client-42"


async def test_the_pick_reason_names_winner_runner_up_and_what_separated_them() -> None:
    epp = await start_epp(config=config_with({"requestControl": {"pickReasonHeader": True}}))
    try:
        now = epp.handle.datastore.snapshot()
        for i, e in enumerate(now):  # one idle endpoint, the others busy
            epp.handle.datastore.update_metrics(e.id, Metrics(waiting=0 if i == 2 else 9, running=1,
                                                              kv_usage=0.1, scraped_at_s=1e9))  # fmt: skip
        routing, reply = await exchange(epp)
    finally:
        await stop_epp(epp)
    target = ec.destination(routing)
    reason = set_on(reply, "x-epp-pick-reason")
    assert reason is not None and reason.startswith(f"{target} over ")
    assert "profile default" in reason and "queue-scorer 1.00 vs" in reason
    assert "\n" not in reason and "hello" not in reason


async def test_a_trusted_request_may_ask_for_the_reason_an_untrusted_one_may_not() -> None:
    for trusted in (True, False):
        epp = await start_epp(trust_control_headers=trusted)
        try:
            routing, reply = await exchange(epp, {"x-epp-explain": "1"})
        finally:
            await stop_epp(epp)
        assert (set_on(reply, "x-epp-pick-reason") is not None) == trusted
        removed = list(routing.request_headers.response.header_mutation.remove_headers)
        assert ("x-epp-explain" in removed) == (not trusted)
    epp = await start_epp()
    try:
        _, plain = await exchange(epp)
    finally:
        await stop_epp(epp)
    assert set_on(plain, "x-epp-pick-reason") is None  # off by default


async def test_epp_removes_the_fail_open_marker_from_what_it_routed() -> None:
    epp = await start_epp()
    try:
        _, reply = await exchange(epp)
    finally:
        await stop_epp(epp)
    assert "x-epp-fail-open" in reply.response_headers.response.header_mutation.remove_headers
