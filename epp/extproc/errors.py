"""The error table: domain error -> HTTP status and the ImmediateResponse Envoy returns.

This is the only place a domain error becomes a status code. The body is OpenAI-shaped JSON,
``{"error": {"message": ..., "type": ..., "code": <status>}}``, except for an Anthropic
Messages request (``/v1/messages``, ``/v1/messages/count_tokens``), whose client reads
Anthropic's shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``, the
translation vLLM's own Messages endpoint makes of its handler's errors
(``vllm/entrypoints/anthropic/api_router.py``, ``translate_error_response``; checked against
real vLLM in tests/vllm/test_real_vllm.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from epp import errors
from epp.extproc.convert import FAIL_OPEN_HEADER


@dataclass(slots=True, frozen=True)
class ErrorKind:
    status: int
    type: str


ERROR_TABLE: dict[type[errors.EppError], ErrorKind] = {
    errors.BadRequest: ErrorKind(400, "invalid_request_error"),
    errors.NotFound: ErrorKind(404, "not_found_error"),
    errors.PayloadTooLarge: ErrorKind(413, "request_too_large"),
    errors.Overloaded: ErrorKind(429, "rate_limit_exceeded"),
    errors.Unavailable: ErrorKind(503, "service_unavailable"),
    errors.Internal: ErrorKind(500, "internal_error"),
}
_INTERNAL = ERROR_TABLE[errors.Internal]


def error_kind(error: BaseException) -> ErrorKind:
    """Status and type for ``error``; anything outside the hierarchy is an internal error."""
    for cls in type(error).__mro__:
        kind = ERROR_TABLE.get(cls)
        if kind is not None:
            return kind
    return _INTERNAL


ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
"""Paths whose error bodies take Anthropic's shape."""


def error_body(error: BaseException, path: str = "") -> bytes:
    """The JSON body of epp's answer to a request for ``path`` (its query ignored)."""
    kind = error_kind(error)
    message = error.message if isinstance(error, errors.EppError) else "internal error in epp"
    if path.partition("?")[0] in ANTHROPIC_PATHS:
        return json.dumps({"type": "error", "error": {"type": kind.type, "message": message}}).encode()
    body: dict[str, object] = {"message": message, "type": kind.type, "code": kind.status}
    reason = error.reason if isinstance(error, errors.EppError) else ""
    if reason:
        body["reason"] = reason
    param = error.param if isinstance(error, errors.EppError) else ""
    if param:
        body["param"] = param
    return json.dumps({"error": body}).encode()


DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
"""llm-d's response header for why a request was shed (``EppError.dropped``: its values are
llm-d's, ``epp.errors.DROPPED_*``); the body's ``error.reason`` gives epp's finer cause. The
table cause -> status -> header is in docs/serve.md ("Shedding")."""


def _header(key: str, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value))


def immediate_response(error: BaseException, path: str = "") -> pb.ProcessingResponse:
    """Envoy's answer to the client: ``error``'s status, its body for ``path``
    (:func:`error_body`), llm-d's dropped-reason header when it was shed."""
    kind = error_kind(error)
    headers = [_header("content-type", b"application/json")]
    dropped = error.dropped if isinstance(error, errors.EppError) else ""
    if dropped:
        headers.append(_header(DROPPED_REASON_HEADER, dropped.encode()))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=kind.status),
            # the route's fail-open marker (epp.envoyconfig) does not belong on epp's answer
            headers=pb.HeaderMutation(set_headers=headers, remove_headers=[FAIL_OPEN_HEADER]),
            body=error_body(error, path),
            details=f"epp_{kind.type}",
        )
    )
