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
hostile). Entries of a cleared endpoint count against it until they are gone.

No call is proportional to the index: ``clear`` detaches the endpoint's entries at once
(a match no longer sees them: its slot leaves the candidates' mask) and ``sweep_steps``
unsets their bits and frees the slot a slice of ``SLICE_ITEMS`` keys at a time, as it
expires speculative entries; the serving loop runs the slices one by one and serves
requests in between (one 500k-entry clear held it 137 ms, a sweep 428 ms). Every public
method takes a lock, held for one call or one slice.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from epp.framework.endpoint import EndpointId

CONFIRMED = 0.0
SLICE_ITEMS = 1024
"""Keys one slice of a pass touches before it lets the loop serve."""


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
        self._detached: list[tuple[int, dict[int, float]]] = []
        """Cleared endpoints' slots and entries, whose bits ``sweep_steps`` still unsets."""
        self.detached_entries = 0
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
            room = max(0, self.max_entries - self.entries - self.detached_entries)
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
            room = max(0, self.max_entries - self.entries - self.detached_entries)
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
        """Drop everything the endpoint holds; returns how many went. O(1): the entries stop
        counting at once, their bits are unset (and the slot freed) by ``sweep_steps``."""
        with self._lock:
            held = self._ep.pop(endpoint_id, None)
            slot = self._slot.pop(endpoint_id, None)
            if slot is None:
                return 0
            self._eids[slot] = None  # the slot is reused only once its bits are unset
            n = len(held) if held else 0
            self.entries -= n
            self.detached_entries += n
            self._detached.append((slot, held or {}))
            return n

    def sweep(self, now_s: float) -> int:
        """Drop speculative entries past their deadline that no event confirmed, and finish
        clearing what ``clear`` detached; returns the speculative entries dropped. In one
        piece: ``sweep_steps`` is the same a slice at a time."""
        return sum(self.sweep_steps(now_s))

    def sweep_steps(self, now_s: float, size: int = SLICE_ITEMS) -> Iterator[int]:
        """``sweep`` in slices of about ``size`` keys, the lock taken per slice; yields the
        speculative entries each slice dropped."""
        while True:
            with self._lock:
                if not self._detached:
                    break
                self._unset_detached(size)
            yield 0
        while True:
            with self._lock:
                gone = self._expire_speculative(now_s, size)
            if gone < 0:
                return
            yield gone

    def _unset_detached(self, size: int) -> None:
        slot, held = self._detached[-1]
        clear = ~(1 << slot)
        holders, spec, unset = self._holders, self._spec_holders, self._unset
        pop = held.popitem
        for _ in range(min(size, len(held))):
            key, d = pop()
            unset(holders, key, clear)
            if d != CONFIRMED:
                unset(spec, key, clear)
            self.detached_entries -= 1
        if not held:
            self._detached.pop()
            self._free_slots.append(slot)

    def _expire_speculative(self, now_s: float, size: int) -> int:
        """Up to ~``size`` keys of speculative entries past their deadline; -1: none left."""
        spec = self._spec
        if not spec or spec[0][0] > now_s:
            return -1
        gone = touched = 0
        while spec and spec[0][0] <= now_s and touched < size:
            deadline, eid, keys = spec[0]
            held = self._ep.get(eid)
            slot = self._slot.get(eid)
            if not held or slot is None:
                spec.popleft()
                continue
            clear = ~(1 << slot)
            take = keys[:size - touched]
            for key in take:
                if held.get(key) == deadline:
                    del held[key]
                    self._unset(self._holders, key, clear)
                    self._unset(self._spec_holders, key, clear)
                    gone += 1
            touched += len(take)
            if len(take) == len(keys):
                spec.popleft()
            else:  # the rest of this write in the next slice
                spec[0] = (deadline, eid, keys[len(take):])
        self.entries -= gone
        self.counts.speculative_expired += gone
        return gone
