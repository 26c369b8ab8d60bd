"""Stored Responses, as vLLM keeps them with ``VLLM_ENABLE_RESPONSES_API_STORE=1``.

A response created with ``store`` (the request's default) is kept in this server's memory:
a later request names it with ``previous_response_id`` (its conversation, prompt and output,
is the new prompt's start), ``GET /v1/responses/{id}`` returns it, ``POST .../cancel`` stops
it while it runs in the background, ``DELETE`` forgets it (OpenAI's API; vLLM 0.32 has no
DELETE). Any other server answers 404 for it, as vLLM does: routing must bring these
requests home. Bounded: the oldest of ``max_entries`` is forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulator.emulator.openai import ApiError

CANCELLABLE = ("queued", "in_progress")
"""Statuses of a background response that ``cancel`` stops."""


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object as ``GET`` returns it (its ``status`` moves on)."""
    conversation: str
    """The prompt text of this response followed by its output: a follow-up's prompt starts
    with it."""
    cancel: Callable[[], None] | None = None
    """Stops a background response still running."""


class ResponseStore:
    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._entries[rid] = stored
        self._entries.move_to_end(rid)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse:
        """The stored response; ApiError 404 as vLLM words it when this server has none."""
        stored = self._entries.get(rid)
        if stored is None:
            raise ApiError(404, f"Response with id '{rid}' not found.", "response_id")
        return stored

    def pop(self, rid: str) -> StoredResponse:
        stored = self.get(rid)
        del self._entries[rid]
        return stored
