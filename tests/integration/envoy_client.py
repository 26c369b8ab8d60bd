"""Build exactly the ext_proc messages Envoy sends, and a small driver for one stream.

Envoy lower-cases header names and puts values in ``raw_value``; it sends
``protocol_config`` on the first message only; ``metadata_context`` carries the subset hint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

Mode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED
STREAMED = Mode.STREAMED
NONE = Mode.NONE


def header_map(headers: Mapping[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    extra: Mapping[str, str] | None = None,
    end_of_stream: bool = False,
    modes: tuple[int, int] | None = (FULL_DUPLEX, FULL_DUPLEX),
    subset: Sequence[str] | None = None,
    content_length: int | None = None,
) -> pb.ProcessingRequest:
    headers = {
        ":authority": "gateway.local",
        ":path": path,
        ":method": method,
        ":scheme": "http",
        "content-type": "application/json",
        "x-request-id": "req-1",
    }
    if content_length is not None:
        headers["content-length"] = str(content_length)
    headers.update(extra or {})
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if modes is not None:
        msg.protocol_config.request_body_mode = modes[0]
        msg.protocol_config.response_body_mode = modes[1]
    if subset is not None:
        st = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        lv = st.fields["x-gateway-destination-endpoint-subset"].list_value
        lv.SetInParent()
        for s in subset:
            lv.values.add().string_value = s
    return msg


def request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def request_trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=header_map({})))


def response_headers(
    status: int = 200, content_type: str = "application/json", end_of_stream: bool = False
) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=header_map({":status": str(status), "content-type": content_type}),
            end_of_stream=end_of_stream,
        )
    )


def response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers(trailers=header_map({})))


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def body_messages(data: bytes, size: int) -> list[pb.ProcessingRequest]:
    parts = chunks(data, size)
    return [request_body(p, i == len(parts) - 1) for i, p in enumerate(parts)]


class Stream:
    """One ext_proc stream, as Envoy holds it: write messages, read replies."""

    def __init__(
        self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] | None = None
    ) -> None:
        """``metadata``: the stream's gRPC metadata (the filter's ``initial_metadata``)."""
        self.call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=metadata)

    async def send(self, *msgs: pb.ProcessingRequest) -> None:
        for m in msgs:
            await self.call.write(m)

    async def send_all(self, msgs: Iterable[pb.ProcessingRequest]) -> None:
        for m in msgs:
            await self.call.write(m)

    async def recv(self) -> pb.ProcessingResponse:
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, "stream ended while a reply was expected"
        return reply  # type: ignore[no-any-return]

    async def recv_n(self, n: int) -> list[pb.ProcessingResponse]:
        return [await self.recv() for _ in range(n)]

    async def close(self) -> grpc.StatusCode:
        await self.call.done_writing()
        rest = await self.call.read()
        assert rest is grpc.aio.EOF, f"unexpected extra reply {rest}"
        return await self.call.code()  # type: ignore[no-any-return]


def header_value(mutation: pb.HeaderMutation, key: str) -> str | None:
    for opt in mutation.set_headers:
        if opt.header.key == key:
            return opt.header.raw_value.decode() or opt.header.value
    return None


def destination(reply: pb.ProcessingResponse) -> str | None:
    kind = reply.WhichOneof("response")
    common = getattr(reply, kind).response
    return header_value(common.header_mutation, "x-gateway-destination-endpoint")


def lb_metadata(reply: pb.ProcessingResponse) -> str | None:
    fields = reply.dynamic_metadata.fields
    if "envoy.lb" not in fields:
        return None
    inner = fields["envoy.lb"].struct_value.fields
    return inner["x-gateway-destination-endpoint"].string_value if "x-gateway-destination-endpoint" in inner else None
