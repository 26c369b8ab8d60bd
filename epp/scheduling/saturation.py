"""Saturation: does the pool have room for more work? One protocol, two detectors.

* ``ThresholdDetector`` (the ``saturation`` section; the default): an endpoint is saturated
  when its queue (waiting, plus what epp sent since the last scrape, still in flight) or its
  KV-cache use is over a threshold, or its metrics are not fresh. Flow control calls the pool
  full when no endpoint has room; released-but-unrouted requests count as queued on the
  least-queued endpoint. With no fresh metrics at all the pool is not called full (a metrics outage must
  not hold every request; the shedding rule, ``pool_saturated``, still applies).
* ``ConcurrencyDetector`` (``flowControl.saturation: concurrency``): the endpoints' free
  slots (``maxConcurrency`` minus epp's requests in flight there) exceed the
  released-but-unrouted requests.

The Director builds one detector when it is built (``detector``) and asks it, never a name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.saturation import SaturationConfig


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
    """The shedding rule: no endpoint has room (every one is over a threshold or has stale
    metrics)."""
    return all(endpoint_saturated(e, cfg, now_s) for e in endpoints)


class SaturationDetector(Protocol):
    def full(self, endpoints: Sequence[Endpoint], reserved: int, now_s: float) -> bool:
        """No room for one more request, with ``reserved`` released but not yet routed."""
        ...

    def level(self, endpoints: Sequence[Endpoint], now_s: float) -> float:
        """How full the pool is, 0-1 (the ``inference_pool_saturation`` gauge)."""
        ...


@dataclass(slots=True, frozen=True)
class ThresholdDetector:
    cfg: SaturationConfig

    def full(self, endpoints: Sequence[Endpoint], reserved: int, now_s: float) -> bool:
        cfg = self.cfg
        room = [e for e in endpoints if not endpoint_saturated(e, cfg, now_s)]
        if not room:
            # no fresh metrics anywhere (scrapes failing, or none yet): the detector cannot
            # judge, and holding every request until it expires would turn a metrics outage
            # into an outage; let them through (the shedding rule still applies)
            return any(endpoint_fresh(e, cfg, now_s) for e in endpoints)
        if not reserved:
            return False
        least = min(e.queue for e in room)
        return least + reserved > cfg.queue_threshold

    def level(self, endpoints: Sequence[Endpoint], now_s: float) -> float:
        """The share of endpoints over a threshold (or without fresh metrics)."""
        full = sum(1 for e in endpoints if endpoint_saturated(e, self.cfg, now_s))
        return full / len(endpoints) if endpoints else 0.0


@dataclass(slots=True, frozen=True)
class ConcurrencyDetector:
    in_flight: Mapping[EndpointId, int]
    """epp's requests in flight per endpoint (a live view)."""
    limit: int

    def full(self, endpoints: Sequence[Endpoint], reserved: int, now_s: float) -> bool:
        limit, in_flight = self.limit, self.in_flight
        free = sum(max(0, limit - in_flight.get(e.id, 0)) for e in endpoints if not e.stale)
        return free - reserved <= 0

    def level(self, endpoints: Sequence[Endpoint], now_s: float) -> float:
        """The share of the concurrency slots in use."""
        limit = self.limit
        used = sum(min(limit, self.in_flight.get(e.id, 0)) for e in endpoints)
        return used / (limit * len(endpoints)) if endpoints else 0.0


def detector(
    kind: Literal["thresholds", "concurrency"],
    cfg: SaturationConfig,
    in_flight: Mapping[EndpointId, int],
    max_concurrency: int,
) -> SaturationDetector:
    """The detector ``flowControl.saturation`` names."""
    if kind == "concurrency":
        return ConcurrencyDetector(in_flight, max_concurrency)
    return ThresholdDetector(cfg)
