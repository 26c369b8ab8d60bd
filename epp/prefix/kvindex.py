"""The precise index: which endpoint holds which KV block, as the servers' events say.

Keys are the 64-bit block keys vLLM publishes (``epp.prefix.blockhash``). An entry is
*confirmed* (a ``BlockStored`` event said so) or *speculative* (epp just sent the request
there; the server has not announced the blocks yet) with a deadline: it counts until then,
and an event confirms it (or a ``BlockRemoved`` drops it) in the meantime.

Layout, for a match that is one walk down the request's keys and entries that cost a dict
slot and a small integer each:

* per endpoint, ``key -> deadline`` (0.0 = confirmed): what clearing an endpoint walks;
* per key, a bitmask of the endpoints holding it (each endpoint has a slot number, reused
  after it leaves), and a second mask of those holding it speculatively, whose deadlines the
  match checks.

``max_entries`` bounds the total: beyond it new entries are refused and counted (a server
cannot hold more blocks than its KV cache; a publisher that claims more is broken or
hostile). Every public method takes a lock: ``sweep`` runs in a worker thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epp.framework.endpoint import EndpointId

CONFIRMED = 0.0


@dataclass(slots=True)
class IndexCounts:
    stored: int = 0
    removed: int = 0
    refused: int = 0
    """Entries not added because the index was full."""
    speculative_expired: int = 0


def _bits(mask: int) -> Iterable[int]:
    """Slot numbers set in ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class KvBlockIndex:
    def __init__(self, max_entries: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self._ep: dict[EndpointId, dict[int, float]] = {}
        self._slot: dict[EndpointId, int] = {}
        self._eids: list[EndpointId | None] = []
        self._free_slots: list[int] = []
        self._holders: dict[int, int] = {}
        self._spec_holders: dict[int, int] = {}
        self._spec: deque[tuple[float, EndpointId, list[int]]] = deque()
        self.entries = 0
        self.counts = IndexCounts()
        self._lock = threading.Lock()

    def blocks(self, endpoint_id: EndpointId) -> int:
        held = self._ep.get(endpoint_id)
        return len(held) if held else 0

    def _bit(self, endpoint_id: EndpointId) -> int:
        slot = self._slot.get(endpoint_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._eids[slot] = endpoint_id
            else:
                slot = len(self._eids)
                self._eids.append(endpoint_id)
            self._slot[endpoint_id] = slot
        return 1 << slot

    def _unset(self, masks: dict[int, int], key: int, clear: int) -> None:
        m = masks.get(key)
        if m is not None:
            m &= clear
            if m:
                masks[key] = m
            else:
                del masks[key]

    def match(
        self, keys: Sequence[int], candidates: Iterable[EndpointId], now_s: float
    ) -> dict[EndpointId, int]:
        """Per candidate endpoint, how many leading ``keys`` it holds (only those > 0)."""
        with self._lock:
            slot = self._slot
            alive = 0
            for c in candidates:
                s = slot.get(c)
                if s is not None:
                    alive |= 1 << s
            out: dict[EndpointId, int] = {}
            if not alive:
                return out
            eids = self._eids
            holders_get = self._holders.get
            spec_get = self._spec_holders.get
            ep = self._ep
            i = 0
            for i, key in enumerate(keys):
                h = holders_get(key, 0) & alive
                if h:
                    sp = spec_get(key, 0) & h
                    if sp:
                        for s in _bits(sp):
                            eid = eids[s]
                            if eid is None or ep[eid][key] <= now_s:
                                h &= ~(1 << s)
                if h != alive:
                    if i:
                        for s in _bits(alive & ~h):
                            out[eids[s]] = i  # type: ignore[index]
                    alive = h
                    if not alive:
                        return out
            i = len(keys)
            if i:
                for s in _bits(alive):
                    out[eids[s]] = i  # type: ignore[index]
            return out

    def store(self, endpoint_id: EndpointId, keys: Iterable[int]) -> int:
        """Confirm ``keys`` on the endpoint; returns how many were refused (index full)."""
        with self._lock:
            held = self._ep.setdefault(endpoint_id, {})
            bit = self._bit(endpoint_id)
            unique = list(dict.fromkeys(keys))
            get = held.get
            new = [k for k in unique if k not in held]
            confirming = [k for k in unique if get(k, CONFIRMED) != CONFIRMED]
            room = max(0, self.max_entries - self.entries)
            refused = max(0, len(new) - room)
            if refused:
                cut = set(new[room:])
                new = new[:room]
                unique = [k for k in unique if k not in cut]
            held.update(dict.fromkeys(unique, CONFIRMED))
            holders = self._holders
            hget = holders.get
            for k in new:
                holders[k] = hget(k, 0) | bit
            clear = ~bit
            for k in confirming:
                self._unset(self._spec_holders, k, clear)
            self.entries += len(new)
            self.counts.stored += len(new)
            self.counts.refused += refused
            return refused

    def speculate(self, endpoint_id: EndpointId, keys: Sequence[int], deadline_s: float) -> None:
        """Count ``keys`` on the endpoint until ``deadline_s`` unless an event confirms them
        (keys it holds by events are left confirmed)."""
        with self._lock:
            held = self._ep.setdefault(endpoint_id, {})
            bit = self._bit(endpoint_id)
            get = held.get
            fresh = [k for k in dict.fromkeys(keys) if get(k) != CONFIRMED]
            new = [k for k in fresh if k not in held]
            room = max(0, self.max_entries - self.entries)
            if len(new) > room:
                cut = set(new[room:])
                new = new[:room]
                fresh = [k for k in fresh if k not in cut]
            if not fresh:
                return
            held.update(dict.fromkeys(fresh, deadline_s))
            holders, spec = self._holders, self._spec_holders
            hget, sget = holders.get, spec.get
            for k in new:
                holders[k] = hget(k, 0) | bit
            for k in fresh:
                spec[k] = sget(k, 0) | bit
            self.entries += len(new)
            self._spec.append((deadline_s, endpoint_id, fresh))

    def remove(self, endpoint_id: EndpointId, keys: Iterable[int]) -> None:
        with self._lock:
            held = self._ep.get(endpoint_id)
            if not held:
                return
            clear = ~self._bit(endpoint_id)
            pop = held.pop
            removed = 0
            for key in keys:
                d = pop(key, None)
                if d is not None:
                    removed += 1
                    self._unset(self._holders, key, clear)
                    if d != CONFIRMED:
                        self._unset(self._spec_holders, key, clear)
            self.entries -= removed
            self.counts.removed += removed

    def clear(self, endpoint_id: EndpointId) -> int:
        """Drop everything the endpoint holds and free its slot; returns how many went."""
        with self._lock:
            held = self._ep.pop(endpoint_id, None)
            slot = self._slot.pop(endpoint_id, None)
            if slot is None:
                return 0
            clear = ~(1 << slot)
            n = 0
            if held:
                for key, d in held.items():
                    self._unset(self._holders, key, clear)
                    if d != CONFIRMED:
                        self._unset(self._spec_holders, key, clear)
                n = len(held)
                self.entries -= n
            self._eids[slot] = None
            self._free_slots.append(slot)
            return n

    def sweep(self, now_s: float) -> int:
        """Drop speculative entries past their deadline that no event confirmed."""
        with self._lock:
            spec = self._spec
            gone = 0
            while spec and spec[0][0] <= now_s:
                deadline, eid, keys = spec.popleft()
                held = self._ep.get(eid)
                if not held:
                    continue
                clear = ~self._bit(eid)
                for key in keys:
                    if held.get(key) == deadline:
                        del held[key]
                        self._unset(self._holders, key, clear)
                        self._unset(self._spec_holders, key, clear)
                        gone += 1
            self.entries -= gone
            self.counts.speculative_expired += gone
            return gone
