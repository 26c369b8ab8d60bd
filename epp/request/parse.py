"""Parse an HTTP request (path, headers, body bytes) into one ``InferenceRequest``.

The parser owns everything that turns client input into the value the scheduler works on:
API path and its parser (``epp.request.apis``: the prompt key, what is validated), JSON or
form decoding, the model rewrite
(header ``x-gateway-model-name-rewrite`` first, then the configured table) with the body
re-serialized so the model server sees the served name, and the request's priority (header
``x-gateway-inference-objective`` resolved by a lookup callable, then per-model config).

Errors are domain errors whose message tells the client what is wrong; the message never
quotes prompt text.
"""

from __future__ import annotations

import json
import logging
import random
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.errors import BadRequest, NotFound, PayloadTooLarge
from epp.framework.request import ApiKind, InferenceRequest
from epp.request import jsondoc
from epp.request.apis import ApiParser, ApiRegistry, BodyFormat
from epp.request.multipart import Form, is_form, read_form
from epp.request.settings import ModelTarget, RequestControlConfig

# A ``\uD800``-``\uDFFF`` escape: the only way JSON text carries a lone surrogate. Searched
# only in a body the standard library read (orjson refuses lone surrogates, so a body it read
# holds none: this saves ~0.4 ns a byte, a third of the parse of a long prompt) and that holds
# a backslash at all (one memchr); bytes' own substring search of a 3-byte needle cost 20-40 us
# on a 16 KB prompt.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

log = logging.getLogger(__name__)

MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
OBJECTIVE_HEADERS = (OBJECTIVE_HEADER, "x-gateway-inference-objective")
MAX_OBJECTIVE_CHARS = 253
"""An objective is a Kubernetes object name (at most 253 characters)."""
"""llm-d's name first; the Inference Extension's ``x-gateway-`` name is its alias."""
PREFILLER_HEADER = "x-prefiller-host-port"
"""Set by epp on a request its P/D handler split: where the decoder's sidecar runs the
prefill (llm-d's name). Stripped from every client request, trusted or not."""
EXPLAIN_HEADER = "x-epp-explain"
"""``1`` asks for ``x-epp-pick-reason`` on the response (a control header: trusted only)."""
CONTROL_HEADER_EFFECTS = {
    MODEL_REWRITE_HEADER: "the model the request is served as",
    OBJECTIVE_HEADER: "its objective, hence its priority",
    OBJECTIVE_HEADERS[1]: "the same, by the Inference Extension's name",
    EXPLAIN_HEADER: "asks for x-epp-pick-reason on the response",
}
"""Headers that steer epp, and what each sets (``epp serve --help`` lists them from here)."""
CONTROL_HEADERS = tuple(CONTROL_HEADER_EFFECTS)
"""Headers that steer epp. Honoured only with ``trust_control_headers`` (a proxy in front
sets or strips them); otherwise a client could pick its own model or priority, or learn the
pool's endpoints from the pick's reason. Untrusted, they are removed from the request."""
REQUEST_ID_HEADER = "x-request-id"
MAX_ECHO_CHARS = 120
"""Client-supplied text quoted in an error message (a path, a header) is cut to this."""
MAX_REQUEST_ID_CHARS = 256

def first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` the request carries (a name and its aliases)."""
    for name in names:
        value = headers.get(name)
        if value is not None:
            return value
    return None


ObjectiveLookup = Callable[[str], "int | None"]
"""Objective name -> priority, or None when the objective is unknown."""


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    """The request value plus the body to forward (``body`` is the original bytes unless the
    model was rewritten, in which case it is the re-serialized JSON)."""

    request: InferenceRequest
    body: bytes
    body_rewritten: bool = False


def api_for_path(path: str) -> ApiKind | None:
    """The built-in API a ``:path`` names (query string and trailing slash ignored), or None."""
    api = _BUILTIN.lookup(path)
    return None if api is None else api.kind


_BUILTIN = ApiRegistry()


class RequestParser:
    def __init__(
        self,
        config: RequestControlConfig,
        objective_lookup: ObjectiveLookup | None = None,
        rng: random.Random | None = None,
        *,
        trust_control_headers: bool = False,
    ) -> None:
        self._config = config
        self.apis = ApiRegistry(config.load_routed_paths)
        self.trust_control_headers = trust_control_headers
        self.max_body_bytes = config.max_body_bytes
        self._rng = rng or random.Random()
        static = dict(config.objective_priorities)
        self._objective_lookup: ObjectiveLookup = objective_lookup or static.get

    def set_objective_lookup(self, lookup: ObjectiveLookup) -> None:
        """Plug in a dynamic source (e.g. Kubernetes InferenceObjectives)."""
        self._objective_lookup = lookup

    # --- before the body ---------------------------------------------------------------

    @property
    def served_endpoint_header(self) -> str:
        """The response header naming the endpoint routed to ('' = none: requestControl)."""
        return self._config.served_endpoint_header

    def explains(self, headers: Mapping[str, str]) -> bool:
        """The response should carry ``x-epp-pick-reason``: the config says so for every
        request, or a trusted request asks (``x-epp-explain: 1``)."""
        if self._config.pick_reason_header:
            return True
        return self.trust_control_headers and headers.get(EXPLAIN_HEADER, "").strip().lower() in ("1", "true", "yes")

    def check_headers(self, path: str, headers: Mapping[str, str]) -> ApiParser:
        """Validate what can be validated before the body arrives (the request has a body)."""
        api = self.apis.lookup(path)
        if api is None:
            raise NotFound(
                f"unknown API path {echo(path.partition('?')[0])}; epp serves "
                + self.apis.summary
            )
        length = headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()) or len(length) > 19:
                raise BadRequest(f"content-length {echo(length)} is not a byte count")
            if int(length) > self.max_body_bytes:
                raise PayloadTooLarge(self.too_large_message(int(length)))
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise BadRequest(
                f"request bodies with content-encoding {echo(encoding)} are not supported: "
                "send the JSON body uncompressed"
            )
        return api

    def too_large_message(self, size: int) -> str:
        return f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes"

    def headers_only(
        self, path: str, headers: Mapping[str, str], *, body_seen: bool = True
    ) -> InferenceRequest:
        """A request without a body: routed by load alone.

        ``body_seen``: epp knows the request has no body (Envoy ended the stream on the
        headers), as opposed to a body mode that does not send it. A POST to an inference API
        without a body is then a client error, not something to route.
        """
        if body_seen and headers.get(":method", "").upper() == "POST":
            api = self.apis.lookup(path)
            if api is not None and api.body_format is BodyFormat.JSON:
                raise BadRequest(
                    f"request body is empty: POST {echo(path.partition('?')[0])} needs a JSON "
                    "body"
                )
        return InferenceRequest(
            request_id=_request_id(headers),
            model=headers.get(MODEL_REWRITE_HEADER, "") if self.trust_control_headers else "",
            prompt="",
            api=ApiKind.NONE,
            priority=self._priority(headers, ""),
            objective=self._objective(headers),
            headers=headers,
        )

    # --- the body ----------------------------------------------------------------------

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedRequest:
        api = self.check_headers(path, headers)
        if len(body) > self.max_body_bytes:
            raise PayloadTooLarge(self.too_large_message(len(body)))
        if api.kind is ApiKind.NONE:  # a stored object: routed as a request without a body
            return ParsedRequest(self.headers_only(path, headers, body_seen=False), body)
        doc, form, surrogates = self._read(api, headers, body)
        model = _model_field(api, doc)
        prompt = api.prompt(doc)
        salt = doc.get("cache_salt", "")
        if salt is None:
            salt = ""
        if not isinstance(salt, str):
            raise BadRequest("'cache_salt' must be a string", param="cache_salt")

        if surrogates and b"\\" in body and _SURROGATE_ESCAPE.search(body) is not None:
            _check_encodable(prompt, "the prompt")
            _check_encodable(model, "'model'")
            _check_encodable(salt, "'cache_salt'")

        target = self._rewrite(model, headers) if model else model
        out_body = body
        rewritten = target != model
        if rewritten:
            if form is not None:
                out_body = form.replace(body, "model", target)
            else:
                doc["model"] = target
                out_body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        adapter = "" if not target or target in self._config.base_models else target
        if not model and api.adapter_field:
            named = doc.get(api.adapter_field)
            if isinstance(named, str) and named not in self._config.base_models:
                adapter = named

        request = InferenceRequest(
            request_id=_request_id(headers),
            model=target,
            prompt=prompt,
            api=api.kind,
            adapter=adapter,
            cache_salt=salt,
            priority=self._priority(headers, model, target),
            objective=self._objective(headers),
            stream=doc.get("stream") is True,
            original_model=model if rewritten else "",
            headers=headers,
            body=doc if form is None and doc else None,
        )
        return ParsedRequest(request, out_body, rewritten)

    def model_of(self, path: str, headers: Mapping[str, str], body: bytes) -> str:
        """The model a request names: its body's ``model`` (rewritten as ``parse`` would:
        the trusted rewrite header, the rewrite table), else the API's adapter field (a
        token-in API's ``lora_path``), else ``""``; without rendering its prompt (the model
        router's read: the prompt is the pool's epp's to check). Raises as ``parse`` does for
        the headers, the size, the JSON and the ``model`` field."""
        api = self.check_headers(path, headers)
        if len(body) > self.max_body_bytes:
            raise PayloadTooLarge(self.too_large_message(len(body)))
        if api.kind is ApiKind.NONE:
            return self.headers_only(path, headers, body_seen=False).model
        doc, _, surrogates = self._read(api, headers, body)
        model = _model_field(api, doc)
        named = doc.get(api.adapter_field) if not model and api.adapter_field else None
        model = named if isinstance(named, str) else self._rewrite(model, headers) if model else model
        if surrogates and b"\\" in body and _SURROGATE_ESCAPE.search(body) is not None:
            _check_encodable(model, "'model'")  # it becomes a header
        return model

    def _read(self, api: ApiParser, headers: Mapping[str, str],
              body: bytes) -> tuple[dict[str, Any], Form | None, bool]:  # fmt: skip
        """The body's fields (a JSON object, a form's text fields, or none for a body epp does
        not read), the form (to rewrite its model in place), and whether the fields may hold
        a lone surrogate."""
        content_type = headers.get("content-type", "")
        if api.body_format is BodyFormat.JSON or _reads_as_json(content_type):
            # a body that may be written back (a model rewrite) is read exactly, once
            forced = self.trust_control_headers and MODEL_REWRITE_HEADER in headers
            doc, surrogates = self._json(body, forced or bool(self._config.model_rewrites))
            return doc, None, surrogates
        if is_form(content_type):
            form = read_form(body, content_type)  # its fields are decoded as strict UTF-8
            return dict(form.fields), form, False
        return {}, None, False  # an operator's path with a body epp does not read

    def _json(self, body: bytes, exact: bool) -> tuple[dict[str, Any], bool]:
        """The JSON object in ``body`` (read exactly when it may be written back), and whether
        it may hold a lone surrogate."""
        try:
            doc, surrogates = jsondoc.read(body, exact)
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not valid UTF-8 (bad byte at offset {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise BadRequest(
                f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        except ValueError as exc:  # an integer of more than 4,300 digits
            raise BadRequest(f"request body is not usable JSON: {echo(str(exc))}") from None
        except RecursionError:
            raise BadRequest("request body is not usable JSON: nested too deeply") from None
        if not isinstance(doc, dict):
            raise BadRequest("request body must be a JSON object")
        return doc, surrogates

    def _rewrite(self, model: str, headers: Mapping[str, str]) -> str:
        forced = headers.get(MODEL_REWRITE_HEADER) if self.trust_control_headers else None
        if forced:
            return forced
        targets = self._config.model_rewrites.get(model)
        if not targets:
            return model
        if len(targets) == 1:
            return targets[0].model
        return _weighted(targets, self._rng)

    def _objective(self, headers: Mapping[str, str]) -> str:
        """The objective the request names (trusted headers only; bounded like a label)."""
        if not self.trust_control_headers:
            return ""
        return (first_header(headers, OBJECTIVE_HEADERS) or "")[:MAX_OBJECTIVE_CHARS]

    def _priority(self, headers: Mapping[str, str], *models: str) -> int:
        objective = first_header(headers, OBJECTIVE_HEADERS) if self.trust_control_headers else None
        if objective:
            prio = self._objective_lookup(objective)
            if prio is not None:
                return prio
            log.debug("unknown inference objective %r; using model priority", objective)
        for model in models:
            prio = self._config.model_priorities.get(model)
            if prio is not None:
                return prio
        return 0


def _weighted(targets: tuple[ModelTarget, ...], rng: random.Random) -> str:
    draw = rng.random() * sum(t.weight for t in targets)
    for t in targets:
        draw -= t.weight
        if draw < 0:
            return t.model
    return targets[-1].model


def _model_field(api: ApiParser, doc: Mapping[str, Any]) -> str:
    """The body's ``model``: ``""`` when absent and the API does not require it."""
    model = doc.get("model")
    if model is None:
        if api.model_required:
            raise BadRequest("missing 'model' in request body", param="model")
        return ""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def _request_id(headers: Mapping[str, str]) -> str:
    return headers.get(REQUEST_ID_HEADER, "")[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex


def echo(text: str) -> str:
    """Client text as it may appear in an error message or a log line: quoted, cut short."""
    if len(text) > MAX_ECHO_CHARS:
        return repr(text[:MAX_ECHO_CHARS]) + f" (cut, {len(text)} chars)"
    return repr(text)


def _check_encodable(text: str, what: str) -> None:
    """JSON may carry lone surrogate escapes (``"\\ud800"``) that are no UTF-8 text."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(
                f"{what} contains a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not "
                "valid Unicode text"
            ) from None


def _reads_as_json(content_type: str) -> bool:
    """No content-type, or a JSON one (``application/json``, ``...+json``)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return not media or media == "application/json" or media.endswith("+json")
