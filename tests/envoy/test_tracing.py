"""Traces and explanations through real Envoy, as an operator sets them up: ``epp serve`` with
only the ``OTEL_*`` variables set exports its spans to an OTLP/HTTP receiver, in the client's
trace, one naming the chosen endpoint; the request the model server gets carries a
``traceparent`` of that trace; every response carries its ``x-request-id``; a response served
without epp (fail-open) carries ``x-epp-fail-open``, one epp routed does not."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from epp.envoyconfig import EnvoyOptions
from simulator.envoy import RunningEnvoy, start_envoy, with_ports
from simulator.otlp import OtlpReceiver
from tests.envoy.conftest import MODEL, EppProcess, chat
from tests.http_app import serve_app


@dataclass
class Server:
    """A model server's stand-in that keeps the headers of every request it got."""

    seen: list[dict[str, str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> Server:
        async def complete(request: web.Request) -> web.Response:
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            await request.read()
            return web.json_response({
                "id": "c", "object": "chat.completion", "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
            })  # fmt: skip

        app = web.Application()
        app.router.add_post("/v1/chat/completions", complete)
        self.runner, self.port = await serve_app(app)
        return self


@dataclass
class Traced:
    servers: list[Server]
    epp: EppProcess
    envoy: RunningEnvoy
    receiver: OtlpReceiver


@pytest.fixture
async def traced(tmp_path: Path) -> AsyncIterator[Traced]:
    receiver = await OtlpReceiver().start()
    servers = [await Server().start() for _ in range(2)]
    endpoints = [f"127.0.0.1:{s.port}" for s in servers]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
           "OTEL_SERVICE_NAME": "epp-under-test"}  # fmt: skip
    epp = EppProcess(endpoints, tmp_path / "epp.log", extra=("--no-scrape",), env=env)
    await epp.start()
    envoy = await start_envoy(with_ports(EnvoyOptions(epp=(epp.address,), pool=tuple(endpoints))), tmp_path)
    try:
        yield Traced(servers, epp, envoy, receiver)
    finally:
        await envoy.stop()
        await epp.stop()
        for s in servers:
            assert s.runner is not None
            await s.runner.cleanup()
        await receiver.stop()


async def post(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> aiohttp.ClientResponse:
    async with http.post(url + "/v1/chat/completions", json=chat("what is bread? " * 20),
                         headers=headers) as r:  # fmt: skip
        await r.read()
        return r


async def until_routed_by_epp(t: Traced, http: aiohttp.ClientSession) -> None:
    """Envoy fails open until epp's health check passes: wait for a response epp routed."""
    deadline = asyncio.get_running_loop().time() + 20
    while "x-epp-fail-open" in (await post(http, t.envoy.url, {})).headers:
        assert asyncio.get_running_loop().time() < deadline, t.epp.log_path.read_text()[-2000:]
        await asyncio.sleep(0.1)


async def test_spans_in_the_clients_trace_and_its_traceparent_at_the_server(traced: Traced) -> None:
    t = traced
    async with aiohttp.ClientSession() as http:
        await until_routed_by_epp(t, http)
        sent: dict[str, str] = {}
        for _ in range(5):
            trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
            r = await post(http, t.envoy.url, {"traceparent": f"00-{trace_id}-{parent}-01",
                                               "x-request-id": f"client-{trace_id[:8]}"})  # fmt: skip
            assert r.status == 200 and "x-epp-fail-open" not in r.headers
            assert r.headers["x-request-id"] == f"client-{trace_id[:8]}"  # echoed
            sent[trace_id] = parent
        r = await post(http, t.envoy.url, {})
        assert r.headers.get("x-request-id")  # made up, and echoed
    at_servers = {h["traceparent"].split("-")[1]: h["traceparent"] for s in t.servers for h in s.seen
                  if "traceparent" in h}  # fmt: skip

    def complete(spans: object) -> bool:
        ends = {s.trace_id for s in t.receiver.spans if s.name == "epp.request"}
        return set(sent) <= ends

    await t.receiver.wait_for(complete, 30)
    for trace_id, parent in sent.items():
        spans = {s.name: s for s in t.receiver.trace(trace_id)}
        root = spans["epp.request"]
        assert root.parent_span_id == parent and root.service == "epp-under-test"
        picked = spans["epp.schedule"].attributes["epp.pick.endpoint"]
        assert picked in {f"127.0.0.1:{s.port}" for s in t.servers}
        assert spans["epp.profile default"].attributes["epp.candidates.count"] == 2
        upstream = spans["epp.upstream"]
        assert upstream.attributes["gen_ai.usage.input_tokens"] == 12
        # the model server got the request with the upstream span's context
        assert at_servers[trace_id] == f"00-{trace_id}-{upstream.span_id}-01"


async def test_fail_open_responses_are_marked(traced: Traced) -> None:
    t = traced
    async with aiohttp.ClientSession() as http:
        await until_routed_by_epp(t, http)
        bad = await http.post(t.envoy.url + "/v1/chat/completions", data=b"{not json")
        assert bad.status == 400 and "x-epp-fail-open" not in bad.headers  # epp's own answer
        await t.epp.stop()
        r = await post(http, t.envoy.url, {})
        assert r.status == 200 and r.headers.get("x-epp-fail-open") == "true"
        assert r.headers.get("x-request-id")  # Envoy's, echoed without epp too


@pytest.mark.parametrize(("options", "marked"), [
    (EnvoyOptions(pool=("127.0.0.1:1",)), True),
    (EnvoyOptions(pool=("127.0.0.1:1",), response="observer"), False),  # epp never sees the headers
    (EnvoyOptions(pool=("127.0.0.1:1",), response="none"), False),
    (EnvoyOptions(pool=("127.0.0.1:1",), failure="closed"), False),
    (EnvoyOptions(pool=("127.0.0.1:1",), routing="random"), False),
])  # fmt: skip
def test_the_bootstrap_marks_fail_open_only_where_epp_can_unmark(options: EnvoyOptions, marked: bool) -> None:
    from epp.envoyconfig import FAIL_OPEN_HEADER, envoy_config
    from epp.extproc.convert import FAIL_OPEN_HEADER as REMOVED

    assert FAIL_OPEN_HEADER == REMOVED
    hcm = envoy_config(options)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    added = hcm["route_config"]["virtual_hosts"][0].get("response_headers_to_add", [])
    assert any(h["header"]["key"] == FAIL_OPEN_HEADER for h in added) == marked
    assert hcm["always_set_request_id_in_response"] and hcm["preserve_external_request_id"]
