"""The proxy side of one ext_proc stream: build Envoy's messages, read the server's replies.

One gRPC ``Process`` call per HTTP request, as Envoy opens it. The first message carries
``protocol_config`` (the body modes), later ones do not. Replies are read in order; a
reply that does not fit the phase is a protocol error, which the gateway turns into a 500
(Envoy with ``failure_mode_allow: false`` does the same).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from simulator.gateway.headers import HeaderList

log = logging.getLogger(__name__)

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
NONE = BodyMode.NONE
STREAMED = BodyMode.STREAMED
BUFFERED = BodyMode.BUFFERED
FULL_DUPLEX_STREAMED = BodyMode.FULL_DUPLEX_STREAMED

MODE_NAMES: dict[str, int] = {
    "none": NONE,
    "streamed": STREAMED,
    "buffered": BUFFERED,
    "full-duplex": FULL_DUPLEX_STREAMED,
}


class ExtProcError(Exception):
    """The ext_proc server failed, timed out or broke the protocol (HTTP 500 to the client)."""


@dataclass(slots=True, frozen=True)
class Immediate:
    """The server answered the client itself."""

    status: int
    headers: HeaderList
    body: bytes
    details: str


@dataclass(slots=True)
class Metadata:
    """Dynamic metadata the server returned, merged across replies (namespace -> fields)."""

    namespaces: dict[str, dict[str, Any]] = field(default_factory=dict)

    def merge(self, md: struct_pb2.Struct) -> None:
        for ns, value in md.fields.items():
            inner = self.namespaces.setdefault(ns, {})
            if value.WhichOneof("kind") == "struct_value":
                for k, v in value.struct_value.fields.items():
                    inner[k] = _plain(v)

    def get(self, namespace: str, key: str) -> Any:
        return self.namespaces.get(namespace, {}).get(key)


def _plain(v: struct_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return v.string_value
    if kind == "list_value":
        return [_plain(x) for x in v.list_value.values]
    if kind == "struct_value":
        return {k: _plain(x) for k, x in v.struct_value.fields.items()}
    if kind == "number_value":
        return v.number_value
    if kind == "bool_value":
        return v.bool_value
    return None


def immediate_from(reply: pb.ImmediateResponse) -> Immediate:
    headers = HeaderList()
    headers.apply(reply.headers)
    status = reply.status.code or 200
    return Immediate(status, headers, reply.body, reply.details)


class ExtProcStream:
    """One ``Process`` call. ``read`` returns the next reply, or raises ``ExtProcError``."""

    def __init__(
        self,
        stub: pb_grpc.ExternalProcessorStub,
        request_mode: int,
        response_mode: int,
        message_timeout_s: float,
    ) -> None:
        self._call = stub.Process()
        self._first = True
        self.request_mode = request_mode
        self.response_mode = response_mode
        self.timeout_s = message_timeout_s
        self.metadata = Metadata()

    async def write(self, msg: pb.ProcessingRequest) -> None:
        if self._first:
            self._first = False
            msg.protocol_config.request_body_mode = self.request_mode
            msg.protocol_config.response_body_mode = self.response_mode
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ExtProcError(f"ext_proc write failed: {_describe(exc)}") from None

    async def read(self, timeout_s: float | None = -1.0) -> pb.ProcessingResponse:
        """Next reply. ``timeout_s=-1`` uses the message timeout, ``None`` waits forever."""
        limit = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            # asyncio.timeout, not wait_for: wait_for wraps each read in a task of its own
            async with asyncio.timeout(limit):
                reply = await self._call.read()
        except TimeoutError:
            raise ExtProcError(f"ext_proc reply timed out after {limit}s") from None
        except grpc.aio.AioRpcError as exc:
            raise ExtProcError(f"ext_proc stream failed: {_describe(exc)}") from None
        if reply is grpc.aio.EOF:
            raise ExtProcError("ext_proc server closed the stream while a reply was due")
        if reply.HasField("dynamic_metadata"):
            self.metadata.merge(reply.dynamic_metadata)
        return reply

    async def close(self) -> None:
        """Half-close as Envoy does when the HTTP exchange is complete, then drain."""
        if self._call.done():
            # over already: e.g. a body write in flight was cancelled after an
            # ImmediateResponse, which cancels the call (reading it would raise CancelledError)
            return
        try:
            await self._call.done_writing()
            while await asyncio.wait_for(self._call.read(), self.timeout_s) is not grpc.aio.EOF:
                pass
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class ObserverStream:
    """A ``Process`` call of an ext_proc filter in ``observability_mode``: every message is
    sent without waiting for a reply (epp sends none) and a failure never fails the HTTP
    exchange (Envoy's "send and go"); after the first failure the rest is dropped."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub, close_timeout_s: float) -> None:
        self._call = stub.Process()
        self._first = True
        self._broken = False
        self._close_timeout_s = close_timeout_s

    async def send(self, msg: pb.ProcessingRequest) -> None:
        if self._broken:
            return
        msg.observability_mode = True
        if self._first:
            self._first = False
            msg.protocol_config.request_body_mode = NONE
            msg.protocol_config.response_body_mode = STREAMED
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._broken = True
            log.info("ext_proc observer stream failed: %s", _describe(exc))

    async def close(self) -> None:
        """Half-close and let the server end the call (Envoy's deferred close)."""
        if self._broken or self._call.done():
            return
        try:
            await self._call.done_writing()
            async with asyncio.timeout(self._close_timeout_s):
                while await self._call.read() is not grpc.aio.EOF:
                    pass
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__


# --- messages Envoy sends ---------------------------------------------------------------


def request_headers(headers: HeaderList, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers.to_proto(), end_of_stream=end_of_stream)
    )


def request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers(headers: HeaderList, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=headers.to_proto(), end_of_stream=end_of_stream)
    )


def response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def expect(reply: pb.ProcessingResponse, kind: str) -> pb.CommonResponse | Immediate:
    """The ``CommonResponse`` of a reply of ``kind``, or the server's ImmediateResponse."""
    got = reply.WhichOneof("response")
    if got == "immediate_response":
        return immediate_from(reply.immediate_response)
    if got != kind:
        raise ExtProcError(f"ext_proc protocol error: expected a {kind} reply, got {got}")
    common: pb.CommonResponse = getattr(reply, kind).response
    return common
