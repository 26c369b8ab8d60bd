"""Scorers: each returns one score in [0, 1] per endpoint, neutral (0.5) where data is missing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from epp.framework.endpoint import Endpoint
from epp.framework.pool import Pool
from epp.framework.types import CycleState

NEUTRAL = 0.5


@dataclass(slots=True, frozen=True)
class LoadGateParams:
    """The load scorers' gate (``PoolGate``), shared by the queue and KV-use scorers."""

    full_at_waiting: float = 0.0
    """Scale the pull by the most requests any candidate's server reports waiting, over this
    many (full from there on, none while nothing waits: moving a prompt off its cache to even
    out an idle pool gains nothing). 0: always full."""
    waiting_decay_s: float = 0.0
    """With ``fullAtWaiting``: remember the most waiting seen, decaying by e every this many
    seconds, so a pool that queued lately keeps the pull between its queues. 0: now only."""
    held_match_ratio: float = 0.0
    """With ``fullAtWaiting``: gate only a prompt some candidate holds at least this share of;
    a prompt none holds gets the full pull, so new prefixes are still placed by load. 0: gate
    every prompt."""

    __config_max__: ClassVar[dict[str, float]] = {"held_match_ratio": 1.0}


class PoolGate:
    """The share of a load score's pull to apply, in [0, 1] (``fullAtWaiting``): the most
    requests a candidate's server reports waiting, remembered with a decay of ``decay_s``
    seconds, over ``full_at_waiting``. Scraped waiting only, not the requests epp sent since
    the scrape, which at light load are its own burst. Full until every candidate has been
    scraped, and for a prompt no candidate holds ``held_ratio`` of: placing a new prefix is
    what the load scores are for."""

    __slots__ = ("at_s", "decay_s", "full", "held_ratio", "level")

    def __init__(self, params: LoadGateParams) -> None:
        self.full = params.full_at_waiting
        self.decay_s = params.waiting_decay_s
        self.held_ratio = params.held_match_ratio
        self.level = 0.0
        self.at_s = 0.0

    def __call__(self, state: CycleState, endpoints: Sequence[Endpoint]) -> float:
        if self.full <= 0:
            return 1.0
        most = 0
        for e in endpoints:
            m = e.metrics
            if not m.scraped_at_s:
                return 1.0
            most = max(most, m.waiting)
        level = float(most)
        if self.decay_s > 0:
            now = state.now_s
            level = max(level, self.level * math.exp(-max(0.0, now - self.at_s) / self.decay_s))
            self.level, self.at_s = level, now
        if self.held_ratio > 0:
            prefix = state.prefix
            matched = prefix.matched
            held = max((matched.get(e.id, 0) for e in endpoints), default=0)
            if not prefix.total or held < self.held_ratio * prefix.total:
                return 1.0
        return min(1.0, level / self.full)


@dataclass(slots=True, frozen=True)
class PrefixCacheScorerParams:
    min_match_chunks: int = 1
    """Fewer matched leading chunks than this score 0 (a lone shared chunk is noise)."""
    min_match_ratio: float = 0.0
    """A matched fraction of the prompt below this scores 0."""


class PrefixCacheScorer:
    """Fraction of the request's chunks the endpoint holds as a leading run (index estimate)."""

    def __init__(self, name: str, params: PrefixCacheScorerParams) -> None:
        self.name = name
        self.params = params

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        prefix = state.prefix
        total = prefix.total
        if total == 0 or not prefix.matched:
            return [0.0] * len(endpoints)
        floor = max(self.params.min_match_chunks, self.params.min_match_ratio * total)
        # few endpoints hold a match: score those, leave the rest at 0
        score = {eid: m / total for eid, m in prefix.matched.items() if m >= floor}
        if not score:
            return [0.0] * len(endpoints)
        get = score.get
        return [get(e.id, 0.0) for e in endpoints]

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The endpoints holding the longest leading runs (those it scores above 0)."""
        prefix = state.prefix
        floor = max(self.params.min_match_chunks, self.params.min_match_ratio * prefix.total)
        return prefix.holders(pool, k, max(1, math.ceil(floor)))


@dataclass(slots=True, frozen=True)
class QueueScorerParams(LoadGateParams):
    min_spread: float = 0.0
    """Queues fewer than this many requests apart weigh in proportion (``1 - (q - min) /
    max(max - min, minSpread)``) instead of the full min-max range: over two servers, one
    request more is not an imbalance worth leaving a cache for. 0: plain min-max."""


class QueueScorer:
    """Shorter queue scores higher, min-max normalised over the candidates (``minSpread``
    softens a small difference).

    The queue is the server's waiting requests plus those epp sent since its last scrape, so
    a burst between two scrapes spreads out. An endpoint never scraped counts the requests
    epp has in flight there (``Datastore`` keeps its ``pending`` at that).
    """

    def __init__(self, name: str, params: QueueScorerParams) -> None:
        self.name = name
        self.min_spread = params.min_spread
        self.gate = PoolGate(params)

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        # Written for speed: this runs over every endpoint scored on every request.
        queues = [e.queue for e in endpoints]
        pool = state.pool  # scoring a shortlist: normalise over every candidate
        lo, hi = pool.queue_range() if pool is not None else (min(queues), max(queues))
        gate = self.gate(state, endpoints if pool is None else pool)  # remembers the waiting
        if hi == lo:
            return [1.0] * len(queues)
        inv = gate / max(hi - lo, self.min_spread)
        return [1.0 - (q - lo) * inv for q in queues]

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The least queued."""
        return pool.least("queue", k)


@dataclass(slots=True, frozen=True)
class KvCacheScorerParams(LoadGateParams):
    free_below: float = 0.0
    """KV use up to this fraction scores 1, and the rest of the range linearly down to 0 at
    full: ``1 - max(0, use - freeBelow) / (1 - freeBelow)``. A cache this full still has room,
    and on small caches a few running requests fill half of it. 0: ``1 - kv_usage``."""

    __config_max__: ClassVar[dict[str, float]] = {**LoadGateParams.__config_max__,
                                                  "free_below": 0.99}


class KvCacheUtilizationScorer:
    """Free KV cache scores higher: ``1 - kv_usage`` (``freeBelow`` leaves low use unscored).
    Unknown metrics score neutral."""

    def __init__(self, name: str, params: KvCacheScorerParams) -> None:
        self.name = name
        self.free_below = params.free_below  # in [0, 0.99]: the config schema bounds it
        self.scale = 1.0 / (1.0 - params.free_below)
        self.gate = PoolGate(params)

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        # kv_usage is clamped to [0, 1] when scraped
        gate = self.gate(state, endpoints if state.pool is None else state.pool)
        lo, scale = self.free_below, self.scale * gate
        return [1.0 - max(0.0, m.kv_usage - lo) * scale if m.scraped_at_s else NEUTRAL
                for m in [e.metrics for e in endpoints]]  # fmt: skip

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The least KV used, half of ``k`` (KV use is also the least-queued's tie-break)."""
        return pool.least("kv", max(1, k // 2))


@dataclass(slots=True, frozen=True)
class LoraAffinityScorerParams:
    running: float = 1.0
    """Score of an endpoint already running the request's adapter."""
    free_slot: float = 0.8
    """Score of one with a free adapter slot."""
    waiting: float = 0.6
    """Score of one with the adapter waiting to load."""
    none: float = 0.0
    """Score of one with neither."""


class LoraAffinityScorer:
    """Adapter already running > a free adapter slot > adapter waiting > neither.

    Requests for the base model (no adapter) score 1 everywhere.
    """

    def __init__(self, name: str, params: LoraAffinityScorerParams) -> None:
        self.name = name
        self.params = params

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        adapter = state.request.adapter
        if not adapter:
            return [1.0] * len(endpoints)
        p = self.params
        values = (p.running, p.free_slot, p.waiting, p.none)
        return [
            values[lora_tier(e, adapter)] if e.metrics.known else NEUTRAL for e in endpoints
        ]

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The endpoints running the adapter, then those with it waiting, the least queued
        first (those with a free slot are among the least queued the profile adds)."""
        adapter = state.request.adapter
        if not adapter:
            return []
        held = sorted(pool.holding(adapter), key=lambda e: (lora_tier(e, adapter), e.queue))
        return held[:k]


def lora_tier(endpoint: Endpoint, adapter: str) -> int:
    """0 running, 1 free slot, 2 waiting, 3 none: lower is better."""
    m = endpoint.metrics
    if adapter in m.running_adapters:
        return 0
    if m.max_adapters > 0 and len(m.running_adapters | m.waiting_adapters) < m.max_adapters:
        return 1
    if adapter in m.waiting_adapters:
        return 2
    if m.max_adapters == 0 and not m.running_adapters and not m.waiting_adapters:
        return 1  # server reports no LoRA state: treat as able to load it
    return 3
