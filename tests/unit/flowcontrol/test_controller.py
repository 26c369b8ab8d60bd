"""Flow control's queueing rules: bands, fairness between flows, ordering inside a flow,
capacity and displacement, expiry, cancellation and drain."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epp.flowcontrol.controller import FlowControlConfig, FlowController, QueuedRequest
from epp.framework.request import InferenceRequest


class Pool:
    """A saturation detector with ``room`` free slots (released requests use them up)."""

    def __init__(self, room: int = 0) -> None:
        self.room = room

    def __call__(self, reserved: int) -> bool:
        return self.room - reserved <= 0


def req(rid: str, priority: int = 0, model: str = "m") -> InferenceRequest:
    return InferenceRequest(rid, model, "p", priority=priority)


def make(room: int = 0, **cfg: object) -> tuple[FlowController, Pool]:
    pool = Pool(room)
    return FlowController(replace(FlowControlConfig(enabled=True), **cfg), pool), pool  # type: ignore[arg-type]


def ids(items: list[QueuedRequest]) -> list[str]:
    return [i.request.request_id for i in items]


def release(c: FlowController, pool: Pool, n: int, now: float = 1.0) -> list[str]:
    pool.room = n
    out = c.dispatch(now)
    for _ in out:
        c.routed()
    pool.room = 0
    return ids(out)


def test_room_and_an_empty_queue_let_a_request_through_at_once() -> None:
    c, _ = make(room=1)
    assert c.offer(req("a"), "t", 10, 0.0).go
    c, _ = make(room=0)
    offer = c.offer(req("a"), "t", 10, 0.0)
    assert not offer.go and offer.item is not None and c.count == 1 and c.bytes == 10


def test_higher_bands_first_then_flows_take_turns_fcfs_inside_each() -> None:
    c, pool = make()
    for rid, flow, prio in [("a1", "A", 0), ("a2", "A", 0), ("a3", "A", 0), ("b1", "B", 0),
                            ("b2", "B", 0), ("hi", "C", 5), ("lo", "D", -1)]:  # fmt: skip
        c.offer(req(rid, prio), flow, 1, 0.0)
    assert release(c, pool, 7) == ["hi", "a1", "b1", "a2", "b2", "a3", "lo"]


def test_a_burst_from_one_flow_does_not_starve_another() -> None:
    c, pool = make()
    for i in range(50):
        c.offer(req(f"noisy{i}"), "noisy", 1, 0.0)
    c.offer(req("quiet"), "quiet", 1, 0.1)
    assert "quiet" in release(c, pool, 2)  # second in line, not 51st


def test_global_strict_serves_the_oldest_head_across_flows() -> None:
    c, pool = make(fairness="global-strict")
    for i, (rid, flow) in enumerate([("a1", "A"), ("a2", "A"), ("b1", "B")]):
        c.offer(req(rid), flow, 1, float(i))
    assert release(c, pool, 3) == ["a1", "a2", "b1"]


def test_earliest_deadline_first_inside_a_flow() -> None:
    c, pool = make(ordering="edf", max_queue_seconds=100)
    c.offer(req("late"), "A", 1, 0.0)
    c.offer(req("urgent"), "A", 1, 1.0, deadline_s=5.0)
    assert release(c, pool, 2) == ["urgent", "late"]


def test_a_full_queue_displaces_the_newest_of_the_lowest_band() -> None:
    c, _ = make(max_requests=3)
    c.offer(req("lo1", -1), "A", 1, 0.0)
    c.offer(req("lo2", -1), "A", 1, 0.1)
    c.offer(req("mid", 0), "B", 1, 0.2)
    offer = c.offer(req("hi", 5), "C", 1, 0.3)
    assert offer.item is not None and ids(list(offer.displaced)) == ["lo2"]
    assert offer.displaced[0].outcome == "displaced" and c.count == 3
    same = c.offer(req("lo3", -1), "A", 1, 0.4)  # nothing lower to displace: rejected
    assert same.item is None and same.rejected == "queue-full"
    off, _ = make(max_requests=1, displacement=False)
    off.offer(req("x", -1), "A", 1, 0.0)
    assert off.offer(req("y", 5), "A", 1, 0.0).rejected == "queue-full"


def test_band_and_byte_limits() -> None:
    c, _ = make(band_max_requests=1, max_bytes=100)
    c.offer(req("a"), "A", 10, 0.0)
    assert c.offer(req("b"), "A", 10, 0.0).rejected == "band-full"
    assert c.offer(req("c", 3), "A", 10, 0.0).item is not None  # another band has room
    assert c.offer(req("d", 4), "A", 200, 0.0).rejected == "queue-full"  # bytes


def test_expiry_cancellation_and_drain() -> None:
    c, pool = make(max_queue_seconds=2.0)
    a = c.offer(req("a"), "A", 1, 0.0).item
    b = c.offer(req("b"), "A", 1, 1.0).item
    d = c.offer(req("d"), "B", 1, 1.5).item
    assert a is not None and b is not None and d is not None
    assert ids(c.expire(2.5)) == ["a"] and a.outcome == "expired"
    assert c.cancel(b) and b.outcome == "cancelled" and not c.cancel(b)
    assert release(c, pool, 5, now=2.6) == ["d"]
    e = c.offer(req("e"), "A", 1, 3.0).item
    assert e is not None and ids(c.drain()) == ["e"] and e.outcome == "shutdown"
    assert c.count == 0 and c.bytes == 0 and not c.bands
    assert c.stats.rejected == {"expired": 1, "cancelled": 1, "shutdown": 1}


def test_released_requests_count_until_routed() -> None:
    c, pool = make()
    for i in range(3):
        c.offer(req(f"r{i}"), "A", 1, 0.0)
    pool.room = 2
    assert len(c.dispatch(0.0)) == 2 and c.reserved == 2
    assert c.dispatch(0.0) == []  # the two released ones hold the room until routed
    c.routed()
    c.routed()
    pool.room = 0
    assert c.dispatch(0.0) == []


@pytest.mark.parametrize("n", [1, 7, 40])
def test_nothing_is_lost(n: int) -> None:
    c, pool = make(max_requests=n // 2 + 1, max_queue_seconds=1.0)
    outcomes: dict[str, str] = {}
    for i in range(n):
        offer = c.offer(req(f"r{i}", i % 3 - 1), f"f{i % 4}", 1, i * 0.1)
        if offer.item is None:
            outcomes[f"r{i}"] = offer.rejected
        for v in offer.displaced:
            outcomes[v.request.request_id] = v.outcome
        if i % 5 == 0:
            pool.room = 1
            for item in c.dispatch(i * 0.1):
                outcomes[item.request.request_id] = item.outcome
                c.routed()
            pool.room = 0
        for item in c.expire(i * 0.1):
            outcomes[item.request.request_id] = item.outcome
    for item in c.drain():
        outcomes[item.request.request_id] = item.outcome
    assert len(outcomes) == n and c.count == 0


def test_the_thresholds_detector_fails_open_without_fresh_metrics() -> None:
    from epp.framework.endpoint import Endpoint, EndpointId, Metrics
    from epp.framework.saturation import SaturationConfig
    from epp.scheduling.saturation import ThresholdDetector

    cfg = SaturationConfig(queue_threshold=2, metrics_staleness_seconds=1.0)

    def thresholds(endpoints: list[Endpoint], cfg: SaturationConfig, now_s: float, reserved: int) -> bool:
        return ThresholdDetector(cfg).full(endpoints, reserved, now_s)

    def ep(waiting: int, scraped_at_s: float) -> Endpoint:
        return Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000,
                        metrics=Metrics(waiting=waiting, scraped_at_s=scraped_at_s))  # fmt: skip

    assert thresholds([ep(5, 10.0)], cfg, 10.5, 0)  # fresh and over the threshold: full
    assert not thresholds([ep(0, 10.0)], cfg, 10.5, 0)  # room
    assert not thresholds([ep(0, 10.0)], cfg, 10.5, 1) and thresholds([ep(2, 10.0)], cfg, 10.5, 1)
    assert not thresholds([ep(5, 10.0)], cfg, 30.0, 0)  # stale everywhere: cannot judge
    assert not thresholds([ep(0, 0.0)], cfg, 30.0, 0)  # never scraped


def test_each_band_and_each_objective_waits_its_own_limit() -> None:
    c, _ = make(max_queue_seconds=10.0, band_max_queue_seconds={100: 60.0, -10: 2.0},
                objective_max_queue_seconds={"premium": 120.0})  # fmt: skip
    sheddable = c.offer(req("shed", -10), "t", 1, 0.0).item
    critical = c.offer(req("crit", 100), "t", 1, 0.0).item
    plain = c.offer(req("plain", 0), "t", 1, 0.0).item
    premium = c.offer(replace(req("prem", 100), objective="premium"), "t", 1, 0.0).item
    unknown = c.offer(replace(req("other", 0), objective="not-configured"), "t", 1, 0.0).item
    assert [i.limit_s for i in (sheddable, critical, plain, premium, unknown)] == [  # type: ignore[union-attr]
        2.0, 60.0, 10.0, 120.0, 10.0]  # fmt: skip
    assert ids(c.expire(2.0)) == ["shed"]
    assert ids(c.expire(10.0)) == ["plain", "other"]
    assert ids(c.expire(60.0)) == ["crit"]
    assert ids(c.expire(119.9)) == [] and ids(c.expire(120.0)) == ["prem"]
    assert c.cfg.longest_hold_seconds() == 120.0
    # a request's own deadline header still shortens its limit
    short = c.offer(req("short", 100), "t", 1, 200.0, deadline_s=201.0).item
    assert short is not None and short.deadline_s == 201.0


@pytest.mark.parametrize(("field", "value"), [("band_max_queue_seconds", {5: 0.0}),
                                              ("objective_max_queue_seconds", {"x": -1.0}),
                                              ("band_max_queue_seconds", {5: float("inf")})])  # fmt: skip
def test_a_per_band_or_objective_limit_must_be_positive(field: str, value: object) -> None:
    from epp.errors import ConfigError

    with pytest.raises(ConfigError, match="flowControl"):
        replace(FlowControlConfig(enabled=True), **{field: value})


class Empty:
    """The pool's readiness: no endpoint ready while ``empty``."""

    def __init__(self) -> None:
        self.empty = True

    def __call__(self) -> bool:
        return self.empty


def cold(**cfg: object) -> tuple[FlowController, Pool, Empty]:
    pool, empty = Pool(room=10), Empty()
    c = FlowController(replace(FlowControlConfig(enabled=True), **cfg), pool, empty)  # type: ignore[arg-type]
    return c, pool, empty


def test_with_no_ready_endpoint_requests_wait_and_leave_when_the_first_is_ready() -> None:
    c, _, empty = cold(max_queue_seconds=5.0, scale_from_zero_seconds=60.0)
    items = [c.offer(req(f"r{i}"), "t", 10, float(i)).item for i in range(20)]
    assert all(i is not None for i in items) and c.count == 20
    assert c.dispatch(8.0) == [] and c.expire(8.0) == []  # nothing to send to, nothing expired
    empty.empty = False  # the first endpoint is ready (room for 10 at once)
    first = c.dispatch(8.1)
    assert len(first) == 10 and ids(first) == [f"r{i}" for i in range(10)]
    for _ in first:
        c.routed()
    assert len(c.dispatch(8.2)) == 10 and c.count == 0


def test_the_wait_for_a_ready_endpoint_is_bounded_in_count_bytes_and_time() -> None:
    c, _, _ = cold(max_queue_seconds=5.0, scale_from_zero_seconds=60.0,
                   scale_from_zero_max_requests=3, scale_from_zero_max_bytes=25)  # fmt: skip
    assert c.offer(req("a"), "t", 10, 0.0).item is not None
    assert c.offer(req("b"), "t", 10, 0.0).item is not None
    assert c.offer(req("c"), "t", 10, 0.0).rejected == "no-endpoints"  # 30 bytes > 25
    assert c.offer(req("d"), "t", 5, 0.0).item is not None
    assert c.offer(req("e"), "t", 1, 0.0).rejected == "no-endpoints"  # a fourth request
    assert c.expire(59.9) == [] and ids(c.expire(60.0)) == ["a", "b", "d"]
    assert c.stats.rejected == {"no-endpoints": 2, "expired": 3}


def test_scale_from_zero_off_rejects_at_once_and_unset_follows_max_queue_seconds() -> None:
    off, _, _ = cold(scale_from_zero_seconds=0.0)
    assert off.offer(req("a"), "t", 1, 0.0).rejected == "no-endpoints"
    unset, _, _ = cold(max_queue_seconds=7.0)
    item = unset.offer(req("a"), "t", 1, 0.0).item
    assert item is not None and item.limit_s == 7.0
    # a band that may wait longer keeps its own limit while the pool comes up
    longer, _, _ = cold(max_queue_seconds=7.0, band_max_queue_seconds={9: 90.0})
    item = longer.offer(req("a", 9), "t", 1, 0.0).item
    assert item is not None and item.limit_s == 90.0
def held_entries(c: FlowController) -> int:
    """Queue entries the controller keeps references to (flows, their heaps, deadlines)."""
    flows = [f for band in c.bands.values() for f in band.flows.values()]
    return len(c._deadlines) + sum(len(f.items) + len(f.heap) for f in flows)


@pytest.mark.parametrize("ordering", ["fcfs", "edf"])
def test_cancelled_requests_leave_the_queues_memory(ordering: str) -> None:
    """5,000 enqueue-and-cancel cycles behind a blocked head: the queue reports one request
    and holds about one, not 5,001 prompts until their deadline (issue 70, item 5)."""
    import tracemalloc

    c, _ = make(ordering=ordering, max_queue_seconds=3600)
    head = c.offer(req("head"), "A", 1, 0.0).item
    assert head is not None
    prompt = "p" * 10_000
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(5_000):
            item = c.offer(InferenceRequest(f"r{i}", "m", prompt + str(i)), "A", 10_000, 1.0).item
            assert item is not None and c.cancel(item)
            del item
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert c.count == 1 and c.bytes == 1 and held_entries(c) <= 2 * c.count + 64 + 16
    assert after - before < 1_000_000  # 5,000 prompts of 10 KB would be 50 MB


def test_displacement_takes_the_newest_of_the_largest_flow_without_a_scan() -> None:
    c, _ = make(max_requests=6)
    for i in range(4):
        c.offer(req(f"noisy{i}", -1), "noisy", 1, 0.1 * i)
    c.offer(req("quiet0", -1), "quiet", 1, 0.5)
    c.offer(req("mid", 0), "B", 1, 0.6)
    taken = [c.offer(req(f"hi{i}", 5), "C", 1, 1.0 + i).displaced for i in range(3)]
    assert [ids(list(d)) for d in taken] == [["noisy3"], ["noisy2"], ["noisy1"]]
    band = c.bands[-1]
    assert {n: len(f) for n, f in band.flows.items()} == {"noisy": 1, "quiet": 1}
    assert band.largest == 1 and c.count == 6
    # ties: either flow's newest goes; then the next band up, then nothing is left below
    assert len(c.offer(req("hi3", 5), "C", 1, 5.0).displaced) == 1
    assert len(c.offer(req("hi4", 5), "C", 1, 6.0).displaced) == 1
    assert -1 not in c.bands
    assert ids(list(c.offer(req("hi5", 5), "C", 1, 7.0).displaced)) == ["mid"]
    assert c.offer(req("hi6", 5), "C", 1, 8.0).rejected == "queue-full"
