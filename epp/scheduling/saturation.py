"""Saturation: is every endpoint of the pool too busy (or unknown) to take more work?"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import Endpoint


@dataclass(slots=True, frozen=True)
class SaturationConfig:
    """The ``saturation:`` config section."""

    queue_threshold: int = 5
    """An endpoint with more requests waiting (scraped, plus those epp sent since) is saturated."""
    kv_cache_threshold: float = 0.8
    """An endpoint using more of its KV cache (0-1) is saturated."""
    metrics_staleness_seconds: float = 2.0
    """Metrics older than this make an endpoint count as saturated (unknown)."""


def endpoint_fresh(endpoint: Endpoint, cfg: SaturationConfig, now_s: float) -> bool:
    """Its metrics are known, not stale and younger than ``metrics_staleness_seconds``."""
    m = endpoint.metrics
    return m.known and not endpoint.stale and now_s - m.scraped_at_s <= cfg.metrics_staleness_seconds


def endpoint_saturated(endpoint: Endpoint, cfg: SaturationConfig, now_s: float) -> bool:
    if not endpoint_fresh(endpoint, cfg, now_s):
        return True
    m = endpoint.metrics
    return endpoint.queue > cfg.queue_threshold or m.kv_usage > cfg.kv_cache_threshold


def pool_saturated(endpoints: Sequence[Endpoint], cfg: SaturationConfig, now_s: float) -> bool:
    """True when no endpoint has room: every one is over a threshold or has stale metrics."""
    return all(endpoint_saturated(e, cfg, now_s) for e in endpoints)
