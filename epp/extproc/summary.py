"""The end of each exchange, from Envoy's gRPC access log (``epp envoy-config``'s default
response mode, ``summary``).

Reading a streamed answer costs epp one ext_proc message per event (one per token with vLLM
and SGLang), each read and answered in Python: its CPU grew with the answer's length. With
the summary, epp reads only what it needs as it happens and Envoy reports the rest once:

1. The routing filter sends the response headers and body chunks (``STREAMED``). epp notes
   the first body bytes (the first-token time: the predicted-TTFT scorer's queue and its
   fit, the token load's prefill) and, for a 2xx SSE answer, ends its stream right after
   answering that chunk; Envoy passes the rest of the answer to the client without epp
   (``RequestStream.ended``). JSON answers, which come in a chunk or two, are read to the
   end as before, and so is an answer whose model name epp maps back.
2. Envoy's ``ai_protocol_manager`` filter reads ``usage`` from the answer as it streams by
   (C++, bounded, no buffering) and publishes it as typed metadata
   (``envoy.data.ai.v3.TokenUsage`` under ``envoy.ai.token_usage``).
3. Envoy's gRPC access log (``envoy.service.accesslog.v3.AccessLogService``, on epp's
   ext_proc port) sends one entry per request epp routed, each as it is written (or batched
   for ``--summary-flush-s``): the request's token (``epp.token`` metadata, set by epp's routing
   reply), the status, the body bytes, whether the exchange ended early (response flags),
   and the usage. :class:`AccessLogReceiver` ends the request with it
   (``ResponseHandoff.summarized``): usage, cached tokens and the first-token time reach the
   scheduler as before; the reply's text does not (docs/envoy.md gives what that costs).

The proxy says it sends the summary with gRPC metadata on the routing stream
(``x-epp-response: summary``); without it, or while no entry for this replica's requests has
come lately (``ResponseHandoff.summaries_live``: several replicas without index sync, or a
proxy whose access log does not reach epp), every answer is read to the end as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

from epp.extproc.convert import TOKEN_KEY, TOKEN_NAMESPACE
from epp.extproc.observer import ResponseHandoff
from epp.framework.types import ResponseInfo

log = logging.getLogger(__name__)

SUMMARY_METADATA = ("x-epp-response", "summary")
"""The routing stream's gRPC metadata that declares the summary (``epp envoy-config``)."""
USAGE_NAMESPACE = "envoy.ai.token_usage"
_USAGE_TYPE = "type.googleapis.com/envoy.data.ai.v3.TokenUsage"
MAX_TOKENS = 1 << 31
"""Token counts above this are read as absent (0), as in ``epp.requestcontrol.response``."""


def _token_usage_class() -> Any:
    """``envoy.data.ai.v3.TokenUsage`` (Envoy 1.40, api/envoy/data/ai/v3/token_usage.proto)
    as far as epp reads it: input, output and cached tokens, by their field numbers, in a
    private descriptor pool (the Envoy protos epp installs predate it; a pool of its own
    cannot clash with a later one that has it)."""
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    f = descriptor_pb2.FileDescriptorProto(
        name="epp/extproc/token_usage.proto", package="epp.envoy_ai", syntax="proto3",
        dependency=["google/protobuf/wrappers.proto"],
    )  # fmt: skip
    count = ".google.protobuf.UInt64Value"

    def field(msg: Any, name: str, number: int, type_name: str) -> None:
        msg.field.add(name=name, number=number, type_name=type_name,
                      type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)  # fmt: skip

    details = f.message_type.add(name="InputTokenDetails")
    field(details, "cached_tokens", 1, count)
    usage = f.message_type.add(name="TokenUsage")
    field(usage, "input_tokens", 3, count)
    field(usage, "output_tokens", 4, count)
    field(usage, "input_token_details", 6, ".epp.envoy_ai.InputTokenDetails")
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("epp.envoy_ai.TokenUsage"))


TokenUsage = _token_usage_class()

_ENDED_EARLY = (
    "downstream_connection_termination",
    "upstream_connection_termination",
    "upstream_remote_reset",
    "local_reset",
    "stream_idle_timeout",
    "downstream_remote_reset",
)
"""Response flags that mean the answer did not reach its end (the client left, the server
or Envoy reset the stream): the request counts as ``cancelled``, as a stream through epp
that ends before its response does."""


def declared(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether a routing stream's gRPC metadata declares the summary."""
    key, value = SUMMARY_METADATA
    return any(k == key and v == value for k, v in metadata or ())


def _count(value: Any) -> int:
    n = int(value.value)
    return n if 0 <= n <= MAX_TOKENS else 0


def summary_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> tuple[str, ResponseInfo | None]:
    """The token an entry names (empty: not a request epp routed) and what it says of the
    exchange: None when it ended before its response did."""
    common = entry.common_properties
    metadata = common.metadata
    if TOKEN_NAMESPACE not in metadata.filter_metadata:
        return "", None
    fields = metadata.filter_metadata[TOKEN_NAMESPACE].fields
    token = fields[TOKEN_KEY].string_value if TOKEN_KEY in fields else ""
    if not token:
        return "", None
    flags = common.response_flags
    if any(getattr(flags, name) for name in _ENDED_EARLY):
        return token, None
    info = ResponseInfo(
        status=entry.response.response_code.value,
        response_bytes=entry.response.response_body_bytes,
    )
    typed = metadata.typed_filter_metadata
    if USAGE_NAMESPACE in typed and typed[USAGE_NAMESPACE].type_url == _USAGE_TYPE:
        try:
            usage = TokenUsage.FromString(typed[USAGE_NAMESPACE].value)
        except Exception:  # a malformed record: the exchange still ended
            log.debug("unreadable token usage in an access log entry")
            return token, info
        details = usage.input_token_details
        cached = _count(details.cached_tokens) if details.HasField("cached_tokens") else None
        info = ResponseInfo(
            status=info.status, prompt_tokens=_count(usage.input_tokens),
            cached_tokens=cached, completion_tokens=_count(usage.output_tokens),
            response_bytes=info.response_bytes,
        )  # fmt: skip
    return token, info


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """``envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs``: Envoy's summary of
    each exchange epp routed (a long-lived stream per Envoy worker, entries batched)."""

    def __init__(self, handoff: ResponseHandoff) -> None:
        self.handoff = handoff
        self.entries = 0
        """Entries read (for tests and the logs)."""

    async def StreamAccessLogs(self, request_iterator: Any, context: Any) -> Any:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self.entries += 1
                try:
                    token, info = summary_of(entry)
                    if token:
                        self.handoff.summarized(token, info)
                except Exception:  # a bug: keep the stream and the other entries
                    log.exception("reading an access log entry failed")
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(receiver: AccessLogReceiver, server: Any) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
