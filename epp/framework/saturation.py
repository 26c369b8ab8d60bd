"""The ``saturation:`` config section: when an endpoint, and so the pool, counts as having
no room. A value type of the config; the detectors that apply it live in
``epp.scheduling.saturation``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SaturationConfig"]


@dataclass(slots=True, frozen=True)
class SaturationConfig:
    """The ``saturation:`` config section."""

    queue_threshold: int = 5
    """An endpoint with more requests waiting (scraped, plus those epp sent since) is saturated."""
    kv_cache_threshold: float = 0.8
    """An endpoint using more of its KV cache (0-1) is saturated."""
    metrics_staleness_seconds: float = 2.0
    """Metrics older than this make an endpoint count as saturated (unknown)."""
