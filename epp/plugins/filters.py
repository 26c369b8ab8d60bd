"""Filters: each keeps a subset of the candidates. None of them ever empties a non-empty pool
by accident: where no endpoint qualifies, a filter documents what it keeps instead."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from epp.framework.endpoint import Endpoint
from epp.framework.types import CycleState
from epp.plugins.scorers import lora_tier


@dataclass(slots=True, frozen=True)
class LoadThresholdParams:
    queue_threshold: int = 5
    """Keep endpoints with at most this many requests waiting."""
    kv_cache_threshold: float = 0.8
    """Keep endpoints using at most this share of their KV cache."""


class LoadThresholdFilter:
    """Keep endpoints with queue <= ``queue_threshold`` and KV use <= ``kv_cache_threshold``;
    keep all when none qualify. Endpoints with unknown metrics qualify."""

    def __init__(self, name: str, params: LoadThresholdParams) -> None:
        self.name = name
        self.params = params

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        q, kv = self.params.queue_threshold, self.params.kv_cache_threshold
        kept = [
            e
            for e in endpoints
            if not e.metrics.known or (e.queue <= q and e.metrics.kv_usage <= kv)
        ]
        return kept or endpoints


@dataclass(slots=True, frozen=True)
class NoParams:
    pass


def _lowest_band(endpoints: Sequence[Endpoint], values: Sequence[float]) -> list[Endpoint]:
    lo, hi = min(values), max(values)
    limit = lo + (hi - lo) / len(values)
    return [e for e, v in zip(endpoints, values, strict=True) if v <= limit]


class LeastQueueFilter:
    """Keep endpoints whose queue is within ``min + (max - min) / n`` of the shortest."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if len(endpoints) < 2:
            return endpoints
        return _lowest_band(endpoints, [e.queue for e in endpoints])


class LeastKvCacheFilter:
    """Keep endpoints whose KV use is within ``min + (max - min) / n`` of the lowest."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if len(endpoints) < 2:
            return endpoints
        return _lowest_band(endpoints, [e.metrics.kv_usage for e in endpoints])


class LoraAffinityFilter:
    """Keep the best non-empty tier: adapter running, else a free adapter slot, else adapter
    waiting; keep all when none of them applies (the server will load or reject it)."""

    def __init__(self, name: str, params: NoParams) -> None:
        self.name = name

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        adapter = state.request.adapter
        if not adapter or not endpoints:
            return endpoints
        tiers = [lora_tier(e, adapter) for e in endpoints]
        best = min(tiers)
        if best == 3:
            return endpoints
        return [e for e, t in zip(endpoints, tiers, strict=True) if t == best]


@dataclass(slots=True, frozen=True)
class BoundedLoadParams:
    load_factor: float = 1.25
    """An endpoint may hold at most this many times the mean load, this request included
    (KubeAI's default for its prefix hash ring)."""
    min_in_flight: int = 0
    """An endpoint with fewer requests in flight than this always qualifies (0: KubeAI's
    rule). At light load the mean is one or two requests, and the bound alone moves a prompt
    off the endpoint holding its prefix while that endpoint is far from busy."""

    __config_min__: ClassVar[dict[str, float]] = {"load_factor": 1.0}


class BoundedLoadFilter:
    """Bounded loads, as consistent hashing with bounded loads (KubeAI's PrefixHash) bounds
    its ring walk: keep the endpoints that, given this request, would hold at most
    ``load_factor`` x the candidates' mean load, so no prefix, however hot, piles its
    requests onto one endpoint while others idle. Load is the requests epp has in flight
    there (its own accounting: exact between scrapes, and per epp replica, as KubeAI's is).
    Keeps all when no load is recorded (the first requests, or a caller that keeps no
    in-flight counts); where none is under the bound, the least loaded."""

    def __init__(self, name: str, params: BoundedLoadParams) -> None:
        self.name = name
        self.params = params

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        if len(endpoints) < 2:
            return endpoints
        in_flight = state.in_flight
        loads = [in_flight.get(e.id, 0) for e in endpoints]
        total = sum(loads)
        if total == 0:
            return endpoints
        # the mean with this request added is (total + 1) / n
        bound = max((total + 1) / len(endpoints) * self.params.load_factor,
                    self.params.min_in_flight)  # fmt: skip
        kept = [e for e, load in zip(endpoints, loads, strict=True) if load + 1 <= bound]
        if kept:
            return kept
        # loads level and few endpoints (two with one request each, a factor of 1.25): none
        # stays under the bound, so the least loaded ones share the excess
        low = min(loads)
        return [e for e, load in zip(endpoints, loads, strict=True) if load == low]


@dataclass(slots=True, frozen=True)
class LongestPrefixParams:
    min_match_chunks: int = 1
    """Below this many matched chunks no endpoint counts as holding the prefix (all are kept)."""
    min_match_ratio: float = 0.0
    """Nor below this fraction of the request's chunks."""
    max_queue: float = math.inf
    """Keep a holder only while its queue (waiting + sent since its last scrape) is at most
    this; when no holder qualifies, keep all, and the scorers weigh the cache against the load.
    Unbounded by default. With a bound, a filter in front of scorers holds each prompt to its cache
    while the pool has room and lets load decide once the holder queues."""


class LongestPrefixFilter:
    """Keep the endpoints holding the longest leading run of the request's chunks; keep all
    when no endpoint holds ``min_match_chunks`` (and ``min_match_ratio`` of the request), or
    when every holder's queue is over ``max_queue``."""

    def __init__(self, name: str, params: LongestPrefixParams) -> None:
        self.name = name
        self.params = params

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        matched = state.prefix.matched
        if not matched or not endpoints:
            return endpoints
        counts = [matched.get(e.id, 0) for e in endpoints]
        best = max(counts)
        p = self.params
        if best < p.min_match_chunks or best < p.min_match_ratio * state.prefix.total:
            return endpoints
        kept = [e for e, c in zip(endpoints, counts, strict=True)
                if c == best and e.queue <= p.max_queue]  # fmt: skip
        return kept or endpoints
