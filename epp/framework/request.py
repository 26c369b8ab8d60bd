"""The request value the scheduler works on."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ApiKind(enum.Enum):
    """How a request's body is read (the paths of each: ``epp.request.apis``)."""

    COMPLETIONS = "completions"
    CHAT = "chat_completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"
    """Anthropic Messages."""
    GENERATE = "generate"
    """Engine-native token-in generation (SGLang ``/generate``, vLLM ``/inference/v1/generate``)."""
    AUXILIARY = "auxiliary"
    """An API routed by load and model, never keyed (tokenize, rerank, score, pooling,
    classify, audio, count_tokens, the operator's ``requestControl.loadRoutedPaths``)."""
    NONE = "none"
    """A request without a body (GET, health checks): routed by load alone."""

    @property
    def conversational(self) -> bool:
        """A reply extends the conversation as an assistant turn (chat, Responses, Messages)."""
        return self in _CONVERSATIONAL


_CONVERSATIONAL = frozenset((ApiKind.CHAT, ApiKind.RESPONSES, ApiKind.MESSAGES))

_STORED_OBJECT_PATH = re.compile(
    r"/v1/(?:responses/([^/]+)(?:/(?:cancel|input_items))?"
    r"|conversations(?:/([^/]+)(?:/items(?:/[^/]+)?)?)?)"
)
"""OpenAI's paths to objects a model server stores: a stored response (``GET``/``DELETE
/v1/responses/{id}``, ``POST .../cancel``, ``GET .../input_items``) and conversations
(``/v1/conversations[/{id}[/items[/{item_id}]]]``)."""


STORED_OBJECT_PREFIXES = ("/v1/responses/", "/v1/conversations")
"""What every stored-object path starts with (a cheap first test)."""
MAX_STORED_ID_CHARS = 256
"""An id of a stored object longer than this is neither learnt nor looked up (no model
server issues one; vLLM's are 37 characters)."""


def stored_object_id(path: str) -> str | None:
    """For a ``:path`` that addresses an object a model server stores (a stored response, a
    conversation): the object's id ('' when the path creates one, ``POST /v1/conversations``);
    None for any other path. Query string and trailing slash ignored."""
    if not path.startswith(STORED_OBJECT_PREFIXES):
        return None
    m = _STORED_OBJECT_PATH.fullmatch(path.partition("?")[0].rstrip("/"))
    if m is None:
        return None
    return m.group(1) or m.group(2) or ""


@dataclass(slots=True, frozen=True)
class InferenceRequest:
    """One parsed request.

    ``model`` is the name the model server will see (after any rewrite); when it names a LoRA
    adapter, ``adapter`` holds the same name so LoRA-aware plugins can match it against the
    adapters a server has loaded. ``prompt`` is the text the prefix index hashes: the prompt
    itself for completions, the flattened conversation for chat (see ``epp.request.flatten``).
    """

    request_id: str
    model: str
    prompt: str
    api: ApiKind = ApiKind.COMPLETIONS
    adapter: str = ""
    cache_salt: str = ""
    priority: int = 0
    objective: str = ""
    """The InferenceObjective the request named (``x-llm-d-inference-objective``, read only
    with ``--trust-control-headers``), '' when none: flow control reads its queue-time
    limit by it."""
    stream: bool = False
    original_model: str = ""
    """The ``model`` the client sent, when it was rewritten; responses map back to it."""
    headers: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """The request headers as Envoy sent them (lower-case names; repeated ones joined with
    commas), for plugins that read one (e.g. the conformance profile's endpoint selection).
    Read-only."""
    body: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The parsed JSON body (for producers that need more than the flattened prompt: the
    precise producer applies the model's chat template to ``messages``). Read-only."""
