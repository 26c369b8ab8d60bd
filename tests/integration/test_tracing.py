"""OpenTelemetry traces of the request path, over epp's real gRPC server driven with the
messages Envoy sends: one span tree per request under the client's traceparent, the pick
named, each profile's candidates and scores, usage and first-token time, the traceparent set
on the request to the model server, sampling, and no prompt text anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from epp.errors import ConfigError
from epp.observability.tracing import Tracing, tracing_from_env
from simulator.otlp import OtlpReceiver
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, config_with, start_epp, stop_epp

SECRET = "the launch codes are 0000"
BODY = json.dumps({"model": "m", "prompt": SECRET * 40, "stream": True}).encode()
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SSE = (b'data: {"choices":[{"text":"a"}]}\n\n'
       b'data: {"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":7,'
       b'"prompt_tokens_details":{"cached_tokens":256}}}\n\ndata: [DONE]\n\n')  # fmt: skip


def in_memory(sampler: Any = None) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler or ParentBased(ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("epp"), TraceContextTextMapPropagator(), provider), exporter


@pytest.fixture
async def traced() -> AsyncIterator[tuple[Epp, InMemorySpanExporter]]:
    tracing, exporter = in_memory()
    epp = await start_epp(tracing=tracing)
    yield epp, exporter
    await stop_epp(epp)


async def exchange(epp: Epp, headers: dict[str, str]) -> tuple[Any, Any]:
    """One streamed request and its SSE response; the routing reply and the response
    headers' reply."""
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(extra=headers), ec.request_body(BODY, True))
    routing, _ = await s.recv_n(2)
    await s.send(ec.response_headers(content_type="text/event-stream"),
                 ec.response_body(SSE[:40], False), ec.response_body(SSE[40:], True))  # fmt: skip
    reply_headers, *_ = await s.recv_n(3)
    assert await s.close() == grpc.StatusCode.OK
    return routing, reply_headers


async def test_one_span_tree_per_request_under_the_clients_trace(traced: tuple[Epp, InMemorySpanExporter]) -> None:
    epp, exporter = traced
    routing, _ = await exchange(epp, {"traceparent": TRACEPARENT})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"epp.request", "epp.parse", "epp.schedule", "epp.profile default", "epp.upstream"}
    assert {format(s.context.trace_id, "032x") for s in spans.values()} == {CLIENT_TRACE}
    root = spans["epp.request"]
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN and root.parent.is_remote
    for name in ("epp.parse", "epp.schedule", "epp.upstream"):
        assert spans[name].parent.span_id == root.context.span_id, name
    assert spans["epp.profile default"].parent.span_id == spans["epp.schedule"].context.span_id
    # the pick, named where it is made and on the request
    target = ec.destination(routing)
    assert spans["epp.schedule"].attributes["epp.pick.endpoint"] == target
    assert root.attributes["epp.pick.endpoint"] == target
    # the profile run: candidates best first, each scorer's scores aligned with them
    profile = spans["epp.profile default"].attributes
    candidates = list(profile["epp.candidates"])
    assert candidates[0] == target and len(candidates) == profile["epp.candidates.count"] == 4
    scorers = [k for k in profile if k.startswith("epp.scorer.") and k.endswith(".scores")]
    assert scorers and all(len(profile[k]) == 4 for k in scorers)
    assert profile["epp.totals"][0] == max(profile["epp.totals"])
    # the model server's request carries the upstream span's context
    upstream = spans["epp.upstream"]
    sent = ec.header_value(routing.request_headers.response.header_mutation, "traceparent")
    assert sent == f"00-{CLIENT_TRACE}-{format(upstream.context.span_id, '016x')}-01"
    assert upstream.attributes["server.address"] + ":" + str(upstream.attributes["server.port"]) == target
    # the response: usage, cached tokens, first-token time
    assert upstream.attributes["gen_ai.usage.input_tokens"] == 300
    assert upstream.attributes["gen_ai.usage.output_tokens"] == 7
    assert upstream.attributes["gen_ai.usage.cache_read.input_tokens"] == 256
    assert upstream.attributes["epp.ttft_s"] > 0 and [e.name for e in upstream.events] == ["first_token"]
    assert root.attributes["http.response.status_code"] == 200
    assert root.end_time >= upstream.end_time >= upstream.start_time >= spans["epp.schedule"].end_time
    # no prompt text in any span
    text = json.dumps([{**dict(s.attributes or {}), "events": [dict(e.attributes or {}) for e in s.events]}
                       for s in spans.values()], default=str)  # fmt: skip
    assert "launch codes" not in text


async def test_a_request_without_a_traceparent_starts_a_trace(traced: tuple[Epp, InMemorySpanExporter]) -> None:
    epp, exporter = traced
    routing, _ = await exchange(epp, {})
    root = next(s for s in exporter.get_finished_spans() if s.name == "epp.request")
    assert root.parent is None
    sent = ec.header_value(routing.request_headers.response.header_mutation, "traceparent")
    assert sent is not None and sent.split("-")[1] == format(root.context.trace_id, "032x")


async def test_epps_own_answer_ends_the_trace_with_its_status(traced: tuple[Epp, InMemorySpanExporter]) -> None:
    epp, exporter = traced
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(extra={"traceparent": TRACEPARENT}), ec.request_body(b"{not json", True))
    reply = await s.recv()
    assert reply.immediate_response.status.code == 400
    await s.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"epp.request", "epp.parse"}
    assert spans["epp.request"].attributes["http.response.status_code"] == 400
    assert not spans["epp.request"].status.is_ok and not spans["epp.parse"].status.is_ok


async def test_a_flow_control_wait_is_a_span() -> None:
    tracing, exporter = in_memory()
    epp = await start_epp(tracing=tracing, config=config_with({"flowControl": {"enabled": True}}))
    try:
        await exchange(epp, {"traceparent": TRACEPARENT})
    finally:
        await stop_epp(epp)
    wait = next(s for s in exporter.get_finished_spans() if s.name == "epp.flow_control.wait")
    assert wait.attributes["epp.flow_control.outcome"] == "dispatched"


async def test_sampled_out_requests_record_nothing_and_pass_the_decision_on() -> None:
    tracing, exporter = in_memory(ALWAYS_OFF)
    epp = await start_epp(tracing=tracing)
    try:
        routing, _ = await exchange(epp, {})
        client, _ = await exchange(epp, {"traceparent": TRACEPARENT.removesuffix("01") + "00"})
    finally:
        await stop_epp(epp)
    assert exporter.get_finished_spans() == ()
    sent = ec.header_value(routing.request_headers.response.header_mutation, "traceparent")
    assert sent is not None and not int(sent.split("-")[3], 16) & 1  # the sampled flag is off
    sent = ec.header_value(client.request_headers.response.header_mutation, "traceparent")
    assert sent is not None and sent.split("-")[1] == CLIENT_TRACE and not int(sent.split("-")[3], 16) & 1


async def test_without_tracing_the_clients_traceparent_is_left_alone() -> None:
    epp = await start_epp()
    try:
        routing, _ = await exchange(epp, {"traceparent": TRACEPARENT})
    finally:
        await stop_epp(epp)
    assert ec.header_value(routing.request_headers.response.header_mutation, "traceparent") is None


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, True),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_BSP_MAX_QUEUE_SIZE": "4096"}, True),
])  # fmt: skip
def test_the_otel_variables_alone_turn_tracing_on(env: dict[str, str], on: bool) -> None:
    tracing = tracing_from_env(env)
    assert (tracing is not None) == on
    if tracing is not None:
        tracing.shutdown()


@pytest.mark.parametrize(("env", "field"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    # what the SDK would only warn about (and then sample everything, or crash on)
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "bogus"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "abc"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_QUEUE_SIZE": "-1"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_QUEUE_SIZE": "10",
      "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "notaurl"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:99999/v1/traces"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
])  # fmt: skip
def test_what_cannot_work_fails_naming_the_variable(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        tracing_from_env(env)
    assert err.value.field == field


def test_stale_otlp_protos_fail_at_start_naming_the_repair(monkeypatch: pytest.MonkeyPatch) -> None:
    """xds-protos overwrites opentelemetry-proto's modules with an old copy when pip installs it
    last (grpc/grpc#42926): epp says so and how to repair it, not an ImportError traceback."""
    import types

    stale = types.ModuleType("opentelemetry.proto.common.v1.common_pb2")  # no InstrumentationScope
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.common.v1.common_pb2", stale)
    with pytest.raises(ConfigError) as err:
        tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert err.value.field == "OTEL_EXPORTER_OTLP_ENDPOINT"
    assert "--force-reinstall --no-deps opentelemetry-proto" in str(err.value)


def test_the_installed_otlp_protos_are_current() -> None:
    """What ``./run`` installs (and CI tests) has OpenTelemetry's own modules, not xds-protos'."""
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert InstrumentationScope.DESCRIPTOR.name == "InstrumentationScope"


def test_an_unknown_propagator_fails_at_start_naming_the_variable() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epp.cli", "serve", "--endpoints", "127.0.0.1:1", "--host",
         "127.0.0.1", "--grpc-port", "0", "--health-port", "-1", "--metrics-port", "0"],
        env={**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_PROPAGATORS": "bogus"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "OTEL_PROPAGATORS" in proc.stderr and "Traceback" not in proc.stderr



async def _refuse(_request: web.Request) -> web.Response:
    return web.Response(status=400, text="refused")


@pytest.mark.parametrize("receiver_refuses", [False, True], ids=["received", "refused"])
async def test_each_spans_export_is_counted_by_outcome(receiver_refuses: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that refuses the spans (HTTP 400: the exporter gives up at once) shows as
    ``failed`` on epp's /metrics, not only in a log line; one that takes them, as ``ok``."""
    receiver = await OtlpReceiver().start()
    app = web.Application()
    app.router.add_post("/v1/traces", _refuse)
    refuser = web.AppRunner(app, access_log=None)
    await refuser.setup()
    await web.TCPSite(refuser, "127.0.0.1", 0).start()
    endpoint = f"http://127.0.0.1:{refuser.addresses[0][1]}" if receiver_refuses else receiver.endpoint
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)  # the SDK's exporter reads it
    tracing = tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    assert tracing is not None
    epp = await start_epp(tracing=tracing)
    try:
        await exchange(epp, {"traceparent": TRACEPARENT})
    finally:
        await stop_epp(epp)  # exports what the batch processor holds
        await receiver.stop()
        await refuser.cleanup()
    reg = epp.handle.registry
    counted = {o: reg.get_sample_value("epp_tracing_spans_exported_total", {"exporter": "otlp", "outcome": o})
               for o in ("ok", "failed")}  # fmt: skip
    assert counted == ({"ok": 0, "failed": 5} if receiver_refuses else {"ok": 5, "failed": 0})
    assert receiver.received == (0 if receiver_refuses else 5)
