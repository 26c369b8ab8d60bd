"""The APIs epp understands: one parser per API, registered by request path.

A parser says what kind of API a path is, how its body is read, whether ``model`` is
required, and renders the prompt key (``''`` for an API routed by load and model alone). The
request parser (``epp.request.parse``) does the rest the same way for every API: size caps,
JSON decoding, ``model`` and its rewrite, ``cache_salt``, priority. Adding an API is one
entry in :data:`BUILTIN` (or, for a path routed by load, one line of the operator's
``requestControl.loadRoutedPaths``); docs/apis.md lists them all.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from epp.errors import BadRequest
from epp.framework.request import ApiKind, stored_object_id
from epp.request import flatten
from epp.request.messages import messages_prompt
from epp.request.native import sglang_generate_prompt, vllm_generate_prompt


class BodyFormat(enum.Enum):
    JSON = "json"
    """A JSON object; anything else is a 400."""
    BY_CONTENT_TYPE = "by-content-type"
    """``multipart/form-data``: its text fields; JSON (or no content-type): the object;
    any other content-type: not read (routed by load, without a model)."""


class ApiParser(Protocol):
    """How epp reads one API's request body."""

    @property
    def kind(self) -> ApiKind: ...

    @property
    def body_format(self) -> BodyFormat: ...

    @property
    def model_required(self) -> bool:
        """A body without ``model`` is a 400 (else it is routed as no model)."""
        ...

    @property
    def adapter_field(self) -> str:
        """A body field that names the LoRA adapter when ``model`` does not ('' = none)."""
        ...

    def prompt(self, doc: Mapping[str, Any]) -> str:
        """The text the prefix index hashes, rendered in the order the model server's chat
        template renders the request ('' = routed by load). Raises BadRequest naming the
        field of a body the server would reject for its shape."""
        ...


@dataclass(slots=True, frozen=True)
class KeyedApi:
    """An API whose prompt is keyed: ``render(body)`` is its key text."""

    kind: ApiKind
    render: Callable[[Mapping[str, Any]], str]
    model_required: bool = True
    adapter_field: str = ""
    body_format: BodyFormat = BodyFormat.JSON

    def prompt(self, doc: Mapping[str, Any]) -> str:
        return self.render(doc)


@dataclass(slots=True, frozen=True)
class LoadRoutedApi:
    """An API routed by load and model, never keyed."""

    kind: ApiKind = ApiKind.AUXILIARY
    model_required: bool = False
    adapter_field: str = ""
    body_format: BodyFormat = BodyFormat.BY_CONTENT_TYPE

    def prompt(self, doc: Mapping[str, Any]) -> str:
        return ""


def require(doc: Mapping[str, Any], key: str) -> Any:
    value = doc.get(key)
    if value is None:
        raise BadRequest(f"missing '{key}' in request body")
    return value


def _completions(doc: Mapping[str, Any]) -> str:
    return flatten.completion_prompt(require(doc, "prompt"))


def _chat(doc: Mapping[str, Any]) -> str:
    return flatten.chat_prompt(require(doc, "messages"), doc.get("tools"))


def _responses(doc: Mapping[str, Any]) -> str:
    return flatten.responses_prompt(require(doc, "input"), doc.get("instructions"), doc.get("tools"))


def _embeddings(doc: Mapping[str, Any]) -> str:
    return flatten.embeddings_prompt(require(doc, "input"))


def _messages(doc: Mapping[str, Any]) -> str:
    require(doc, "messages")
    return messages_prompt(doc)


_LOAD_ROUTED = LoadRoutedApi()
STORED_OBJECT = LoadRoutedApi(kind=ApiKind.NONE)
"""A stored response or conversation: its body is not parsed, the request is routed as one
without a body."""

BUILTIN: Mapping[str, ApiParser] = MappingProxyType({
    # keyed: the prompt decides where the cache is
    "/v1/completions": KeyedApi(ApiKind.COMPLETIONS, _completions),
    "/v1/chat/completions": KeyedApi(ApiKind.CHAT, _chat),
    "/v1/responses": KeyedApi(ApiKind.RESPONSES, _responses),
    "/v1/embeddings": KeyedApi(ApiKind.EMBEDDINGS, _embeddings),
    "/v1/messages": KeyedApi(ApiKind.MESSAGES, _messages),
    "/generate": KeyedApi(ApiKind.GENERATE, sglang_generate_prompt, model_required=False,
                          adapter_field="lora_path"),
    "/inference/v1/generate": KeyedApi(ApiKind.GENERATE, vllm_generate_prompt,
                                       model_required=False),
    # routed by load and model (vLLM 0.32's and SGLang's routers)
    "/v1/messages/count_tokens": LoadRoutedApi(model_required=True),
    "/tokenize": _LOAD_ROUTED,
    "/detokenize": _LOAD_ROUTED,
    "/v1/rerank": _LOAD_ROUTED,
    "/v2/rerank": _LOAD_ROUTED,
    "/rerank": _LOAD_ROUTED,
    "/v1/score": _LOAD_ROUTED,
    "/score": _LOAD_ROUTED,
    "/pooling": _LOAD_ROUTED,
    "/classify": _LOAD_ROUTED,
    "/v2/embed": _LOAD_ROUTED,
    "/encode": _LOAD_ROUTED,
    "/v1/audio/transcriptions": _LOAD_ROUTED,
    "/v1/audio/translations": _LOAD_ROUTED,
})  # fmt: skip


def normalize_path(path: str) -> str:
    """``:path`` without its query string and trailing slash."""
    path = path.partition("?")[0]
    if len(path) > 1:
        path = path.rstrip("/")
    return path


class ApiRegistry:
    """The parsers by path: :data:`BUILTIN` plus the operator's load-routed paths."""

    __slots__ = ("_parsers",)

    def __init__(self, load_routed_paths: Iterable[str] = ()) -> None:
        parsers = dict(BUILTIN)
        for path in load_routed_paths:
            parsers.setdefault(normalize_path(path), _LOAD_ROUTED)
        self._parsers = parsers

    def lookup(self, path: str) -> ApiParser | None:
        """The parser of a ``:path`` (query string and trailing slash ignored), or None. A
        path to an object a model server stores (``/v1/responses/{id}``, ``.../cancel``,
        ``/v1/conversations...``) is :data:`STORED_OBJECT`: routed without reading its body
        (the response-affinity filter sends it home)."""
        api = self._parsers.get(normalize_path(path))
        if api is None and stored_object_id(path) is not None:
            return STORED_OBJECT
        return api

    @property
    def paths(self) -> list[str]:
        return sorted(self._parsers)

    @property
    def summary(self) -> str:
        """The keyed paths and how many more are routed by load (for a 404's message)."""
        keyed = sorted(p for p, api in self._parsers.items() if not isinstance(api, LoadRoutedApi))
        return (f"{', '.join(keyed)} and {len(self._parsers) - len(keyed)} APIs routed by load "
                "(docs/apis.md)")  # fmt: skip
