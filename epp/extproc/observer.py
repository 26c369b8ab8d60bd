"""Responses observed on a second ext_proc stream (``epp serve --response-observer``).

A streamed reply reaches an ext_proc server one message per chunk, and in the usual setup
Envoy waits for epp's answer to each before it forwards the chunk: epp is on the path of
every token and spends about half of its CPU on those replies. Envoy can instead run a second
ext_proc filter in ``observability_mode`` ("send and go"): it sends the response to epp
without waiting and ignores any reply. That filter cannot route, so the work is split:

1. The routing filter (request headers and body; response headers SKIP, body NONE) gets the
   pick as today. epp adds ``x-epp-observe: <token>`` to the request's header mutation and
   hands the request, still in flight, to :class:`ResponseHandoff` under that token.
2. The observer filter, after the routing one in the chain (request headers SEND, request
   body NONE, response headers SEND, response body STREAMED, ``observability_mode: true``)
   sends the request headers with the token, then the response. Its stream claims the
   request and does what the routing stream would have done with the response: first-token
   time, ``usage``, the reply text, releasing the in-flight count.

A token nobody claims within ``wait_s`` (the observer filter is missing, or Envoy answered
the client itself) releases its request as ``unobserved`` and is logged, so a misconfigured
proxy costs a warning, not a leaked in-flight count. Tokens are epp's own (a random prefix
and a counter): a client cannot name another request's token, and the routing filter
overwrites any ``x-epp-observe`` a client sent.

The same table serves the default bootstrap's response summary (``epp.extproc.summary``):
there the routing stream itself stops after a streamed answer's first bytes and leaves the
request here (``await_summary``) until an entry of Envoy's access log, on this replica or a
peer, reports the exchange's end (``summarized``).

Several replicas: Envoy picks an ext_proc host per stream, so the observer stream may reach
a replica that did not route. With index sync on (docs/sync.md), that replica reads the
response as the router would and sends what it saw to its peers as ``Observation``
messages (claimed, first bytes, finished or ended) on the sync stream; the replica that
issued the token applies them to its request (``apply_remote``) and the others ignore them.
A remotely claimed request waits up to ``REMOTE_WAIT_S`` for its end (a peer that vanished
mid-response). Without sync, such a stream is counted in ``foreign`` and warned of.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from epp.extproc.convert import OBSERVE_HEADER
from epp.framework.observation import Kind, Observation, Publish
from epp.framework.types import ResponseInfo
from epp.requestcontrol.director import Director, Routing

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_WAIT_S", "OBSERVE_HEADER", "REMOTE_WAIT_S", "SUMMARY_LIVE_S", "Kind",
           "Observation", "Publish", "ResponseHandoff"]

DEFAULT_WAIT_S = 10.0
"""How long a routed request waits for its observer stream (normally it comes within ms:
the observer filter sees the request headers as soon as the routing filter lets them go)."""
_WARN_EVERY_S = 60.0
REMOTE_WAIT_S = 900.0
"""How long a request another replica observes, or whose end the access log reports, may
take to end (then: ``unobserved``)."""
SUMMARY_LIVE_S = 30.0
"""A replica leaves streamed answers' ends to the access log while entries for its own
requests have come within this long (``summaries_live``)."""


_TOKEN = re.compile(r"[0-9a-f]{12}-[0-9a-f]{1,16}")
"""What ``offer`` issues: the process's prefix (6 random bytes), a counter in hex."""


def _bounded(value: int, top: int = (1 << 62)) -> int:
    """A count as the wire takes it: 0..top."""
    return min(max(0, value), top)


class ResponseHandoff:
    """Routed requests waiting for the stream that observes their response, by token."""

    __slots__ = ("_clock", "_director", "_foreign_summary_s", "_ids", "_last_foreign_warning",
                 "_last_summary_s", "_last_warning", "_pending", "_prefix", "_remote", "claimed",
                 "claimed_by_peer", "foreign", "forwarded", "handed_over", "observing",
                 "publish", "remote_applied", "summarized_here", "unobserved", "wait_s")  # fmt: skip

    def __init__(
        self,
        director: Director,
        wait_s: float = DEFAULT_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        observing: bool = True,
    ) -> None:
        if wait_s <= 0:
            raise ValueError(f"the observer wait must be > 0 s, got {wait_s}")
        self._director = director
        self.wait_s = wait_s
        self._clock = clock
        self._pending: OrderedDict[str, tuple[float, Routing]] = OrderedDict()
        self._prefix = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._last_warning = -_WARN_EVERY_S
        self._last_foreign_warning = -_WARN_EVERY_S
        self.claimed = 0
        self.foreign = 0
        self.unobserved = 0
        self.forwarded = 0
        """Observations of other replicas' requests sent to the peers."""
        self.claimed_by_peer = 0
        """Of ``claimed``: by a peer's observer stream (reported over sync)."""
        self.remote_applied = 0
        """Peers' observations of this replica's requests applied."""
        self._remote: OrderedDict[str, tuple[float, Routing, float | None]] = OrderedDict()
        """Requests a peer observes: deadline, routing, first-bytes time (this clock)."""
        self.publish: Publish | None = None
        """Set with index sync on: sends an observation to the peers (``SyncNode``)."""
        self.observing = observing
        """``epp serve --response-observer``: routed requests are offered to observer streams."""
        self.handed_over = 0
        """Streamed answers left to the access log after their first bytes."""
        self.summarized_here = 0
        """Of those, ended by an access log entry that came to this replica."""
        self._last_summary_s = -math.inf
        self._foreign_summary_s = -math.inf
    def counts(self) -> dict[str, int]:
        """Running totals by outcome (``epp_response_observer_requests``)."""
        return {
            "claimed": self.claimed - self.claimed_by_peer,
            "claimed_by_peer": self.claimed_by_peer,
            "unobserved": self.unobserved,
            "foreign": self.foreign,
            "forwarded": self.forwarded,
            "handed_over": self.handed_over,
            "summarized": self.summarized_here,
        }

    def __len__(self) -> int:
        return len(self._pending) + len(self._remote)

    def offer(self, routing: Routing) -> str:
        """Hand ``routing`` over until its observer claims it; returns the token for the
        request header."""
        now = self._clock()
        self.expire(now)
        token = f"{self._prefix}-{next(self._ids):x}"
        self._pending[token] = (now + self.wait_s, routing)
        return token

    def claim(self, token: str) -> Routing | None:
        """The routing ``token`` names, once; None when unknown, expired or claimed. A token
        of another epp process (its prefix is not ours) is counted in ``foreign`` and warned
        of: the observer stream reached a replica that did not route the request."""
        entry = self._pending.pop(token, None)
        if entry is None:
            if not token.startswith(self._prefix + "-") and self.publish is None:
                self.foreign += 1
                now = self._clock()
                if now - self._last_foreign_warning >= _WARN_EVERY_S:
                    self._last_foreign_warning = now
                    log.warning(
                        "an observer stream named a request this epp did not route (%d so "
                        "far): with several epp replicas, the observer filter must reach the "
                        "replica that routed (docs/serve.md); that request's response is not "
                        "learnt from, and its replica releases it after %.0f s",
                        self.foreign, self.wait_s,
                    )  # fmt: skip
            return None
        self.claimed += 1
        return entry[1]

    # --- a streamed answer's end, from the proxy's access log (epp.extproc.summary) -------

    def issue(self) -> str:
        """A token for a routed request, which the proxy's access log entry brings back."""
        return f"{self._prefix}-{next(self._ids):x}"

    def await_summary(self, token: str, routing: Routing, first_s: float | None) -> None:
        """The routing stream stopped reading ``routing``'s response after its first bytes (at
        ``first_s``, monotonic): its end comes in an access log entry, here or at a peer."""
        now = self._clock()
        self.expire(now)
        self._remote[token] = (now + REMOTE_WAIT_S, routing, first_s)
        self.handed_over += 1

    def summarized(self, token: str, info: ResponseInfo | None) -> None:
        """An access log entry: ``token``'s exchange ended with ``info`` (None: before its
        response did, e.g. the client left). Ends the request if it waits here; a peer's
        token goes to the peers with index sync on, and is counted in ``foreign`` without."""
        now = self._clock()
        if token.startswith(self._prefix + "-"):
            self._last_summary_s = now
            entry = self._remote.pop(token, None)
            if entry is None:  # its stream read the response to the end
                return
            self.summarized_here += 1
            _, routing, first_s = entry
            if info is None:
                self._director.abandon(routing, "cancelled")
                return
            if first_s is not None:
                info = replace(info, ttft_s=first_s - routing.started_s)
            self._director.finish(routing, info)
            return
        if self.forwards(token):
            self.observed(token, Kind.FINISHED if info is not None else Kind.ENDED, None, info)
            return
        self._foreign_summary_s = now
        self.foreign += 1

    def summaries_live(self, now: float) -> bool:
        """Whether a routing stream may leave a streamed answer's end to the access log: this
        replica's own requests' entries come (the last within ``SUMMARY_LIVE_S``), and no
        other replica's came here while index sync is off (then some of this replica's go
        to the others, and would never end here). Until then answers are read to the end."""
        if now - self._last_summary_s >= SUMMARY_LIVE_S:
            return False
        return self.publish is not None or now - self._foreign_summary_s >= SUMMARY_LIVE_S

    # --- another replica's request, observed here ----------------------------------------

    def forwards(self, token: str) -> bool:
        """Whether an observer stream with ``token`` (unknown here) reports to the peers:
        index sync is on and the token has the shape of another epp process's."""
        return (
            self.publish is not None
            and not token.startswith(self._prefix + "-")
            and _TOKEN.fullmatch(token) is not None
        )

    def observed(
        self, token: str, kind: int, first_s: float | None = None, info: ResponseInfo | None = None,
        stored: Sequence[str] = (),
    ) -> None:
        """Send the peers what this replica saw of ``token``'s response."""
        if self.publish is None:
            return
        msg = Observation(token, Kind(kind))
        # until it is sent the message carries the first bytes' stamp; the sender turns it
        # into an age (negative: no bytes came)
        msg.first_bytes_age_s = -1.0 if first_s is None else first_s
        if info is not None:
            msg.status = _bounded(info.status, 999)
            msg.prompt_tokens = _bounded(info.prompt_tokens)
            cached = info.cached_tokens
            msg.cached_tokens = -1 if cached is None else _bounded(cached)
            msg.completion_tokens = _bounded(info.completion_tokens)
            msg.response_bytes = _bounded(info.response_bytes)
            msg.generated_text = info.generated_text
        msg.stored_ids = tuple(stored)
        self.forwarded += 1
        self.publish(msg)

    # --- this replica's request, observed by a peer ---------------------------------------

    def apply_remote(self, observations: Sequence[Observation]) -> None:
        """A peer's observations (``SyncNode.on_observations``): act on those of this
        replica's tokens; ignore the rest (another replica's, or already expired)."""
        now = self._clock()
        mine = self._prefix + "-"
        for obs in observations:
            if obs.token.startswith(mine):
                try:
                    self._apply_one(obs, now)
                except Exception:  # a bug: keep the sync stream and the other observations
                    log.exception("applying a peer's observation of %s failed", obs.token)

    def _apply_one(self, obs: Observation, now: float) -> None:
        token, kind = obs.token, obs.kind
        if kind == Kind.CLAIMED:
            entry = self._pending.pop(token, None)
            if entry is not None:
                self.claimed += 1
                self.claimed_by_peer += 1
                self._remote[token] = (now + REMOTE_WAIT_S, entry[1], None)
            return
        remote = self._remote.get(token)
        if remote is None:  # expired, or the claim was lost
            return
        self.remote_applied += 1
        deadline, routing, first_s = remote
        director = self._director
        if kind == Kind.FIRST_BYTES:
            first_s = now - max(0.0, obs.age_s)
            self._remote[token] = (deadline, routing, first_s)
            director.first_token(routing, first_s - routing.started_s)
            return
        del self._remote[token]
        if obs.stored_ids:
            director.stored(routing, obs.stored_ids)
        if kind == Kind.ENDED:
            director.abandon(routing, "cancelled")
            return
        if obs.first_bytes_age_s >= 0:
            first_s = now - obs.first_bytes_age_s
        director.finish(routing, ResponseInfo(
            status=obs.status,
            prompt_tokens=obs.prompt_tokens,
            cached_tokens=None if obs.cached_tokens < 0 else obs.cached_tokens,
            completion_tokens=obs.completion_tokens,
            generated_text=obs.generated_text,
            response_bytes=obs.response_bytes,
            ttft_s=None if first_s is None else first_s - routing.started_s,
        ))  # fmt: skip

    def expire(self, now: float | None = None) -> int:
        """Release what waited past ``wait_s`` (oldest first: deadlines only grow), and what
        a peer claimed but never ended within ``REMOTE_WAIT_S``."""
        now = self._clock() if now is None else now
        remote = self._remote
        while remote:
            token, (deadline, routing, _) = next(iter(remote.items()))
            if deadline > now:
                break
            del remote[token]
            self.unobserved += 1
            self._director.abandon(routing, "unobserved")
        pending, expired = self._pending, 0
        while pending:
            token, (deadline, routing) = next(iter(pending.items()))
            if deadline > now:
                break
            del pending[token]
            expired += 1
            self._director.abandon(routing, "unobserved")
        if expired:
            self.unobserved += expired
            if now - self._last_warning >= _WARN_EVERY_S:
                self._last_warning = now
                log.warning(
                    "%d routed request(s) had no observer stream within %.0f s (%d in all): "
                    "with --response-observer, Envoy needs a second ext_proc filter in "
                    "observability_mode after the routing one (docs/serve.md)",
                    expired, self.wait_s, self.unobserved,
                )  # fmt: skip
        return expired
