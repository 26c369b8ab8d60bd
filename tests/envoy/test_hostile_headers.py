"""Client headers that steer epp or the servers, sent through real Envoy with the bootstrap
``epp envoy-config`` generates (fail-open): a bad value is answered by epp, never passed
through unrouted (as it would be if it ended epp's ext_proc stream and Envoy failed open), and
a header only epp may set never reaches a server from a client."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from epp.config.loader import shipped_text
from epp.envoyconfig import EnvoyOptions
from simulator.envoy import start_envoy, with_ports
from tests.envoy.conftest import MODEL, EppProcess, Pool, chat, pool, until_epp_routes


def served(p: Pool) -> list[float]:
    """Requests each server completed (its own ``vllm:request_success_total``)."""
    return [r.emulator.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": MODEL, "finished_reason": "length"}) or 0.0
        for r in p.replicas]  # fmt: skip


def flow_control_config(tmp_path: Path) -> Path:
    path = tmp_path / "flow.yaml"
    text = shipped_text("default")
    path.write_text(text + "\nflowControl:\n  enabled: true\n  maxQueueSeconds: 12\n")
    return path


@pytest.mark.parametrize("deadline", ["²", "9" * 5000, "soon"])
async def test_a_bad_deadline_header_is_answered_400_by_epp_not_passed_through(
    tmp_path: Path, http: aiohttp.ClientSession, deadline: str
) -> None:
    config = flow_control_config(tmp_path)
    async with pool(tmp_path, replicas=2, epp_args=("--config", str(config))) as p:
        await until_epp_routes(p, http)
        before = served(p)
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello"),
                             headers={"x-gateway-request-deadline-ms": deadline}) as r:  # fmt: skip
            body = await r.json()
            assert r.status == 400, body
        assert "x-gateway-request-deadline-ms" in body["error"]["message"]
        assert served(p) == before  # no server saw it
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello"),
                             headers={"x-gateway-request-deadline-ms": "20000"}) as r:  # fmt: skip
            assert r.status == 200
        assert await p.epps[0].metric("epp_internal_errors_total") == 0


async def test_a_clients_prefiller_header_never_reaches_a_server_even_when_epp_is_down(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """``x-prefiller-host-port`` tells a decoder's P/D sidecar where to send the prompt; only
    epp may set it. With epp down Envoy fails open and routes by itself: the bootstrap's first
    filter has already removed the client's copy."""
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        if request.method == "POST":  # not epp's scrapes of /metrics
            seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server = f"127.0.0.1:{runner.addresses[0][1]}"
    epp = EppProcess([server], tmp_path / "epp.log")
    await epp.start()
    envoy = None
    try:
        envoy = await start_envoy(with_ports(EnvoyOptions(epp=(epp.address,), pool=(server,))),
                                  tmp_path)  # fmt: skip
        epp.kill()  # every ext_proc stream now fails: Envoy routes by itself
        before = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
        async with http.post(envoy.url + "/v1/chat/completions", json=chat("hello"),
                             headers={"x-prefiller-host-port": "127.0.0.1:22"}) as r:  # fmt: skip
            assert r.status == 200
        after = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
        assert sum(after.values()) > sum(before.values())  # it was the fail-open path
        assert len(seen) == 1 and "x-prefiller-host-port" not in seen[0]
    finally:
        if envoy is not None:
            await envoy.stop()
        await epp.stop()
        await runner.cleanup()
