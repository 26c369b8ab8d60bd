"""Protobuf <-> domain conversion for the ext_proc stream. No state, no decisions."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
NONE = BodySendMode.NONE
STREAMED = BodySendMode.STREAMED
BUFFERED = BodySendMode.BUFFERED
BUFFERED_PARTIAL = BodySendMode.BUFFERED_PARTIAL
FULL_DUPLEX_STREAMED = BodySendMode.FULL_DUPLEX_STREAMED


def headers_to_dict(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's header list as a dict of lower-case names (values from ``raw_value``); repeated
    names are joined with commas, in linear time however many there are."""
    out: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    for h in header_map.headers:
        raw = h.raw_value
        value = raw.decode("utf-8", "replace") if raw else h.value
        key = h.key.lower()
        first = out.get(key)
        if first is None:
            out[key] = value
        else:
            repeated.setdefault(key, [first]).append(value)
    for key, values in repeated.items():
        out[key] = ",".join(values)
    return out


def subset_hint(metadata: base_pb2.Metadata) -> list[str] | None:
    """The proxy's list of allowed ``ip:port``, or None when it sent no hint."""
    fm = metadata.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":  # tolerate a comma-separated string
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _lb_metadata(destination: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    return md


def _routing_common(
    destination: str, content_length: int | None, remove: Sequence[str] = ()
) -> pb.CommonResponse:
    headers = [_header(DESTINATION_HEADER, destination)]
    if content_length is not None:
        headers.append(_header("content-length", str(content_length)))
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=headers, remove_headers=remove),
        clear_route_cache=True,
    )


def routed_headers_response(
    destination: str, content_length: int | None = None, remove: Sequence[str] = ()
) -> pb.ProcessingResponse:
    """Reply to request headers carrying the routing decision (full duplex, header-only);
    ``remove``: request headers the upstream must not see."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=_routing_common(destination, content_length, remove)
        ),
        dynamic_metadata=_lb_metadata(destination),
    )


def routed_buffered_body_response(
    destination: str, body: bytes | None, remove: Sequence[str] = ()
) -> pb.ProcessingResponse:
    """BUFFERED mode: route in the body reply; replace the body only when it changed."""
    common = _routing_common(destination, None if body is None else len(body), remove)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=_lb_metadata(destination)
    )


def streamed_request_body(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def streamed_response_body(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def replaced_response_body(body: bytes, buffered: bool) -> pb.ProcessingResponse:
    """STREAMED/BUFFERED response mode: replace this chunk (and fix content-length if whole)."""
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))
    if buffered:
        common.header_mutation.set_headers.append(_header("content-length", str(len(body))))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


REQUEST_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
REQUEST_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
REQUEST_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
