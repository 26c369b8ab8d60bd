"""Flow control through ext_proc: a queued request holds its stream without blocking the
event loop, is released when capacity frees up, leaves the queue when its client goes away,
times out with a clear 429 (the pool is busy, not down), and is answered at shutdown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest

from epp.config.loader import default_config
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, config_with, pool, start_epp, stop_epp

pytestmark = pytest.mark.asyncio


def body(n: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"request {n} " * 20}).encode()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.005)  # polling state another task changes


async def start(**flow: object) -> Epp:
    raw = dict(default_config().raw)
    raw["flowControl"] = {"enabled": True, "saturation": "concurrency", "maxConcurrency": 1,
                          "dispatchIntervalSeconds": 0.01, **flow}  # fmt: skip
    return await start_epp(pool(1), config=config_with(raw))


@pytest.fixture
async def epp() -> AsyncIterator[Epp]:
    e = await start(maxQueueSeconds=30)
    yield e
    await stop_epp(e)


async def open_request(epp: Epp, n: int, tenant: str = "t1",
                       header: str = "x-gateway-inference-fairness-id") -> ec.Stream:
    """``header``: the Inference Extension's name (an alias) or llm-d's."""
    s = ec.Stream(epp.channel)
    headers = ec.request_headers(extra={header: tenant})
    await s.send(headers, ec.request_body(body(n), True))
    return s


async def test_a_queued_request_waits_for_room_then_routes(epp: Epp) -> None:
    flow = epp.handle.director.flow
    assert flow is not None
    first = await open_request(epp, 1)
    reply = (await first.recv_n(2))[0]
    assert ec.destination(reply) == "10.0.0.1:8000"  # the one slot
    second = await open_request(epp, 2)
    await until(lambda: flow.count == 1)  # queued: no reply, the loop keeps serving
    third = await open_request(epp, 3, tenant="t2", header="x-llm-d-inference-fairness-id")
    await until(lambda: flow.count == 2)
    assert sorted(k[0] for k in flow.queued_by()) == ["t1", "t2"]  # two flows, one per name
    first.call.cancel()  # the first request ends: its slot goes to the queue's head
    reply2 = (await second.recv_n(2))[0]
    assert ec.destination(reply2) == "10.0.0.1:8000"
    assert flow.count == 1
    second.call.cancel()
    reply3 = (await third.recv_n(2))[0]
    assert ec.destination(reply3) == "10.0.0.1:8000"
    third.call.cancel()
    sample = epp.handle.registry.get_sample_value
    assert sample("inference_extension_flow_control_request_queue_duration_seconds_count",
                  {"fairness_id": "t2", "priority": "0", "outcome": "dispatched",
                   "inference_pool": "static", "model_name": "m", "target_model_name": "m"}) == 1  # fmt: skip


async def test_a_client_that_leaves_leaves_the_queue(epp: Epp) -> None:
    flow = epp.handle.director.flow
    assert flow is not None
    first = await open_request(epp, 1)
    await first.recv_n(2)
    waiting = await open_request(epp, 2)
    await until(lambda: flow.count == 1)
    waiting.call.cancel()
    await until(lambda: flow.count == 0)
    assert flow.stats.rejected == {"cancelled": 1} and flow.reserved == 0
    first.call.cancel()


async def test_a_request_that_waits_too_long_gets_a_429_naming_the_reason() -> None:
    epp = await start(maxQueueSeconds=0.1)
    try:
        first = await open_request(epp, 1)
        await first.recv_n(2)
        late = await open_request(epp, 2)
        reply = await late.recv()
        assert reply.immediate_response.status.code == 429  # busy, retry with back-off
        error = json.loads(reply.immediate_response.body)["error"]
        assert error["reason"] == "queue-timeout" and "flow control" in error["message"]
        assert ec.header_value(reply.immediate_response.headers, "x-llm-d-request-dropped-reason") == "rejected-ttl-expired"
        first.call.cancel()
    finally:
        await stop_epp(epp)


async def test_a_full_queue_answers_429_and_shutdown_answers_the_queue() -> None:
    epp = await start(maxRequests=1, displacement=False)
    first = await open_request(epp, 1)
    await first.recv_n(2)
    queued = await open_request(epp, 2)
    flow = epp.handle.director.flow
    assert flow is not None
    await until(lambda: flow.count == 1)
    full = await open_request(epp, 3)
    reply = await full.recv()
    assert reply.immediate_response.status.code == 429
    assert json.loads(reply.immediate_response.body)["error"]["reason"] == "queue-full"
    # llm-d's header and value for it
    assert ec.header_value(reply.immediate_response.headers, "x-llm-d-request-dropped-reason") == "rejected-saturated"
    first.call.cancel()  # so that the server's grace period covers only the queued one
    await until(lambda: flow.reserved == 0 and flow.count <= 1)
    if flow.count == 0:  # the slot freed and the queued request was routed: queue another
        queued = await open_request(epp, 4)
        await until(lambda: flow.count == 1)
    stopping = asyncio.create_task(epp.handle.stop(2.0))  # SIGTERM's path
    reply = await queued.recv()
    assert reply.immediate_response.status.code == 503
    assert json.loads(reply.immediate_response.body)["error"]["reason"] == "shutting-down"
    await stopping
    await epp.channel.close()


@pytest.mark.parametrize(
    "deadline",
    ["²", "1" * 400, "9" * 5000, "-5", "", "12ms", "\uff11\uff12"],  # superscript, huge, sign, fullwidth
    ids=["superscript", "400-digits", "5000-digits", "negative", "empty", "unit", "fullwidth"],
)
async def test_a_bad_deadline_header_gets_400_and_the_stream_keeps_serving(
    epp: Epp, deadline: str
) -> None:
    """The client's ``x-gateway-request-deadline-ms`` is read only with flow control on; a
    value that is no count of milliseconds is the client's error (400, header named), never an
    exception that ends the ext_proc stream (Envoy's fail-open would then pass the request
    through unrouted)."""
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(extra={"x-gateway-request-deadline-ms": deadline}),
                 ec.request_body(body(1), True))  # fmt: skip
    reply = await s.recv()
    assert reply.immediate_response.status.code == 400
    error = json.loads(reply.immediate_response.body)["error"]
    assert "x-gateway-request-deadline-ms" in error["message"]
    s.call.cancel()
    ok = ec.Stream(epp.channel)  # the server still routes the next request
    await ok.send(ec.request_headers(extra={"x-gateway-request-deadline-ms": "30000"}),
                  ec.request_body(body(2), True))  # fmt: skip
    assert ec.destination((await ok.recv_n(2))[0]) == "10.0.0.1:8000"
    ok.call.cancel()


async def test_a_fault_in_admission_answers_500_and_is_counted(
    epp: Epp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception that is no domain error, raised while a request is admitted, becomes a
    500 answer on its stream and a count in ``epp_internal_errors_total``."""
    admission = epp.handle.director.admission
    assert admission is not None

    def broken(*_args: object) -> None:
        raise OverflowError("a bug")

    monkeypatch.setattr(admission, "enter", broken)  # what the Director calls first
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(), ec.request_body(body(1), True))
    reply = await s.recv()
    assert reply.immediate_response.status.code == 500
    assert epp.handle.registry.get_sample_value(
        "epp_internal_errors_total", {"stage": "admission"}) == 1  # fmt: skip
    s.call.cancel()


async def start_banded(**flow: object) -> Epp:
    raw = dict(default_config().raw)
    raw["flowControl"] = {"enabled": True, "saturation": "concurrency", "maxConcurrency": 1,
                          "dispatchIntervalSeconds": 0.01, "maxQueueSeconds": 30, **flow}  # fmt: skip
    raw["requestControl"] = {"objectives": {"critical": 100, "sheddable": -10}}
    return await start_epp(pool(1), config=config_with(raw), trust_control_headers=True)


async def open_objective(epp: Epp, n: int, objective: str) -> ec.Stream:
    s = ec.Stream(epp.channel)
    headers = ec.request_headers(extra={"x-llm-d-inference-objective": objective})
    await s.send(headers, ec.request_body(body(n), True))
    return s


@pytest.mark.parametrize("limits", [{"bandMaxQueueSeconds": {-10: 0.3, 100: 30}},
                                    {"objectiveMaxQueueSeconds": {"sheddable": 0.3}}],
                         ids=["per-band", "per-objective"])  # fmt: skip
async def test_a_sheddable_request_leaves_at_its_limit_and_a_critical_one_is_served(
    limits: dict[str, object],
) -> None:
    epp = await start_banded(**limits)
    try:
        flow = epp.handle.director.flow
        assert flow is not None
        busy = await open_request(epp, 0)
        await busy.recv_n(2)  # the pool's one slot
        sheddable = await open_objective(epp, 1, "sheddable")
        critical = await open_objective(epp, 2, "critical")
        await until(lambda: flow.count == 2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        shed = await sheddable.recv()
        waited = loop.time() - started
        assert shed.immediate_response.status.code == 429
        assert json.loads(shed.immediate_response.body)["error"]["reason"] == "queue-timeout"
        assert waited < 5.0 and flow.count == 1  # left at its 0.3 s, not at maxQueueSeconds
        busy.call.cancel()  # the slot frees: the critical request, still queued, is served
        served = (await critical.recv_n(2))[0]
        assert ec.destination(served) == "10.0.0.1:8000"
        critical.call.cancel()
    finally:
        await stop_epp(epp)


async def test_with_no_ready_endpoint_requests_wait_and_the_first_ready_endpoint_gets_them() -> None:
    """Scale from zero at the ext_proc level (the pool starts empty; Envoy-level in
    tests/envoy/test_cluster_settings.py)."""
    raw = dict(default_config().raw)
    raw["flowControl"] = {"enabled": True, "saturation": "concurrency", "maxConcurrency": 100,
                          "dispatchIntervalSeconds": 0.01, "scaleFromZeroMaxRequests": 5}  # fmt: skip
    epp = await start_epp([], config=config_with(raw))
    try:
        flow = epp.handle.director.flow
        assert flow is not None
        waiting = [await open_request(epp, i) for i in range(5)]
        await until(lambda: flow.count == 5)
        gauge = epp.handle.registry.get_sample_value
        assert gauge("epp_pool_waiting_requests", {"inference_pool": "static"}) == 5
        overflow = await open_request(epp, 99)
        reply = await overflow.recv()
        assert reply.immediate_response.status.code == 503
        assert ec.header_value(reply.immediate_response.headers,
                               "x-llm-d-request-dropped-reason") == "rejected-no-endpoints"  # fmt: skip
        epp.handle.datastore.replace_all(pool(1))  # the first endpoint is ready
        for s in waiting:
            assert ec.destination((await s.recv_n(2))[0]) == "10.0.0.1:8000"
            s.call.cancel()
        assert gauge("epp_pool_waiting_requests", {"inference_pool": "static"}) == 0
    finally:
        await stop_epp(epp)


async def test_a_request_that_waits_out_a_pool_with_no_ready_endpoint_gets_503() -> None:
    raw = dict(default_config().raw)
    raw["flowControl"] = {"enabled": True, "dispatchIntervalSeconds": 0.01,
                          "scaleFromZeroSeconds": 0.2, "maxQueueSeconds": 0.1}  # fmt: skip
    epp = await start_epp([], config=config_with(raw))
    try:
        reply = await (await open_request(epp, 1)).recv()
        assert reply.immediate_response.status.code == 503
        assert json.loads(reply.immediate_response.body)["error"]["reason"] == "queue-timeout"
        assert ec.header_value(reply.immediate_response.headers,
                               "x-llm-d-request-dropped-reason") == "rejected-no-endpoints"  # fmt: skip
    finally:
        await stop_epp(epp)
