"""Settings that span Envoy and epp, through real Envoy running what ``epp envoy-config``
prints for epp's config (issue 69): every pair holds together when derived, and the
contradiction the generator refuses does, in real Envoy, what the refusal says it would.

The model server is a stand-in that records, for every request it receives, whether epp
routed it (Envoy forwards epp's ``x-gateway-destination-endpoint`` header upstream; a request
Envoy sent after giving up on epp, failing open, has none)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from epp.cli import build_parser, envoy_bootstrap
from epp.envoyconfig import DESTINATION_HEADER, EnvoyOptions
from simulator.envoy import RunningEnvoy, start_envoy, with_ports
from tests.envoy.conftest import MODEL, EppProcess, chat
from tests.http_app import serve_app

pytestmark = pytest.mark.e2e

DROPPED = "x-llm-d-request-dropped-reason"


@dataclass
class Hit:
    routed: bool
    """The request carried epp's destination header: epp chose this server."""
    at_s: float


@dataclass
class StandIn:
    """A model server that answers chat completions; one whose prompt starts with ``hold N``
    streams a token every 0.2 s for N seconds (a long answer: never silent)."""

    hits: list[Hit] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner, self.port = await serve_app(app)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(Hit(DESTINATION_HEADER in request.headers, time.monotonic()))
        body = await request.json()
        text = body["messages"][0]["content"]
        if text.startswith("hold "):
            until = time.monotonic() + float(text.split()[1])
            out = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            while time.monotonic() < until:
                chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.2)  # the pace of a slow decode
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip

    def unrouted(self) -> int:
        return sum(not h.routed for h in self.hits)


@dataclass
class Setup:
    server: StandIn
    epp: EppProcess
    envoy: RunningEnvoy


def bootstrap(epp: str, server: str, config: Path, *flags: str) -> dict[str, Any]:
    """What ``epp envoy-config --config CONFIG --epp EPP --pool SERVER FLAGS`` prints, parsed."""
    args = build_parser().parse_args([
        "envoy-config", "--config", str(config), "--epp", epp, "--pool", server,
        "--port", "0", "--admin-port", "0", "--host", "127.0.0.1", *flags,
    ])  # fmt: skip
    return yaml.safe_load(envoy_bootstrap(args).yaml)  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def setup(
    tmp_path: Path, flow: dict[str, Any], *, flags: tuple[str, ...] = (),
    epp_args: tuple[str, ...] = (), contradiction: EnvoyOptions | None = None,
) -> AsyncIterator[Setup]:  # fmt: skip
    """A stand-in server, ``epp serve`` with flow control ``flow`` on (one request at a time:
    the server is saturated while it holds one) and Envoy running the generated bootstrap, or
    ``contradiction`` (a bootstrap the generator refuses: the fault it names)."""
    config = tmp_path / "epp.yaml"
    config.write_text(yaml.safe_dump({"flowControl": {
        "enabled": True, "saturation": "concurrency", "maxConcurrency": 1, **flow}}))  # fmt: skip
    server = StandIn()
    await server.start()
    epp = EppProcess([server.address], tmp_path / "epp.log",
                     extra=("--config", str(config), "--no-scrape", *epp_args))  # fmt: skip
    envoy: RunningEnvoy | None = None
    try:
        await epp.start()
        if contradiction is None:
            doc = bootstrap(epp.address, server.address, config, *flags)
            envoy = await start_envoy(with_ports(EnvoyOptions()), tmp_path, config=doc)
        else:
            options = with_ports(replace(contradiction, epp=(epp.address,),
                                         pool=(server.address,)))  # fmt: skip
            envoy = await start_envoy(options, tmp_path)
        yield Setup(server, epp, envoy)
    finally:
        if envoy is not None:
            await envoy.stop()
        await epp.stop()
        assert server.runner is not None
        await server.runner.cleanup()


@dataclass
class Answer:
    status: int
    took_s: float
    dropped: str


async def ask(http: aiohttp.ClientSession, url: str, text: str, *, chunked: bool = False) -> Answer:
    """``chunked``: no content-length (epp learns the size only from the body)."""
    started = time.monotonic()
    data = json.dumps(chat(text)).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    body: Any = pieces() if chunked else data
    headers = {"content-type": "application/json"}
    async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
        await r.read()
        return Answer(r.status, time.monotonic() - started, r.headers.get(DROPPED, ""))


async def saturated(s: Setup, http: aiohttp.ClientSession, hold_s: float,
                    queued: int) -> tuple[Answer, list[Answer]]:  # fmt: skip
    """The server busy with one request for ``hold_s``; ``queued`` more sent meanwhile."""
    holder = asyncio.create_task(ask(http, s.envoy.url, f"hold {hold_s}"))
    deadline = time.monotonic() + 10
    while not s.server.hits:
        assert time.monotonic() < deadline, "the holding request never reached the server"
        await asyncio.sleep(0.02)  # until the server holds it
    waiting = await asyncio.gather(*(ask(http, s.envoy.url, f"queued {i}") for i in range(queued)))
    return await holder, list(waiting)


async def test_with_the_shipped_queue_time_no_request_reaches_a_saturated_server_unrouted(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """flowControl's defaults (maxQueueSeconds 30): requests queued longer than the old 5 s
    message timeout are still routed by epp when the server frees."""
    async with setup(tmp_path, {}) as s:
        holder, queued = await saturated(s, http, hold_s=7.0, queued=4)
        unrouted = s.server.unrouted()
    assert holder.status == 200
    assert [a.status for a in queued] == [200] * 4
    assert min(a.took_s for a in queued) > 5.5  # they waited past the old message timeout
    assert unrouted == 0


async def test_with_a_12_s_queue_requests_leave_at_12_s_with_429_and_none_reach_the_server(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The public report's case: one saturated server, maxQueueSeconds 12, fail-open."""
    async with setup(tmp_path, {"maxQueueSeconds": 12}) as s:
        holder, queued = await saturated(s, http, hold_s=14.0, queued=3)
        hits, unrouted = len(s.server.hits), s.server.unrouted()
    assert [a.status for a in queued] == [429] * 3
    assert {a.dropped for a in queued} == {"rejected-ttl-expired"}
    assert all(11.5 < a.took_s < 14.0 for a in queued), [a.took_s for a in queued]
    assert holder.status == 200 and hits == 1 and unrouted == 0


async def test_a_message_timeout_below_the_queue_wait_fails_open_to_an_unrouted_server(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """What the generator refuses (``--message-timeout-s 1`` with a 4 s queue) does in real
    Envoy: after 1 s it gives up on epp and sends the queued request to the server itself."""
    config = {"maxQueueSeconds": 4}
    bad = EnvoyOptions(message_timeout_s=1.0)
    async with setup(tmp_path, config, contradiction=bad) as s:
        _, queued = await saturated(s, http, hold_s=3.0, queued=2)
        unrouted = s.server.unrouted()
    assert unrouted == 2 and all(a.took_s < 3.0 for a in queued)
    with pytest.raises(ValueError, match=r"--message-timeout-s 1 .*flowControl.maxQueueSeconds"):
        envoy_bootstrap(build_parser().parse_args(
            ["envoy-config", "--pool", "127.0.0.1:1", "--message-timeout-s", "1", "--config",
             str(tmp_path / "epp.yaml")]))  # fmt: skip


async def test_a_stream_idle_timeout_below_the_queue_wait_cuts_queued_requests(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The second pair: a request queued in epp is silent; the generated stream idle timeout
    outlasts the queue. One below it (refused by the generator) fires while epp holds the
    request: Envoy answers 504 "stream timeout" before epp could route it."""
    config = {"maxQueueSeconds": 3}
    async with setup(tmp_path, config) as s:
        _, queued = await saturated(s, http, hold_s=2.0, queued=1)
    assert [a.status for a in queued] == [200]
    bad = EnvoyOptions(message_timeout_s=8.0, stream_idle_timeout_s=1.0)
    async with setup(tmp_path, config, contradiction=bad) as s:
        _, queued = await saturated(s, http, hold_s=2.5, queued=1)
        unrouted = s.server.unrouted()
    assert queued[0].status == 504 and queued[0].took_s < 2.5 and unrouted == 0
    with pytest.raises(ValueError, match="--stream-idle-timeout-s 1 "):
        envoy_bootstrap(build_parser().parse_args(
            ["envoy-config", "--pool", "127.0.0.1:1", "--stream-idle-timeout-s", "1",
             "--config", str(tmp_path / "epp.yaml")]))  # fmt: skip


async def test_a_buffer_limit_above_epps_body_cap_lets_a_large_body_through_unrouted(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The third pair: Envoy's buffer limit is epp's body cap (derived), so a body epp would
    refuse is refused by Envoy; with a larger limit (refused by the generator), a body above
    epp's gRPC message limit fails the ext_proc stream and Envoy fails open with it."""
    big = "x" * (20 << 20)
    cap = ("--max-body-bytes", "1MiB")
    async with setup(tmp_path, {}, epp_args=cap, flags=cap) as s:
        answer = await ask(http, s.envoy.url, big, chunked=True)
        hits = len(s.server.hits)
    assert answer.status == 413 and hits == 0
    bad = EnvoyOptions(max_request_bytes=64 << 20)
    async with setup(tmp_path, {}, epp_args=cap, contradiction=bad) as s:
        answer = await ask(http, s.envoy.url, big, chunked=True)
        unrouted = s.server.unrouted()
    assert answer.status == 200 and unrouted == 1
    with pytest.raises(ValueError, match=r"--max-request-bytes 67108864 .*--max-body-bytes 1048576"):
        envoy_bootstrap(build_parser().parse_args(
            ["envoy-config", "--pool", "127.0.0.1:1", "--max-request-bytes", "64MiB", *cap]))


def test_a_bootstrap_generated_for_epps_defaults_is_flagged_for_a_12_s_queue(tmp_path: Path) -> None:
    """``--check``: the shipped bootstrap against a config with flow control on."""
    from epp.cli import check_envoy_bootstrap

    config = tmp_path / "epp.yaml"
    config.write_text(json.dumps({"flowControl": {"enabled": True, "maxQueueSeconds": 12}}))
    shipped = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"
    lines = check_envoy_bootstrap(build_parser().parse_args(
        ["envoy-config", "--check", str(shipped), "--config", str(config)]))  # fmt: skip
    assert lines[0].startswith("error: --message-timeout-s 5 ")
    assert "at least 17" in lines[0]
    assert lines[1].startswith("warning: --failure open")
    assert check_envoy_bootstrap(build_parser().parse_args(
        ["envoy-config", "--check", str(shipped)])) == []  # fmt: skip
