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


class SessionAffinityScorer:
    def __init__(self, name: str, params: SessionAffinityParams) -> None:
        self.name = name
        self.params = params
        self._sessions: OrderedDict[str, tuple[EndpointId, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        zeros = [0.0] * len(endpoints)
        session = session_of(state.request, self.params)
        if not session:
            return zeros
        entry = self._sessions.get(session)
        if entry is None:
            return zeros
        target, seen_s = entry
        if state.now_s - seen_s > self.params.ttl_seconds:
            del self._sessions[session]
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

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        session = session_of(state.request, self.params)
        if not session:
            return
        sessions = self._sessions
        sessions[session] = (result.target.id, state.now_s)
        sessions.move_to_end(session)
        while len(sessions) > self.params.max_sessions:
            sessions.popitem(last=False)
