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
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from epp.extproc.convert import OBSERVE_HEADER
from epp.requestcontrol.director import Director, Routing

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_WAIT_S", "OBSERVE_HEADER", "ResponseHandoff"]

DEFAULT_WAIT_S = 10.0
"""How long a routed request waits for its observer stream (normally it comes within ms:
the observer filter sees the request headers as soon as the routing filter lets them go)."""
_WARN_EVERY_S = 60.0


class ResponseHandoff:
    """Routed requests waiting for the stream that observes their response, by token."""

    __slots__ = ("_clock", "_director", "_ids", "_last_foreign_warning", "_last_warning",
                 "_pending", "_prefix", "claimed", "foreign", "unobserved", "wait_s")  # fmt: skip

    def __init__(
        self,
        director: Director,
        wait_s: float = DEFAULT_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
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

    def __len__(self) -> int:
        return len(self._pending)

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
            if not token.startswith(self._prefix + "-"):
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

    def expire(self, now: float | None = None) -> int:
        """Release what waited past ``wait_s`` (oldest first: deadlines only grow)."""
        now = self._clock() if now is None else now
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
