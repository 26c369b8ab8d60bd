"""The request value the scheduler works on."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ApiKind(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat_completions"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    NONE = "none"
    """A request without a body (GET, health checks): routed by load alone."""


API_PATHS: dict[str, ApiKind] = {
    "/v1/completions": ApiKind.COMPLETIONS,
    "/v1/chat/completions": ApiKind.CHAT,
    "/v1/responses": ApiKind.RESPONSES,
    "/v1/embeddings": ApiKind.EMBEDDINGS,
}


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
