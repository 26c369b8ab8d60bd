"""The P/D sidecar continues the trace into both legs: with tracing on, a span for the request
and one per leg, each leg's request carrying its own span's traceparent; without it, both legs
carry the traceparent the sidecar received."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from epp.observability.tracing import Tracing, tracing_from_env
from epp.sidecar.proxy import Sidecar, SidecarConfig
from tests.http_app import serve_app
from tests.integration.test_tracing import CLIENT_SPAN, CLIENT_TRACE, TRACEPARENT, in_memory


@dataclass
class Recorder:
    """A server that keeps each request's headers and answers a completion."""

    seen: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def complete(request: web.Request) -> web.Response:
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            await request.read()
            return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3}})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        return app


async def split_request(tracing: Tracing | None) -> tuple[Recorder, Recorder]:
    prefiller, decoder = Recorder(), Recorder()
    runners = []
    try:
        p_runner, p_port = await serve_app(prefiller.app())
        d_runner, d_port = await serve_app(decoder.app())
        runners += [p_runner, d_runner]
        sidecar = Sidecar(SidecarConfig(decoder=f"http://127.0.0.1:{d_port}",
                                        allowed_prefillers=(f"127.0.0.1:{p_port}",)), tracing)
        s_runner, s_port = await serve_app(sidecar.app())
        runners.append(s_runner)
        async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{s_port}/v1/completions", data=json.dumps({"model": "m", "prompt": "p"}),
            headers={"traceparent": TRACEPARENT, "x-prefiller-host-port": f"127.0.0.1:{p_port}",
                     "content-type": "application/json"},
        ) as r:  # fmt: skip
            assert r.status == 200
            await r.read()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
    return prefiller, decoder


async def test_a_traced_sidecar_gives_each_leg_its_own_span_in_the_clients_trace() -> None:
    tracing, exporter = in_memory()
    prefiller, decoder = await split_request(tracing)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"epp.pd_sidecar", "epp.pd_sidecar.prefill", "epp.pd_sidecar.decode"}
    root = spans["epp.pd_sidecar"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    for leg, server in (("prefill", prefiller), ("decode", decoder)):
        span = spans[f"epp.pd_sidecar.{leg}"]
        assert span.parent.span_id == root.context.span_id
        assert span.attributes["http.response.status_code"] == 200
        (headers,) = server.seen
        assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{format(span.context.span_id, '016x')}-01"


async def test_an_untraced_sidecar_passes_the_traceparent_to_both_legs() -> None:
    prefiller, decoder = await split_request(None)
    assert [h["traceparent"] for h in prefiller.seen + decoder.seen] == [TRACEPARENT, TRACEPARENT]



def test_a_traced_sidecar_counts_its_span_exports_on_its_metrics() -> None:
    tracing = tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert tracing is not None
    try:
        side = Sidecar(SidecarConfig(allowed_prefillers=("10.0.0.0/8",)), tracing)
        for outcome in ("ok", "failed"):
            labels = {"exporter": "otlp", "outcome": outcome}
            assert side.registry.get_sample_value("epp_tracing_spans_exported_total", labels) == 0
    finally:
        tracing.shutdown()
