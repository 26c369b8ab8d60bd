"""The development gateway: an HTTP front proxy that plays Envoy's part for epp.

For each client request (policy ``epp``) it opens one ext_proc stream and walks it as
Envoy's ext_proc filter does:

    request headers --BUFFERED: wait for reply, send whole body, wait--> header/body mutations
                    --FULL_DUPLEX_STREAMED: send body chunks as they arrive; read the header
                      reply and the streamed body replies--> mutated headers + body
    destination: dynamic metadata envoy.lb / x-gateway-destination-endpoint (ip:port list)
    upstream (falling back down the list on connect failure)
    response headers -> reply -> response body (NONE | STREAMED | BUFFERED | FULL_DUPLEX)
    ImmediateResponse at any point before the client response started -> sent as is

Policies ``random`` and ``round-robin`` skip ext_proc and pick from a static list (the
baseline). docs/local-stack.md lists which Envoy behaviours this reproduces and which not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from multidict import CIMultiDict

from simulator.gateway import extproc as xp
from simulator.gateway.extproc import ExtProcError, ExtProcStream, Immediate, ObserverStream
from simulator.gateway.headers import HOP_BY_HOP, HeaderList
from simulator.gateway.upstream import GatewayStats, NoUpstream, Upstream, Upstreams

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
UPSTREAM_HOST_HEADER = "x-upstream-host"
"""Added to every proxied response, like Envoy's ``response_headers_to_add`` with
``%UPSTREAM_HOST%``: which replica served the request."""

POLICIES = ("epp", "random", "round-robin")


DEFAULT_BUFFER_LIMIT_BYTES = 32 << 20


@dataclass(slots=True, frozen=True)
class GatewayOptions:
    host: str = "127.0.0.1"
    port: int = 0
    policy: str = "epp"
    extproc: str = ""
    """epp's gRPC address (host:port), or several comma-separated (``a:1,b:2``): the
    ext_proc cluster's endpoints, one stream per request, round-robin. Policy ``epp`` only."""
    endpoints: tuple[str, ...] = ()
    """Model servers (ip:port) for the baseline policies."""
    request_mode: int = xp.FULL_DUPLEX_STREAMED
    response_mode: int = xp.FULL_DUPLEX_STREAMED
    response_observer: bool = False
    """Responses go to a second ext_proc stream in observability_mode (a second Envoy ext_proc
    filter after the routing one: request headers, then the response, STREAMED, sent without
    waiting); the routing stream skips the response."""
    buffer_limit_bytes: int = DEFAULT_BUFFER_LIMIT_BYTES
    """Largest body the gateway holds whole (a BUFFERED body, the request body it keeps for a
    retry on a fallback): 413 above it for a request, 500 for a response, as Envoy's buffer
    limit does."""
    message_timeout_s: float = 10.0
    """Envoy's ext_proc ``message_timeout`` (Envoy's default is 0.2 s; generous here because
    the whole stack shares a laptop's cores)."""
    route_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    seed: int | None = None

    @property
    def extproc_targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.extproc.split(",") if t.strip())


class BodyTooLarge(Exception):
    """A body the gateway must hold whole passed ``buffer_limit_bytes``."""

    def __init__(self, what: str, limit: int, status: int) -> None:
        super().__init__(f"{what} is larger than the gateway's buffer limit ({limit} bytes)")
        self.status = status


async def _read_bounded(
    content: aiohttp.StreamReader, limit: int, what: str, status: int
) -> bytes:
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(what, limit, status)
    return bytes(buf)


class Exchange(Protocol):
    async def serve(self, request: web.Request) -> web.StreamResponse: ...


@dataclass(slots=True)
class _Forward:
    headers: HeaderList
    body: bytes


def client_headers(request: web.Request) -> HeaderList:
    """The request as Envoy's HTTP connection manager presents it to filters."""
    headers = HeaderList.from_mapping(
        {
            ":authority": request.host,
            ":path": request.raw_path,
            ":method": request.method,
            ":scheme": request.scheme,
        },
        request.headers.items(),
    )
    if headers.get("x-request-id") is None:
        headers.add("x-request-id", str(uuid.uuid4()))
    headers.set("x-forwarded-proto", request.scheme)
    return headers


def upstream_headers(up: aiohttp.ClientResponse) -> HeaderList:
    headers = HeaderList([(":status", str(up.status))])
    for k, v in up.raw_headers:
        key = k.decode("latin-1").lower()
        if key not in HOP_BY_HOP:
            headers.add(key, v.decode("latin-1"))
    return headers


def _has_body(method: str, up: aiohttp.ClientResponse) -> bool:
    if method == "HEAD" or up.status in (204, 304) or 100 <= up.status < 200:
        return False
    return up.content_length != 0


def _response(
    status: int, headers: HeaderList, upstream: str | None, body: bytes | None = None
) -> web.StreamResponse:
    out: CIMultiDict[str] = CIMultiDict(headers.regular())
    if upstream:
        out[UPSTREAM_HOST_HEADER] = upstream
    if body is not None:
        out.popall("content-length", None)
        return web.Response(status=status, headers=out, body=body)
    return web.StreamResponse(status=status, headers=out)


def _immediate(imm: Immediate) -> web.StreamResponse:
    return _response(imm.status, imm.headers, None, imm.body)


def local_reply(status: int, message: str) -> web.Response:
    """A reply the gateway generates itself (Envoy's local reply: plain text)."""
    return web.Response(status=status, text=message, content_type="text/plain")


def _mutated(mutation: pb.BodyMutation, body: bytes) -> bytes:
    kind = mutation.WhichOneof("mutation")
    if kind == "body":
        return bytes(mutation.body)
    if kind == "clear_body":
        return b"" if mutation.clear_body else body
    if kind == "streamed_response":
        raise ExtProcError(
            "ext_proc protocol error: streamed_response outside FULL_DUPLEX_STREAMED"
        )
    return body


def _check_length(headers: HeaderList, body: bytes, where: str) -> None:
    length = headers.get("content-length")
    if length is not None and length.strip() != str(len(body)):
        raise ExtProcError(
            f"{where}: content-length {length} does not match the {len(body)}-byte body "
            "(Envoy rejects such a mutation)"
        )


async def _pump(
    send: Callable[[pb.ProcessingRequest], Awaitable[None]],
    content: aiohttp.StreamReader,
    message: Callable[[bytes, bool], pb.ProcessingRequest],
    forward: Callable[[bytes], Awaitable[None]] | None = None,
) -> None:
    """Send body chunks as they arrive (no waiting), ``end_of_stream`` on the last one;
    ``forward``: pass each chunk on first (the observer mode's client)."""
    ended = False
    async for chunk in content.iter_any():
        if forward is not None:
            await forward(chunk)
        ended = content.at_eof()
        await send(message(chunk, ended))
    if not ended:
        await send(message(b"", True))


_DISCARD_LIMIT_BYTES = 64 << 20


async def _discard_body(request: web.Request) -> None:
    """Read what is left of a request body that will not be forwarded (an ImmediateResponse,
    e.g. epp's 413, came first). Closing the connection with unread bytes makes the kernel
    send a reset, which discards the reply before the client reads it (curl: 'Connection
    reset by peer' right after '100 Continue'). Bodies beyond the limit are still reset."""
    content, seen = request.content, 0
    while seen <= _DISCARD_LIMIT_BYTES and not content.at_eof():
        chunk = await content.readany()
        if not chunk:
            break
        seen += len(chunk)


async def _finish_task(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class EppExchange:
    """Policy ``epp``: every request through one ext_proc stream.

    With several ext_proc targets (epp replicas), each stream goes to the next one in turn,
    as Envoy's ext_proc cluster with the default ROUND_ROBIN load balancer picks a host per
    stream (the gRPC async client opens each ``Process`` call as a new cluster request)."""

    def __init__(
        self,
        channels: Sequence[tuple[str, grpc.aio.Channel]],
        upstreams: Upstreams,
        opts: GatewayOptions,
        stats: GatewayStats,
    ) -> None:
        if not channels:
            raise ValueError("policy epp needs at least one ext_proc target")
        self._stubs = itertools.cycle(
            [(target, pb_grpc.ExternalProcessorStub(ch)) for target, ch in channels]
        )
        self._upstreams = upstreams
        self._opts = opts
        self._stats = stats
        if opts.request_mode not in (xp.NONE, xp.BUFFERED, xp.FULL_DUPLEX_STREAMED):
            raise ValueError("request body mode must be none, buffered or full-duplex")

    async def serve(self, request: web.Request) -> web.StreamResponse:
        opts = self._opts
        target, stub = next(self._stubs)
        self._stats.by_extproc[target] += 1
        observer = opts.response_observer
        response_mode = xp.NONE if observer else opts.response_mode
        stream = ExtProcStream(stub, opts.request_mode, response_mode, opts.message_timeout_s)
        closed = False
        watcher: ObserverStream | None = None
        try:
            outcome = await self._request_path(stream, request, client_headers(request))
            if isinstance(outcome, Immediate):
                self._stats.immediate[outcome.status] += 1
                await stream.close()
                closed = True
                await _discard_body(request)
                return _immediate(outcome)
            destinations = self._destinations(stream, outcome.headers)
            has_body = request.body_exists or bool(outcome.body)
            if observer:
                # response headers SKIP, body NONE: the routing stream is done; the observer
                # filter, next in the chain, sees the routed request's headers
                await stream.close()
                closed = True
                watcher = await self._observe_request(outcome.headers, not has_body)
            upstream = await self._upstreams.open(
                request.method, destinations, outcome.headers, outcome.body if has_body else None
            )
            async with upstream.response:
                if watcher is not None:
                    out = await self._observed_response(watcher, request, upstream)
                else:
                    out = await self._response_path(stream, request, upstream)
            if watcher is not None:
                await watcher.close()
                watcher = None
            await stream.close()
            closed = True
            return out
        except ExtProcError as exc:
            self._stats.extproc_errors += 1
            log.warning("%s %s: %s", request.method, request.path, exc)
            return local_reply(500, f"ext_proc error: {exc}")
        except NoUpstream as exc:
            return local_reply(503, str(exc))
        except BodyTooLarge as exc:
            log.info("%s %s: %s", request.method, request.path, exc)
            if exc.status == 413:
                await _discard_body(request)
            return local_reply(exc.status, str(exc))
        except ConnectionResetError:
            # The client went away mid-response: reset the ext_proc stream, as Envoy does.
            log.debug("%s %s: client disconnected", request.method, request.path)
            raise asyncio.CancelledError from None
        finally:
            if not closed:
                stream.cancel()
            if watcher is not None:
                watcher.cancel()

    # --- request path ------------------------------------------------------------------

    async def _request_path(
        self, stream: ExtProcStream, request: web.Request, headers: HeaderList
    ) -> _Forward | Immediate:
        if stream.request_mode == xp.FULL_DUPLEX_STREAMED:
            return await self._request_full_duplex(stream, request, headers)
        has_body = request.body_exists
        await stream.write(xp.request_headers(headers, not has_body))
        common = xp.expect(await stream.read(), "request_headers")
        if isinstance(common, Immediate):
            return common
        headers.apply(common.header_mutation)
        limit = self._opts.buffer_limit_bytes
        body = await _read_bounded(request.content, limit, "request body", 413) if has_body else b""
        if has_body and stream.request_mode == xp.BUFFERED:
            await stream.write(xp.request_body(body, True))
            common = xp.expect(await stream.read(), "request_body")
            if isinstance(common, Immediate):
                return common
            headers.apply(common.header_mutation)
            body = _mutated(common.body_mutation, body)
            _check_length(headers, body, "request body reply")
        return _Forward(headers, body)

    async def _request_full_duplex(
        self, stream: ExtProcStream, request: web.Request, headers: HeaderList
    ) -> _Forward | Immediate:
        has_body = request.body_exists
        await stream.write(xp.request_headers(headers, not has_body))
        sender = (
            asyncio.create_task(_pump(stream.write, request.content, xp.request_body))
            if has_body
            else None
        )
        answered = False
        try:
            body = bytearray()
            headers_done, body_done, length_set = False, not has_body, False
            while not (headers_done and body_done):
                reply = await stream.read(self._opts.route_timeout_s)
                kind = reply.WhichOneof("response")
                if kind == "immediate_response":
                    answered = True
                    return xp.immediate_from(reply.immediate_response)
                if kind == "request_headers" and not headers_done:
                    touched = headers.apply(reply.request_headers.response.header_mutation)
                    length_set = "content-length" in touched
                    headers_done = True
                elif kind == "request_body" and headers_done and not body_done:
                    mutation = reply.request_body.response.body_mutation
                    if mutation.WhichOneof("mutation") != "streamed_response":
                        raise ExtProcError(
                            "ext_proc protocol error: FULL_DUPLEX_STREAMED body "
                            "reply without streamed_response"
                        )
                    body += mutation.streamed_response.body
                    body_done = mutation.streamed_response.end_of_stream
                    if len(body) > self._opts.buffer_limit_bytes:  # kept for a retry
                        raise BodyTooLarge(
                            "request body", self._opts.buffer_limit_bytes, 413
                        )
                else:
                    raise ExtProcError(
                        f"ext_proc protocol error: unexpected {kind} reply "
                        f"(headers replied: {headers_done})"
                    )
            if sender is not None:
                await sender
        finally:
            try:
                await _finish_task(sender)
            except ExtProcError:
                # the picker ended the stream with its ImmediateResponse while body chunks
                # were still being sent: the answer stands (Envoy drops those writes too)
                if not answered:
                    raise
        if not length_set:
            headers.remove("content-length")  # Envoy drops it: the body may have changed
        result = bytes(body)
        _check_length(headers, result, "request headers reply")
        return _Forward(headers, result)

    def _destinations(self, stream: ExtProcStream, headers: HeaderList) -> list[str]:
        value = stream.metadata.get(LB_NAMESPACE, DESTINATION_HEADER)
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if not value:
            value = headers.get(DESTINATION_HEADER) or ""
        out = [v.strip() for v in str(value).split(",") if v.strip()]
        if not out:
            raise ExtProcError(
                f"ext_proc named no destination (metadata {LB_NAMESPACE} or "
                f"header {DESTINATION_HEADER})"
            )
        return out

    # --- response path -----------------------------------------------------------------

    async def _observe_request(self, headers: HeaderList, end_of_stream: bool) -> ObserverStream:
        """The observer filter's stream (the next ext_proc host in turn, as Envoy's cluster
        picks one per stream) with the routed request's headers."""
        target, stub = next(self._stubs)
        self._stats.by_extproc[target] += 1
        watcher = ObserverStream(stub, self._opts.message_timeout_s)
        await watcher.send(xp.request_headers(headers, end_of_stream))
        return watcher

    async def _observed_response(
        self, watcher: ObserverStream, request: web.Request, upstream: Upstream
    ) -> web.StreamResponse:
        """The response passes unchanged; each piece goes to the observer as it is sent."""
        up = upstream.response
        headers = upstream_headers(up)
        has_body = _has_body(request.method, up)
        await watcher.send(xp.response_headers(headers, not has_body))
        out = _response(up.status, headers, upstream.address)
        await out.prepare(request)
        if has_body:
            await _pump(watcher.send, up.content, xp.response_body, forward=out.write)
        await out.write_eof()
        return out

    async def _response_path(
        self, stream: ExtProcStream, request: web.Request, upstream: Upstream
    ) -> web.StreamResponse:
        up = upstream.response
        headers = upstream_headers(up)
        has_body = _has_body(request.method, up)
        mode = stream.response_mode if has_body else xp.NONE
        await stream.write(xp.response_headers(headers, not has_body))
        sender = (
            asyncio.create_task(_pump(stream.write, up.content, xp.response_body))
            if mode == xp.FULL_DUPLEX_STREAMED
            else None
        )
        try:
            common = xp.expect(await stream.read(), "response_headers")
            if isinstance(common, Immediate):
                self._stats.immediate[common.status] += 1
                return _immediate(common)
            touched = headers.apply(common.header_mutation)
            status = up.status
            if mode == xp.BUFFERED:
                body = await _read_bounded(
                    up.content, self._opts.buffer_limit_bytes, "response body", 500
                )
                await stream.write(xp.response_body(body, True))
                common = xp.expect(await stream.read(), "response_body")
                if isinstance(common, Immediate):
                    self._stats.immediate[common.status] += 1
                    return _immediate(common)
                headers.apply(common.header_mutation)
                body = _mutated(common.body_mutation, body)
                return _response(status, headers, upstream.address, body)
            if mode != xp.NONE and "content-length" not in touched:
                headers.remove("content-length")  # streamed bodies may change length
            out = _response(status, headers, upstream.address)
            await out.prepare(request)
            if mode == xp.NONE:
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
            elif mode == xp.STREAMED:
                await self._streamed_body(stream, up, out)
            else:
                await self._full_duplex_body(stream, out)
                if sender is not None:
                    await sender
            await out.write_eof()
            return out
        finally:
            await _finish_task(sender)

    async def _streamed_body(
        self, stream: ExtProcStream, up: aiohttp.ClientResponse, out: web.StreamResponse
    ) -> None:
        ended = False
        while not ended:
            chunk = await up.content.readany()
            ended = not chunk or up.content.at_eof()
            await stream.write(xp.response_body(chunk, ended))
            common = xp.expect(await stream.read(), "response_body")
            if isinstance(common, Immediate):
                raise ExtProcError("ImmediateResponse after the response started; resetting")
            data = _mutated(common.body_mutation, chunk)
            if data:
                await out.write(data)

    async def _full_duplex_body(self, stream: ExtProcStream, out: web.StreamResponse) -> None:
        while True:
            reply = await stream.read(self._opts.route_timeout_s)
            kind = reply.WhichOneof("response")
            if kind != "response_body":
                raise ExtProcError(
                    f"ext_proc protocol error: {kind} while streaming the response body; resetting"
                )
            mutation = reply.response_body.response.body_mutation
            if mutation.WhichOneof("mutation") != "streamed_response":
                raise ExtProcError(
                    "ext_proc protocol error: FULL_DUPLEX_STREAMED body reply "
                    "without streamed_response"
                )
            if mutation.streamed_response.body:
                await out.write(mutation.streamed_response.body)
            if mutation.streamed_response.end_of_stream:
                return


class BaselineExchange:
    """Policies ``random`` and ``round-robin``: no ext_proc, a plain load balancer."""

    def __init__(
        self,
        pick: Callable[[], int],
        endpoints: Sequence[str],
        upstreams: Upstreams,
        buffer_limit_bytes: int = 0,
    ) -> None:
        if not endpoints:
            raise ValueError("baseline policies need --endpoints")
        self._buffer_limit = buffer_limit_bytes or DEFAULT_BUFFER_LIMIT_BYTES
        self._pick = pick
        self._endpoints = list(endpoints)
        self._upstreams = upstreams

    async def serve(self, request: web.Request) -> web.StreamResponse:
        first = self._pick()
        n = len(self._endpoints)
        order = [self._endpoints[(first + i) % n] for i in range(n)]
        headers = client_headers(request)
        try:
            body = (
                await _read_bounded(request.content, self._buffer_limit, "request body", 413)
                if request.body_exists
                else None
            )
            upstream = await self._upstreams.open(request.method, order, headers, body)
        except NoUpstream as exc:
            return local_reply(503, str(exc))
        except BodyTooLarge as exc:  # kept whole for a retry on the next server
            await _discard_body(request)
            return local_reply(exc.status, str(exc))
        async with upstream.response as up:
            out = _response(up.status, upstream_headers(up), upstream.address)
            await out.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:
                raise asyncio.CancelledError from None
            return out


def baseline_picker(policy: str, n: int, seed: int | None) -> Callable[[], int]:
    if policy == "random":
        rng = random.Random(seed)
        return lambda: rng.randrange(n)
    counter = itertools.count()
    return lambda: next(counter) % n
