"""Prefill in flight: per endpoint, the prompt characters epp sent there to prefill and has
not seen prefilled yet (no first token back).

One accounting, kept by the Director for every routed request (added at the pick on the
endpoint that runs the prefill: the prefiller of a split request, else the target; released
at the response's first bytes, or its end when none came, or when the client leaves) and read
by every plugin that weighs the prefill queued on an endpoint (``CycleState.prefill``): the
predicted-TTFT scorer, the token-load scorer and filter, the load-aware P/D decider. They
divide by their own characters per token. The amount is the prompt's uncached part there, by
the cycle's prefix match.

The record of what a request added lives on the request (the Director's ``Routing``), so it
is released exactly once when the request ends, with no expiry to tune; an endpoint that
leaves the pool is forgotten.

With index sync (docs/sync.md) the replicas also send each other their figures (whole sets,
in tokens at ``WIRE_CHARS_PER_TOKEN``): ``use_peer_prefill`` adds the other replicas' to what
the plugins read, so that R replicas do not each see 1/R of an endpoint's queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from epp.framework.endpoint import EndpointId
from epp.framework.types import PickResult

WIRE_CHARS_PER_TOKEN = 4.0
"""Index sync's prefill figures are tokens: characters / this (both ends use it)."""


class Prefill(NamedTuple):
    endpoint_id: EndpointId
    """Where the prefill runs: the prefiller of a split request, else the target."""
    chars: float
    """The prompt's characters that endpoint does not hold, by the cycle's prefix match."""


def prefill_of(result: PickResult) -> Prefill:
    """The prefill a pick queues, and where."""
    where = (result.prefiller or result.targets[0]).id
    prefix = result.state.prefix
    held = prefix.matched.get(where, 0) * prefix.block_chars
    return Prefill(where, max(0.0, float(len(result.state.request.prompt) - held)))


class PrefillLedger(Mapping[EndpointId, float]):
    """Prompt characters in flight to prefill, per endpoint: this replica's, plus the other
    replicas' when index sync shares them. A read-only mapping for the plugins; the Director
    writes it (``sent`` / ``done``)."""

    __slots__ = ("_own", "_peers")

    def __init__(self) -> None:
        self._own: dict[EndpointId, float] = {}
        self._peers: Callable[[EndpointId], float] | None = None

    # --- the Director ---------------------------------------------------------------------

    def sent(self, endpoint_id: EndpointId, chars: float) -> None:
        """A request's ``chars`` uncached prompt characters went to ``endpoint_id``."""
        if chars > 0:
            self._own[endpoint_id] = self._own.get(endpoint_id, 0.0) + chars

    def done(self, endpoint_id: EndpointId, chars: float) -> None:
        """Those characters were prefilled (or the request ended): no longer queued. An
        endpoint left with none is dropped (no series for every endpoint ever seen)."""
        own = self._own
        left = own.get(endpoint_id, 0.0) - chars
        if left > 1e-6:
            own[endpoint_id] = left
        else:
            own.pop(endpoint_id, None)

    def forget(self, endpoint_id: EndpointId) -> None:
        """The endpoint left the pool."""
        self._own.pop(endpoint_id, None)

    # --- the plugins (read-only) ------------------------------------------------------------

    def get(self, endpoint_id: EndpointId, default: float = 0.0) -> float:  # type: ignore[override]
        """This replica's and (with index sync) the others' characters queued there."""
        own = self._own.get(endpoint_id, 0.0)
        peers = self._peers
        total = own + peers(endpoint_id) * WIRE_CHARS_PER_TOKEN if peers is not None else own
        return total if total > 0 else default

    def __getitem__(self, endpoint_id: EndpointId) -> float:
        value = self.get(endpoint_id)
        if not value:
            raise KeyError(endpoint_id)
        return value

    def __iter__(self) -> Iterator[EndpointId]:
        return iter(list(self._own))

    def __len__(self) -> int:
        return len(self._own)

    def own(self) -> Mapping[EndpointId, float]:
        """This replica's alone (characters)."""
        return self._own

    # --- index sync (``epp.sync.load.SharedPrefill``) -------------------------------------

    def prefill_in_flight(self) -> Mapping[str, float]:
        """This replica's figures as index sync sends them: tokens per endpoint."""
        return {eid: chars / WIRE_CHARS_PER_TOKEN for eid, chars in self._own.items()}

    def use_peer_prefill(self, tokens: Callable[[EndpointId], float]) -> None:
        """Add ``tokens(endpoint)``, the other replicas' figure, to what the plugins read."""
        self._peers = tokens
