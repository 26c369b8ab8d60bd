"""The precise index: which endpoint holds which KV block, as the servers' events say.

Keys are the 64-bit block keys vLLM publishes (``epp.prefix.blockhash``). An entry is
*confirmed* (a ``BlockStored`` event said so) or *speculative* (epp just sent the request
there; the server has not announced the blocks yet) with a deadline: it counts until then,
and an event confirms it (or a ``BlockRemoved`` drops it) in the meantime.

Two maps: per endpoint ``key -> deadline`` (0.0 = confirmed), which makes clearing one
endpoint cheap, and per key the set of endpoints holding it, which makes a match one walk
down the request's keys. ``max_entries`` bounds the total: beyond it new entries are
refused and counted (a server cannot hold more blocks than its KV cache; a publisher that
claims more is broken or hostile).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epp.datastore.endpoint import EndpointId

CONFIRMED = 0.0


@dataclass(slots=True)
class IndexCounts:
    stored: int = 0
    removed: int = 0
    refused: int = 0
    """Entries not added because the index was full."""
    speculative_expired: int = 0


class KvBlockIndex:
    def __init__(self, max_entries: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self._ep: dict[EndpointId, dict[int, float]] = {}
        self._holders: dict[int, set[EndpointId]] = {}
        self._spec: deque[tuple[float, EndpointId, Sequence[int]]] = deque()
        self.entries = 0
        self.counts = IndexCounts()
        self._lock = threading.Lock()
        """Held by every method: ``sweep`` runs in a worker thread (epp's sweeper task)."""

    def blocks(self, endpoint_id: EndpointId) -> int:
        held = self._ep.get(endpoint_id)
        return len(held) if held else 0

    def holds(self, endpoint_id: EndpointId, key: int, now_s: float) -> bool:
        d = self._ep.get(endpoint_id, {}).get(key)
        return d is not None and (d == CONFIRMED or d > now_s)

    def _match(
        self, keys: Sequence[int], candidates: Iterable[EndpointId], now_s: float
    ) -> dict[EndpointId, int]:
        """Per candidate endpoint, how many leading ``keys`` it holds (only those > 0)."""
        alive = {c for c in candidates if c in self._ep}
        out: dict[EndpointId, int] = {}
        holders_of = self._holders
        ep = self._ep
        i = 0
        for i, key in enumerate(keys):
            holders = holders_of.get(key)
            if not holders:
                break
            keep = set()
            for eid in alive & holders if len(holders) < len(alive) else holders & alive:
                d = ep[eid][key]
                if d == CONFIRMED or d > now_s:
                    keep.add(eid)
            if len(keep) != len(alive):
                for gone in alive - keep:
                    if i:
                        out[gone] = i
                alive = keep
            if not alive:
                return out
        else:
            i = len(keys)
        for eid in alive:
            if i:
                out[eid] = i
        return out

    def _store(self, endpoint_id: EndpointId, keys: Iterable[int]) -> int:
        """Confirm ``keys`` on the endpoint; returns how many were refused (index full)."""
        held = self._ep.setdefault(endpoint_id, {})
        holders_of = self._holders
        refused = 0
        added = 0
        for key in keys:
            d = held.get(key)
            if d is None:
                if self.entries + added >= self.max_entries:
                    refused += 1
                    continue
                added += 1
                holders = holders_of.get(key)
                if holders is None:
                    holders_of[key] = {endpoint_id}
                else:
                    holders.add(endpoint_id)
            held[key] = CONFIRMED
        self.entries += added
        self.counts.stored += added
        self.counts.refused += refused
        return refused

    def _speculate(
        self, endpoint_id: EndpointId, keys: Sequence[int], deadline_s: float
    ) -> None:
        """Count ``keys`` on the endpoint until ``deadline_s`` unless an event confirms them."""
        held = self._ep.setdefault(endpoint_id, {})
        holders_of = self._holders
        new: list[int] = []
        for key in keys:
            d = held.get(key)
            if d == CONFIRMED:
                continue
            if d is None:
                if self.entries >= self.max_entries:
                    break
                self.entries += 1
                holders = holders_of.get(key)
                if holders is None:
                    holders_of[key] = {endpoint_id}
                else:
                    holders.add(endpoint_id)
            held[key] = deadline_s
            new.append(key)
        if new:
            self._spec.append((deadline_s, endpoint_id, new))

    def _remove(self, endpoint_id: EndpointId, keys: Iterable[int]) -> None:
        held = self._ep.get(endpoint_id)
        if not held:
            return
        removed = 0
        for key in keys:
            if held.pop(key, None) is not None:
                removed += 1
                self._unhold(key, endpoint_id)
        self.entries -= removed
        self.counts.removed += removed

    def _unhold(self, key: int, endpoint_id: EndpointId) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(endpoint_id)
            if not holders:
                del self._holders[key]

    def _clear(self, endpoint_id: EndpointId) -> int:
        """Drop everything the endpoint holds; returns how many entries went."""
        held = self._ep.pop(endpoint_id, None)
        if not held:
            return 0
        for key in held:
            self._unhold(key, endpoint_id)
        self.entries -= len(held)
        return len(held)

    def _sweep(self, now_s: float) -> int:
        """Drop speculative entries past their deadline that no event confirmed."""
        spec = self._spec
        gone = 0
        while spec and spec[0][0] <= now_s:
            deadline, eid, keys = spec.popleft()
            held = self._ep.get(eid)
            if not held:
                continue
            for key in keys:
                if held.get(key) == deadline:
                    del held[key]
                    self._unhold(key, eid)
                    gone += 1
        self.entries -= gone
        self.counts.speculative_expired += gone
        return gone

    # Locked entry points (``_name`` holds the logic).

    def match(
        self, keys: Sequence[int], candidates: Iterable[EndpointId], now_s: float
    ) -> dict[EndpointId, int]:
        """Per candidate endpoint, how many leading ``keys`` it holds (only those > 0)."""
        with self._lock:
            return self._match(keys, candidates, now_s)

    def store(self, endpoint_id: EndpointId, keys: Iterable[int]) -> int:
        """Confirm ``keys`` on the endpoint; returns how many were refused (index full)."""
        with self._lock:
            return self._store(endpoint_id, keys)

    def speculate(self, endpoint_id: EndpointId, keys: Sequence[int], deadline_s: float) -> None:
        """Count ``keys`` on the endpoint until ``deadline_s`` unless an event confirms them."""
        with self._lock:
            self._speculate(endpoint_id, keys, deadline_s)

    def remove(self, endpoint_id: EndpointId, keys: Iterable[int]) -> None:
        with self._lock:
            self._remove(endpoint_id, keys)

    def clear(self, endpoint_id: EndpointId) -> int:
        """Drop everything the endpoint holds; returns how many entries went."""
        with self._lock:
            return self._clear(endpoint_id)

    def sweep(self, now_s: float) -> int:
        """Drop speculative entries past their deadline that no event confirmed."""
        with self._lock:
            return self._sweep(now_s)
