"""The gateway against a tiny scripted ext_proc server: the Envoy behaviours epp relies on.

The servicer answers like an endpoint picker would, but its choices are fixed by the test,
so each test isolates one gateway behaviour (fallback, metadata vs header, mutations,
ImmediateResponse, protocol_config, pseudo-headers).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from simulator.gateway import (
    BUFFERED,
    FULL_DUPLEX_STREAMED,
    UPSTREAM_HOST_HEADER,
    GatewayOptions,
    start_gateway,
)

pytestmark = pytest.mark.e2e


def _hvo(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


@dataclass
class Script:
    """What the fake picker answers: a destination list, where to put it, extra behaviour."""

    destination: str = ""
    via_metadata: bool = False
    header_destination: str = ""
    reject_status: int = 0
    upper_body: bool = False
    seen: list[pb.ProcessingRequest] = field(default_factory=list)


class ScriptedPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, script: Script) -> None:
        self.script = script

    def _routing(self) -> tuple[pb.CommonResponse, Any]:
        s = self.script
        common = pb.CommonResponse(clear_route_cache=True)
        common.header_mutation.set_headers.append(_hvo("x-picked", "yes"))
        if s.header_destination:
            common.header_mutation.set_headers.append(
                _hvo("x-gateway-destination-endpoint", s.header_destination)
            )
        md = None
        if s.via_metadata:
            from google.protobuf import struct_pb2

            md = struct_pb2.Struct()
            md.fields["envoy.lb"].struct_value.fields[
                "x-gateway-destination-endpoint"
            ].string_value = s.destination
        elif not s.header_destination:
            common.header_mutation.set_headers.append(
                _hvo("x-gateway-destination-endpoint", s.destination)
            )
        return common, md

    async def Process(
        self, it: AsyncIterator[pb.ProcessingRequest], ctx: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        s = self.script
        mode = response_mode = BUFFERED
        body = bytearray()
        async for msg in it:
            s.seen.append(msg)
            if msg.HasField("protocol_config"):
                mode = msg.protocol_config.request_body_mode
                response_mode = msg.protocol_config.response_body_mode
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                if s.reject_status:
                    yield pb.ProcessingResponse(
                        immediate_response=pb.ImmediateResponse(
                            status=http_status_pb2.HttpStatus(code=s.reject_status),
                            body=b'{"error": "no"}',
                        )
                    )
                    return
                if mode == BUFFERED:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                body += msg.request_body.body
                if not msg.request_body.end_of_stream:
                    continue
                common, md = self._routing()
                if mode == BUFFERED:
                    common.body_mutation.body = bytes(body)
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=common), dynamic_metadata=md
                    )
                else:
                    common.header_mutation.set_headers.append(
                        _hvo("content-length", str(len(body)))
                    )
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=md
                    )
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(
                            response=pb.CommonResponse(
                                body_mutation=pb.BodyMutation(
                                    streamed_response=pb.StreamedBodyResponse(
                                        body=bytes(body), end_of_stream=True
                                    )
                                )
                            )
                        )
                    )
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                chunk = msg.response_body.body
                data = chunk.upper() if s.upper_body else chunk
                if response_mode == FULL_DUPLEX_STREAMED:
                    mutation = pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(
                            body=data, end_of_stream=msg.response_body.end_of_stream
                        )
                    )
                else:
                    mutation = pb.BodyMutation(body=data)
                yield pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=pb.CommonResponse(body_mutation=mutation)
                    )
                )


@dataclass
class Rig:
    url: str
    script: Script
    upstream: str
    dead: str
    received: list[dict[str, str]]


def _dead_port() -> str:
    with socket.socket() as s:  # bound and closed: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(params=[BUFFERED, FULL_DUPLEX_STREAMED], ids=["buffered", "full-duplex"])
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    received: list[dict[str, str]] = []

    async def echo(req: web.Request) -> web.StreamResponse:
        received.append(
            {
                **{k.lower(): v for k, v in req.headers.items()},
                ":path": req.path_qs,
                ":body": (await req.read()).decode(),
            }
        )
        if req.path == "/big":  # a reply above the gateway's buffer limit
            return web.Response(body=b"y" * (2 << 20), content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        for piece in (b"data: one\n\n", b"data: two\n\n"):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream = f"127.0.0.1:{runner.addresses[0][1]}"

    script = Script(destination=upstream)
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ScriptedPicker(script), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    mode = request.param
    gw = await start_gateway(
        GatewayOptions(
            extproc=f"127.0.0.1:{port}",
            request_mode=mode,
            response_mode=FULL_DUPLEX_STREAMED if mode == FULL_DUPLEX_STREAMED else BUFFERED,
            buffer_limit_bytes=1 << 20,  # Envoy's default per-connection buffer limit
        )
    )
    try:
        yield Rig(gw.url, script, upstream, _dead_port(), received)
    finally:
        await gw.stop()
        await server.stop(0)
        await runner.cleanup()


async def _call(
    url: str, path: str = "/v1/completions?x=1", body: bytes = b'{"a": 1}'
) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, data=body) as r:
        return r.status, dict(r.headers), await r.read()


async def test_envoy_messages_carry_pseudo_headers_raw_values_and_protocol_config(rig: Rig) -> None:
    status, _, _ = await _call(rig.url)
    assert status == 200
    first = rig.script.seen[0]
    assert first.HasField("protocol_config")
    assert all(not m.HasField("protocol_config") for m in rig.script.seen[1:])
    headers = {h.key: h.raw_value.decode() for h in first.request_headers.headers.headers}
    assert headers[":path"] == "/v1/completions?x=1"
    assert headers[":method"] == "POST"
    assert headers[":scheme"] == "http"
    assert headers[":authority"].startswith("127.0.0.1:")
    assert headers["x-request-id"]
    assert all(not h.value for h in first.request_headers.headers.headers)
    kinds = [m.WhichOneof("request") for m in rig.script.seen]
    assert kinds[:2] == ["request_headers", "request_body"]
    assert "response_headers" in kinds and kinds[-1] == "response_body"
    assert rig.script.seen[-1].response_body.end_of_stream


async def test_header_mutations_reach_the_upstream_and_body_arrives_unchanged(rig: Rig) -> None:
    status, headers, body = await _call(rig.url, body=b'{"prompt": "hello"}')
    assert status == 200
    assert rig.received[0]["x-picked"] == "yes"
    assert rig.received[0][":body"] == '{"prompt": "hello"}'
    assert headers[UPSTREAM_HOST_HEADER] == rig.upstream
    assert body == b"data: one\n\ndata: two\n\n"


async def test_falls_back_down_the_destination_list_on_connection_failure(rig: Rig) -> None:
    rig.script.destination = f"{rig.dead},{rig.upstream}"
    status, headers, _ = await _call(rig.url)
    assert status == 200
    assert headers[UPSTREAM_HOST_HEADER] == rig.upstream


async def test_all_destinations_down_is_503(rig: Rig) -> None:
    rig.script.destination = rig.dead
    status, _, body = await _call(rig.url)
    assert status == 503
    assert b"connection failure" in body


async def test_envoy_lb_metadata_wins_over_the_header(rig: Rig) -> None:
    rig.script.via_metadata = True
    rig.script.header_destination = rig.dead
    status, headers, _ = await _call(rig.url)
    assert status == 200
    assert headers[UPSTREAM_HOST_HEADER] == rig.upstream


async def test_immediate_response_is_returned_with_its_status_and_body(rig: Rig) -> None:
    rig.script.reject_status = 429
    status, _, body = await _call(rig.url)
    assert status == 429
    assert body == b'{"error": "no"}'
    assert rig.received == []


@pytest.mark.parametrize("expect100", [False, True], ids=["plain", "expect-100-continue"])
async def test_immediate_response_reaches_a_client_still_sending_a_large_body(
    rig: Rig, expect100: bool
) -> None:
    # epp's 413 comes at the headers, before the body is read; the client must get it
    # rather than a connection reset (curl sends Expect: 100-continue above 1 MiB)
    rig.script.reject_status = 413
    async with aiohttp.ClientSession() as s, s.post(
        rig.url + "/v1/completions", data=b"x" * (8 << 20), expect100=expect100
    ) as r:
        assert (r.status, await r.read()) == (413, b'{"error": "no"}')
    assert rig.received == []


async def test_a_request_body_past_the_buffer_limit_is_413_and_a_buffered_reply_500(
    rig: Rig,
) -> None:
    # the whole body is held (BUFFERED, or kept for a retry in full duplex): bounded
    status, _, body = await _call(rig.url, body=b"x" * (2 << 20))
    assert status == 413 and b"buffer limit" in body
    assert rig.received == []
    status, _, body = await _call(rig.url, path="/big")
    if rig.script.seen[0].protocol_config.response_body_mode == BUFFERED:
        assert status == 500 and b"response body" in body
    else:  # streamed through, never held whole
        assert status == 200 and len(body) == 2 << 20
    status, _, _ = await _call(rig.url)  # and the gateway keeps serving
    assert status == 200


async def test_response_body_mutations_reach_the_client(rig: Rig) -> None:
    rig.script.upper_body = True
    status, _headers, body = await _call(rig.url)
    assert status == 200
    assert body == b"DATA: ONE\n\nDATA: TWO\n\n"


async def test_no_destination_is_a_500_not_a_guess(rig: Rig) -> None:
    rig.script.destination = ""
    status, _, body = await _call(rig.url)
    assert status == 500
    assert b"no destination" in body
