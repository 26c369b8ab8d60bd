"""The P/D sidecar sends the prompt only where its operator allowed: ``x-prefiller-host-port``
reaches the decoder's pod from anyone who can send to it (epp strips a client's copy only when
it routes the request), so a forged header must not make the sidecar POST the prompt to
loopback, the cloud metadata address or any address outside ``--allowed-prefillers``.

Real sockets: the sidecar's app, a decoder and a would-be target, each an HTTP server on port 0.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from epp.sidecar.proxy import Sidecar, SidecarConfig, run

pytestmark = pytest.mark.asyncio


@dataclass
class Recorder:
    """An HTTP server that answers every request like a completion and keeps the bodies."""

    bodies: list[dict[str, object]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        if request.can_read_body:
            self.bodies.append(await request.json())
        return web.json_response({"id": "x", "choices": [{"text": "ok"}]})


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"{host}:{port}"
    finally:
        await runner.cleanup()


def recorder_app(rec: Recorder) -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    return app


@asynccontextmanager
async def sidecar(allowed: tuple[str, ...]) -> AsyncIterator[tuple[str, Recorder, Recorder, str, Sidecar]]:
    decoder, target = Recorder(), Recorder()
    async with serve(recorder_app(decoder)) as dec, serve(recorder_app(target)) as tgt:
        side = Sidecar(SidecarConfig(decoder=f"http://{dec}", allowed_prefillers=allowed))
        async with serve(side.app()) as url:
            yield url, decoder, target, tgt, side


async def post(url: str, prefiller: str, body: dict[str, object]) -> int:
    async with aiohttp.ClientSession() as http, http.post(
        f"http://{url}/v1/completions", json=body, headers={"x-prefiller-host-port": prefiller}
    ) as r:
        await r.read()
        return r.status


def outcome(side: Sidecar, name: str) -> float:
    return side.registry.get_sample_value("epp_sidecar_prefill_total", {"outcome": name}) or 0.0


def splits(side: Sidecar) -> dict[str, float]:
    """``epp_sidecar_requests_total`` by ``split``: what happened to each request."""
    return {v: side.registry.get_sample_value("epp_sidecar_requests_total", {"split": v}) or 0.0
            for v in ("yes", "fallback", "no")}  # fmt: skip


BODY = {"model": "m", "prompt": "a secret prompt", "max_tokens": 8}


@pytest.mark.parametrize("allowed", [("10.0.0.0/8",), ("0.0.0.0/0",), ("127.0.0.0/8:1",)],
                         ids=["private-only", "everything", "loopback-other-port"])  # fmt: skip
async def test_a_loopback_target_is_refused_unless_its_range_and_port_are_allowed(
    allowed: tuple[str, ...],
) -> None:
    async with sidecar(allowed) as (url, decoder, target, tgt, side):
        assert await post(url, tgt, BODY) == 200  # decoded locally
        assert target.bodies == []  # the prompt never left for the forged target
        assert len(decoder.bodies) == 1 and decoder.bodies[0]["max_tokens"] == 8
        assert "x-prefiller-host-port" not in {k.lower() for k in decoder.headers[0]}
        assert outcome(side, "not-allowed") == 1
        assert splits(side) == {"yes": 0, "fallback": 1, "no": 0}  # asked, not split


async def test_an_entry_inside_the_loopback_range_allows_it() -> None:
    async with sidecar(("127.0.0.1/32",)) as (url, _decoder, target, tgt, side):
        assert await post(url, tgt, BODY) == 200
        assert len(target.bodies) == 1 and target.bodies[0]["max_tokens"] == 1
        assert outcome(side, "ok") == 1
        async with aiohttp.ClientSession() as http, http.post(f"http://{url}/v1/completions", json=BODY) as r:
            assert r.status == 200  # no header: no split asked for
        assert splits(side) == {"yes": 1, "fallback": 0, "no": 1}


@pytest.mark.parametrize("forged", ["169.254.169.254:80", "0.0.0.0:80", "[::1]:80",
                                    "[fe80::1]:80", "224.0.0.1:80", "not-an-address"])  # fmt: skip
async def test_special_targets_are_refused_even_inside_an_allowed_wide_network(forged: str) -> None:
    """The cloud metadata service, loopback, unspecified, link-local and multicast addresses
    lie inside ``0.0.0.0/0`` and ``::/0``; a wide entry still does not open them."""
    async with sidecar(("0.0.0.0/0", "::/0")) as (url, decoder, _target, _tgt, side):
        assert await post(url, forged, BODY) == 200
        assert outcome(side, "not-allowed") == 1 and len(decoder.bodies) == 1


async def test_a_port_other_than_the_allowed_one_is_refused() -> None:
    async with sidecar(("127.0.0.1/32:1",)) as (url, _decoder, target, tgt, side):
        assert await post(url, tgt, BODY) == 200
        assert target.bodies == [] and outcome(side, "not-allowed") == 1


async def test_the_sidecar_refuses_to_start_without_an_allow_list() -> None:
    # its own process: epp's CLI sets up logging for the process it runs in
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "pd-sidecar", "--port", "0",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"--allowed-prefillers is required" in err



@pytest.mark.parametrize(("allowed", "warned"), [
    (("10.0.0.0/8:8000",), []),
    (("10.0.0.0/8:8000", "0.0.0.0/0:8000", "[::/0]:8000"), ["0.0.0.0/0:8000", "[::/0]:8000"]),
])  # fmt: skip
async def test_the_allow_list_is_logged_at_start_and_an_entry_allowing_everything_warned(
    allowed: tuple[str, ...], warned: list[str], caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()
    stop.set()  # start, log, stop
    with caplog.at_level(logging.INFO, logger="epp.sidecar.proxy"):
        await run(SidecarConfig(allowed_prefillers=allowed), "127.0.0.1", 0, stop)
    (started,) = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert started.endswith("prefills allowed to " + ", ".join(allowed))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split()[1] for w in warnings] == warned
    assert all("any host the pod reaches" in w for w in warnings)
