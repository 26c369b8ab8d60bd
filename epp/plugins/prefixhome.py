"""``prefix-home-scorer``: send a prefix no endpoint is known to hold to the endpoint its
hash names, so that epp replicas that share nothing agree where a new prefix lives.

Each epp replica learns the prefix index from its own picks. With several replicas and no
index sync, the first requests of a new shared prefix (a system prompt, a document) reach
different replicas, and each places it by the load it sees: the prefix is prefilled on as
many endpoints as there are epp replicas, and the extra copies evict other prefixes behind
each replica's back. This scorer gives every replica the same answer without talking: when
no endpoint is known to hold ``minMatchChunks`` of the request's leading chunks (in this
replica's index), the endpoints are ranked by rendezvous hashing of the chain hash at depth
``keyChunks`` (the prompt's first ``keyChunks`` chunks, or all of it when shorter), and the
first of them whose load is within bounds scores 1, the others 0. Once a replica has placed
the prefix, its prefix match takes over and this scorer is silent.

The bound is consistent hashing with bounded loads' (KubeAI's PrefixHash, the ``chwbl``
baseline): an endpoint is passed over while its load (running + waiting + sent since the
last scrape) plus this request would exceed ``loadFactor`` x the mean, so a shared prefix does
not land on an endpoint that is already well above the others. Replicas read the same scraped
loads, so they agree but for what each sent since the last scrape. The bound is loose on
purpose: a tight one (the least-loaded endpoints only) leaves the replicas' own unscraped
sends to decide, and they disagree again. Weighted low, the score only tips a choice the other
scorers leave close. Removing or adding an endpoint moves only the prefixes homed on it
(rendezvous hashing), or, in a pool of more than 16, about as many again.

In a pool of more than 16 endpoints the rendezvous runs among the 16 that follow the key on
the ring of endpoint-id hashes (``Pool.ring``; then the next 16 while none is within the
bound), not among all of them: what a key's home is still depends on the pool alone, so
replicas agree, and finding it costs the same in a pool of 20 or of 1,000 (the datastore's
pool keeps the ring). In a pool of 16 or fewer the window is the whole pool. Stateless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from epp.framework.endpoint import Endpoint
from epp.framework.pool import Pool, as_pool, busy, endpoint_hash
from epp.framework.types import CycleState

_MASK = (1 << 64) - 1
WINDOW = 16
"""Endpoints the rendezvous ranks, following the key on the ring of endpoint-id hashes (the
whole pool when it has no more)."""


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit value from a 64-bit input."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


@dataclass(slots=True, frozen=True)
class PrefixHomeParams:
    key_chunks: int = 16
    """Depth of the chunk whose chain hash names the home: the prefix producer's chunks (the
    approximate index's 64 characters, ~256 tokens for 16; the precise producer's KV blocks)."""
    min_match_chunks: int = 16
    """The scorer speaks only while no endpoint is known to hold this many leading chunks."""
    load_factor: float = 1.25
    """The home is passed over, for the next endpoint in hash order, while its load (running
    + waiting + sent since the last scrape, in flight) with this request would exceed this
    multiple of the mean (consistent hashing with bounded loads)."""
    __config_min__: ClassVar[dict[str, float]] = {
        "key_chunks": 1, "min_match_chunks": 1, "load_factor": 1.0,
    }


class PrefixHomeScorer:
    def __init__(self, name: str, params: PrefixHomeParams) -> None:
        self.name = name
        self.params = params
        self._memo: tuple[CycleState, Pool, Endpoint | None] | None = None
        """The home ``nominate`` found, for ``score`` in the same cycle."""

    def _weights(self, key: int, endpoints: Sequence[Endpoint]) -> list[int]:
        return [_mix((key ^ endpoint_hash(e.id)) & _MASK) for e in endpoints]

    def order(self, key: int, endpoints: Sequence[Endpoint]) -> list[int]:
        """Indexes of ``endpoints`` in rendezvous order for ``key``, the home first."""
        weights = self._weights(key, endpoints)
        return sorted(range(len(endpoints)), key=weights.__getitem__, reverse=True)

    def home_in(self, key: int, pool: Pool) -> Endpoint:
        """The key's home: rendezvous among the whole pool when it has at most ``WINDOW``
        endpoints (``home``), else among the ``WINDOW`` that follow the key on the ring, and
        the next ``WINDOW`` while none is within the load bound."""
        n = len(pool)
        if n <= WINDOW:
            return pool[self.home(key, pool)]
        cap = math.ceil(self.params.load_factor * (pool.busy_total() + 1) / n)
        first = None
        for skip in range(0, n, WINDOW):
            window = pool.ring(key, WINDOW, skip)
            ranked = sorted(window, key=lambda he: _mix((key ^ he[0]) & _MASK), reverse=True)
            for _, e in ranked:
                if busy(e) + 1 <= cap:
                    return e
            if first is None:
                first = ranked[0][1]
        assert first is not None
        return first  # unreachable: the least-loaded endpoint is within the bound

    def home(self, key: int, endpoints: Sequence[Endpoint]) -> int:
        """Index of the first endpoint in rendezvous order, among all of ``endpoints``, whose
        load is within the bound."""
        loads = [e.metrics.running + e.queue for e in endpoints]
        cap = math.ceil(self.params.load_factor * (sum(loads) + 1) / len(loads))
        weights = self._weights(key, endpoints)
        first = max(range(len(endpoints)), key=weights.__getitem__)
        if loads[first] + 1 <= cap:  # the common case: no sort
            return first
        for i in sorted(range(len(endpoints)), key=weights.__getitem__, reverse=True):
            if loads[i] + 1 <= cap:
                return i
        return first  # unreachable: the least-loaded endpoint is within the bound

    def _key(self, state: CycleState) -> int | None:
        """The chain hash that names the prompt's home, or None while the scorer is silent
        (no prompt, or some endpoint holds ``minMatchChunks`` of it)."""
        prefix = state.prefix
        hashes = prefix.hashes
        if not hashes:
            return None
        p = self.params
        if prefix.matched and max(prefix.matched.values()) >= p.min_match_chunks:
            return None
        return hashes[min(p.key_chunks, len(hashes)) - 1]

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        zeros = [0.0] * len(endpoints)
        if not endpoints:
            return zeros
        pool = state.pool
        if pool is None:  # every candidate scored
            if len(endpoints) <= WINDOW:
                key = self._key(state)
                if key is not None:
                    zeros[self.home(key, endpoints)] = 1.0
                return zeros
            home = self._pool_home(state, as_pool(endpoints))
        else:  # a shortlist of pool: the home ``nominate`` found, if it made the list
            memo, self._memo = self._memo, None
            if memo is not None and memo[0] is state and memo[1] is pool:
                home = memo[2]
            else:
                home = self._pool_home(state, pool)
        if home is not None:
            for i, e in enumerate(endpoints):
                if e.id == home.id:
                    zeros[i] = 1.0
                    break
        return zeros

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The prompt's home among the pool, when it speaks."""
        home = self._pool_home(state, pool)
        self._memo = (state, pool, home)
        return [home] if home is not None else []

    def _pool_home(self, state: CycleState, pool: Pool) -> Endpoint | None:
        key = self._key(state)
        return None if key is None or not pool else self.home_in(key, pool)
