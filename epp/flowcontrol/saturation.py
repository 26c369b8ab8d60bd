"""Saturation detectors for flow control: does the pool have room for one more request?

* ``thresholds``: some endpoint is under the ``saturation`` section's queue and KV-cache
  thresholds with fresh metrics (the queue counts what epp sent since the last scrape, so
  it rises as requests are released); released-but-unrouted requests count as queued on
  the least-queued endpoint. With no fresh metrics at all the pool is not called saturated
  (a metrics outage must not hold every request).
* ``concurrency``: the endpoints' free slots (``maxConcurrency`` minus epp's requests in
  flight there) exceed the released-but-unrouted requests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from epp.framework.endpoint import Endpoint, EndpointId
from epp.scheduling.saturation import SaturationConfig, endpoint_fresh, endpoint_saturated


def thresholds(
    endpoints: Sequence[Endpoint], cfg: SaturationConfig, now_s: float, reserved: int
) -> bool:
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


def concurrency(
    endpoints: Sequence[Endpoint], in_flight: Mapping[EndpointId, int], limit: int, reserved: int
) -> bool:
    free = sum(max(0, limit - in_flight.get(e.id, 0)) for e in endpoints if not e.stale)
    return free - reserved <= 0


def thresholds_level(endpoints: Sequence[Endpoint], cfg: SaturationConfig, now_s: float) -> float:
    """For the gauge: the share of endpoints over a threshold (or without fresh metrics)."""
    full = sum(1 for e in endpoints if endpoint_saturated(e, cfg, now_s))
    return full / len(endpoints) if endpoints else 0.0


def concurrency_level(
    endpoints: Sequence[Endpoint], in_flight: Mapping[EndpointId, int], limit: int
) -> float:
    """For the gauge: the share of the concurrency slots in use."""
    used = sum(min(limit, in_flight.get(e.id, 0)) for e in endpoints)
    return used / (limit * len(endpoints)) if endpoints else 0.0


Detector = Callable[[int], bool]
