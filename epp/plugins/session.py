"""``session-affinity-scorer``: keep a session on the endpoint that served its last request,
until that endpoint saturates.

An agent's session grows its context with every turn; the endpoint that served the last
turn holds all of it, while the prefix index may know only part (a reply it never saw, a
tool output). The session identity is the first of ``headers`` the request carries, else
the first of ``bodyFields`` (dotted paths into the JSON body, e.g. ``user`` or
``metadata.session_id``). The endpoint that served the session's last request scores 1 and
the others 0, unless it is saturated (more than ``queueThreshold`` waiting, or KV use above
``kvCacheThreshold``): then no endpoint is preferred, and the other scores move the session
(its next request follows it there). A request without a session, or whose session has not
been seen within ``ttlSeconds``, scores 0 everywhere (no effect). At most ``maxSessions``
sessions are remembered, the least recently used forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import Pool
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PickResult

MAX_SESSION_CHARS = 256
"""Longer identities are cut (a client cannot make epp hold large keys)."""


def _default_headers() -> list[str]:
    return ["x-session-id"]


@dataclass(slots=True, frozen=True)
class SessionAffinityParams:
    headers: list[str] = field(default_factory=_default_headers)
    """Request headers carrying the session identity, in order of preference."""
    body_fields: list[str] = field(default_factory=list)
    """Dotted paths into the request body tried after the headers (e.g. ``user``)."""
    ttl_seconds: float = 600.0
    """A session unseen this long is forgotten."""
    max_sessions: int = 100_000
    """Sessions remembered at most (least recently used forgotten first)."""
    queue_threshold: int = 5
    """The session's endpoint yields when more requests than this wait there."""
    kv_cache_threshold: float = 0.9
    """The session's endpoint yields when its KV-cache use is above this."""
    __config_min__: ClassVar[dict[str, float]] = {"max_sessions": 1}


def session_of(request: InferenceRequest, params: SessionAffinityParams) -> str:
    """The request's session identity ('' when it carries none)."""
    headers = request.headers
    for name in params.headers:
        value = headers.get(name.lower())
        if value:
            return value[:MAX_SESSION_CHARS]
    body = request.body
    if body is not None:
        for path in params.body_fields:
            value = _dig(body, path)
            if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
                return f"{path}={value}"[:MAX_SESSION_CHARS]
    return ""


def _dig(body: Mapping[str, Any], path: str) -> Any:
    node: Any = body
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


class SessionTable:
    """Sessions seen recently: where each one's last request went, when, and how many requests
    it has made. Least recently seen first, at most ``max_sessions``; a session unseen for
    ``window_s`` is forgotten, on lookup (``get``) or from the front (``expire``, ``record``).
    ``on`` counts the sessions held per endpoint and ``requests`` their requests so far."""

    __slots__ = ("_entries", "max_sessions", "on", "requests", "window_s")

    def __init__(self, window_s: float, max_sessions: int) -> None:
        self.window_s = window_s
        self.max_sessions = max_sessions
        self._entries: OrderedDict[str, tuple[EndpointId, float, int]] = OrderedDict()
        self.on: dict[EndpointId, int] = {}
        self.requests = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: str) -> bool:
        return session in self._entries

    def get(self, session: str, now_s: float) -> EndpointId | None:
        """Where the session's last request went, or None (unknown, or unseen too long:
        then it is forgotten)."""
        entry = self._entries.get(session)
        if entry is None:
            return None
        if now_s - entry[1] > self.window_s:
            self._drop(session)
            return None
        return entry[0]

    def record(self, session: str, target: EndpointId, now_s: float) -> None:
        """The session's request went to ``target`` at ``now_s``."""
        old = self._entries.pop(session, None)
        count = 1
        if old is not None:
            self._uncount(old[0], old[2])
            count += old[2]
        self._entries[session] = (target, now_s, count)
        self.on[target] = self.on.get(target, 0) + 1
        self.requests += count
        self.expire(now_s)

    def expire(self, now_s: float) -> None:
        """Forget, from the least recently seen, sessions past the window or the bound."""
        entries = self._entries
        limit = now_s - self.window_s
        while entries:
            session, (_, seen_s, _) = next(iter(entries.items()))
            if seen_s >= limit and len(entries) <= self.max_sessions:
                break
            self._drop(session)

    def mean_requests(self) -> float:
        """The mean number of requests the sessions held have made so far (0 when none)."""
        return self.requests / len(self._entries) if self._entries else 0.0

    def _drop(self, session: str) -> None:
        target, _, count = self._entries.pop(session)
        self._uncount(target, count)

    def _uncount(self, target: EndpointId, count: int) -> None:
        self.requests -= count
        left = self.on.get(target, 0) - 1
        if left > 0:
            self.on[target] = left
        else:
            self.on.pop(target, None)


class SessionAffinityScorer:
    def __init__(self, name: str, params: SessionAffinityParams) -> None:
        self.name = name
        self.params = params
        self._sessions = SessionTable(params.ttl_seconds, params.max_sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        zeros = [0.0] * len(endpoints)
        session = session_of(state.request, self.params)
        if not session:
            return zeros
        target = self._sessions.get(session, state.now_s)
        if target is None:
            return zeros
        p = self.params
        for i, e in enumerate(endpoints):
            if e.id == target:
                m = e.metrics
                if m.known and (e.queue > p.queue_threshold or m.kv_usage > p.kv_cache_threshold):
                    return zeros  # saturated: let the other scores move the session
                zeros[i] = 1.0
                return zeros
        return zeros  # its endpoint is gone or filtered out

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The session's endpoint."""
        session = session_of(state.request, self.params)
        target = self._sessions.get(session, state.now_s) if session else None
        e = pool.get(target) if target is not None else None
        return [e] if e is not None else []

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        session = session_of(state.request, self.params)
        if session:
            self._sessions.record(session, result.target.id, state.now_s)
