"""Domain errors. Each maps to one HTTP status in ``epp.extproc.errors`` (the only table)."""

from __future__ import annotations


class EppError(Exception):
    """Base of every error epp reports to a client. ``message`` is safe to show to the client."""

    def __init__(self, message: str, reason: str = "", dropped: str = "",
                 param: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        """A machine-readable cause (``queue-full``, ``queue-timeout``...), '' when the
        status says it all; shown as ``error.reason`` in the response body."""
        self.dropped = dropped
        """Why the request was dropped in llm-d's vocabulary (``DROPPED_*``), sent as the
        ``x-llm-d-request-dropped-reason`` response header; '' for errors that are not a
        shedding decision (a bad request, epp's own bounds)."""
        self.param = param
        """The request field at fault (OpenAI's ``error.param``: ``model``), '' for none."""


DROPPED_SATURATED = "rejected-saturated"
"""Shed because the pool is busy: a full queue, a place taken by a higher priority, a
sheddable request while saturated (HTTP 429)."""
DROPPED_TTL_EXPIRED = "rejected-ttl-expired"
"""Waited its queue-time limit while the pool had endpoints (HTTP 429)."""
DROPPED_NO_ENDPOINTS = "rejected-no-endpoints"
"""No endpoint can serve it: none ready, none left by the filters or the subset hint, or the
wait for the first ready one ran out or overflowed (HTTP 503)."""
DROPPED_SHUTTING_DOWN = "rejected-shutting-down"
"""Queued when epp received SIGTERM (HTTP 503)."""


class BadRequest(EppError):
    """The request body or headers cannot be understood (HTTP 400)."""


class NotFound(EppError):
    """Unknown API path (HTTP 404)."""


class PayloadTooLarge(EppError):
    """The request body exceeds the configured cap (HTTP 413)."""


class Overloaded(EppError):
    """The request was shed because the pool is saturated (HTTP 429)."""


class Unavailable(EppError):
    """No ready endpoint can take the request (HTTP 503)."""


class Internal(EppError):
    """A bug or an unexpected failure inside epp (HTTP 500)."""


class ConfigError(ValueError):
    """Bad configuration, raised at start-up. The message names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config field {field!r}: {problem}")
        self.field = field
        self.problem = problem
