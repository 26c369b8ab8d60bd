from __future__ import annotations

import dataclasses

from epp.datastore.poolindex import IndexedPool
from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, EndpointId, Metrics


def test_in_flight_accounting_keeps_every_other_field() -> None:
    e = Endpoint(
        EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000, {"app": "vllm"},
        Metrics(waiting=3, scraped_at_s=1.0), metrics_port=9000, stale=True,
    )
    store = Datastore()
    view = store.in_flight_view()  # live: taken before anything is counted
    store.upsert(e)
    store.request_started(e.id)
    store.request_started(e.id)
    store.request_finished(e.id)
    assert dict(view) == {e.id: 1} and view.get(EndpointId("gone:1"), 0) == 0
    got = store.get(e.id)
    assert got == dataclasses.replace(e, pending=1)  # the one that finished waits no more
    assert got is not None and got.queue == 3 + 1 and store.in_flight() == {e.id: 1}
    store.update_metrics(e.id, Metrics(waiting=1, scraped_at_s=2.0))  # a scrape resets pending
    got = store.get(e.id)
    assert got is not None and (got.pending, got.queue) == (0, 1)
    assert store.in_flight() == {e.id: 1}


def test_pending_counts_only_what_was_sent_since_the_scrape_and_is_still_in_flight() -> None:
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store = Datastore()
    store.upsert(e)
    store.update_metrics(e.id, Metrics(waiting=0, scraped_at_s=1.0))

    def pending() -> int:
        got = store.get(e.id)
        assert got is not None
        return got.pending

    for _ in range(8):  # a session's quick turns, one after another, between two scrapes
        store.request_started(e.id)
        store.request_finished(e.id)
    assert pending() == 0
    store.request_started(e.id)  # in flight across the scrape: the scrape sees it
    store.update_metrics(e.id, Metrics(running=1, scraped_at_s=2.0))
    store.request_started(e.id)
    store.request_started(e.id)
    assert pending() == 2
    store.request_finished(e.id)  # whichever finished, at most 2 of the 3 in flight are new
    assert pending() == 2
    store.request_finished(e.id)
    assert pending() == 1
    store.request_sent(e.id)  # a disaggregated prefill: its end is not seen, a scrape resets it
    store.request_finished(e.id)
    assert pending() == 1
    store.update_metrics(e.id, Metrics(scraped_at_s=3.0))
    assert pending() == 0


def test_an_endpoint_never_scraped_counts_its_requests_in_flight() -> None:
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store = Datastore()
    store.upsert(e)
    for _ in range(3):
        store.request_started(e.id)
    store.request_finished(e.id)
    got = store.get(e.id)
    assert got is not None and got.pending == 2 == store.in_flight()[e.id]


def test_removal_notifies_listeners_and_vanished_endpoints_are_ignored() -> None:
    store = Datastore()
    removed: list[str] = []
    store.on_removed(removed.append)
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store.replace_all([e])
    assert store.synced and len(store) == 1
    store.replace_all([])
    assert removed == [e.id] and store.snapshot() == ()
    store.request_started(e.id)  # vanished: no error, nothing counted
    store.update_metrics(e.id, Metrics(scraped_at_s=1.0))
    assert store.get(e.id) is None


def test_a_new_endpoint_gets_a_grace_period_before_it_is_reported_stale() -> None:
    store = Datastore(stale_after_s=2.0)
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store.upsert(e)
    assert store.mark_stale(100.0) == []  # just added, never scraped yet: not reported
    assert store.mark_stale(101.5) == []
    assert store.mark_stale(102.5) == [e.id]  # still no good scrape after 2 s
    store.update_metrics(e.id, Metrics(scraped_at_s=103.0))
    assert store.mark_stale(104.0) == [] and not store.snapshot()[0].stale
    assert store.mark_stale(105.5) == [e.id]  # the last good scrape is 2.5 s old


def test_a_stall_of_epps_own_loop_is_not_taken_for_the_servers_going_silent() -> None:
    """The scrapes stall with epp's loop: a fresh endpoint is judged from when the loop came
    back, and goes stale only if no good scrape follows within the limit; one stale before the
    stall stays stale until a good scrape."""
    store = Datastore(stale_after_s=2.0)
    fresh = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    dead = Endpoint(EndpointId("10.0.0.2:8000"), "10.0.0.2", 8000)
    store.replace_all([fresh, dead])
    store.update_metrics(fresh.id, Metrics(scraped_at_s=100.0))
    store.update_metrics(dead.id, Metrics(scraped_at_s=95.0))
    assert store.mark_stale(100.0) == [dead.id]
    # the loop stalled from 100.1 to 107: the last good scrape is 7 s old, but the scrapes
    # have had no time to run since the loop resumed
    assert store.mark_stale(107.0, resumed_s=107.0) == []
    assert store.mark_stale(108.5, resumed_s=107.0) == [] and store.get(dead.id).stale  # type: ignore[union-attr]
    assert store.mark_stale(109.5, resumed_s=107.0) == [fresh.id]  # still silent 2.5 s after
    store.update_metrics(fresh.id, Metrics(scraped_at_s=109.6))
    assert store.mark_stale(109.7, resumed_s=107.0) == [] and not store.get(fresh.id).stale  # type: ignore[union-attr]


def test_an_endpoint_that_answers_requests_is_not_stale_whatever_its_scrapes_do() -> None:
    """Answers found at a ``mark_stale`` count as a good scrape at that moment: an endpoint
    whose ``/metrics`` times out while it serves stays routable, and one already stale comes
    back; silent on both counts, it goes stale as before."""
    store = Datastore(stale_after_s=2.0)
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store.upsert(e)
    store.update_metrics(e.id, Metrics(scraped_at_s=100.0))
    store.request_answered(e.id)
    assert store.mark_stale(101.0) == []  # answers seen at 101
    assert store.mark_stale(102.5) == []  # the scrape is 2.5 s old, the answers 1.5 s
    assert store.mark_stale(103.5) == [e.id]  # nothing since 101
    store.request_answered(e.id)
    assert store.mark_stale(104.0) == [] and not store.snapshot()[0].stale
    store.request_answered(EndpointId("10.0.0.9:8000"))  # gone: nothing to count


def test_endpoints_with_stale_metrics_are_not_routable_while_others_are_fresh() -> None:
    store = Datastore(stale_after_s=2.0)
    a = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    b = Endpoint(EndpointId("10.0.0.2:8000"), "10.0.0.2", 8000)
    store.replace_all([a, b])
    store.mark_stale(0.0)
    assert [e.id for e in store.routable()] == [a.id, b.id]  # new: both get their grace
    store.update_metrics(a.id, Metrics(scraped_at_s=1.0))
    store.update_metrics(b.id, Metrics(scraped_at_s=1.0))
    store.update_metrics(a.id, Metrics(scraped_at_s=4.0))  # b's scrapes start failing
    assert store.mark_stale(4.0) == [b.id]
    assert [e.id for e in store.routable()] == [a.id]
    assert store.mark_stale(7.0) == [a.id]  # every endpoint stale: all are tried
    assert [e.id for e in store.routable()] == [a.id, b.id]
    store.update_metrics(b.id, Metrics(scraped_at_s=7.5))  # b recovers
    assert [e.id for e in store.routable()] == [b.id]


def test_snapshot_and_routable_follow_per_request_load_changes() -> None:
    store = Datastore(stale_after_s=2.0)
    eps = [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000) for i in range(4)]
    store.replace_all(eps)
    for e in eps:
        store.update_metrics(e.id, Metrics(waiting=1, scraped_at_s=1.0))
    before = store.snapshot()
    store.request_started(eps[2].id)
    after = store.snapshot()
    assert after is not before and [e.id for e in after] == [e.id for e in eps]
    assert [e.queue for e in after] == [1, 1, 2, 1] and tuple(store.routable()) == after
    store.mark_stale(10.0)  # everyone stale: routable is everyone
    store.update_metrics(eps[0].id, Metrics(waiting=0, scraped_at_s=10.0))
    assert [e.id for e in store.routable()] == [eps[0].id]
    store.request_started(eps[0].id)
    store.request_started(eps[1].id)  # a stale endpoint's load changes too
    assert [(e.id, e.queue) for e in store.routable()] == [(eps[0].id, 1)]
    assert [e.queue for e in store.snapshot()] == [1, 2, 2, 1]


def test_with_every_endpoint_fresh_routable_is_the_snapshot_and_stays_cached() -> None:
    store = Datastore(stale_after_s=2.0)
    eps = [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000) for i in range(3)]
    store.replace_all(eps)
    for e in eps:
        store.update_metrics(e.id, Metrics(scraped_at_s=1.0))
    routable = store.routable()  # the snapshot itself, with the pool index
    assert isinstance(routable, IndexedPool) and routable.endpoints is store.snapshot()
    assert store.routable() is routable
    store.request_started(eps[1].id)  # a request's load patch keeps it: no rebuild per request
    routable = store.routable()
    assert isinstance(routable, IndexedPool) and routable.endpoints is store.snapshot()
    assert routable[1].queue == 1 and routable.least("queue", 1)[0].id != eps[1].id


def test_a_never_scraped_endpoint_queues_its_requests_in_flight() -> None:
    store = Datastore()
    e = Endpoint(EndpointId("10.0.0.1:8000"), "10.0.0.1", 8000)
    store.upsert(e)
    for _ in range(3):
        store.request_started(e.id)
    store.request_finished(e.id)
    got = store.get(e.id)
    assert got is not None and got.queue == 2 and store.snapshot()[0].queue == 2


def test_the_routable_pool_keeps_its_index_through_stale_endpoints_and_request_patches() -> None:
    store = Datastore(stale_after_s=2.0)
    eps = [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000) for i in range(5)]
    store.replace_all(eps)
    for i, e in enumerate(eps):
        store.update_metrics(e.id, Metrics(waiting=i, scraped_at_s=1.0))
    store.mark_stale(5.0)  # every one stale, then two scraped again
    store.update_metrics(eps[3].id, Metrics(waiting=0, scraped_at_s=5.0))
    store.update_metrics(eps[4].id, Metrics(waiting=0, scraped_at_s=5.0))
    routable = store.routable()
    assert isinstance(routable, IndexedPool) and [e.id for e in routable] == [eps[3].id, eps[4].id]
    store.request_started(eps[4].id)
    store.request_started(eps[4].id)
    store.request_started(eps[0].id)  # stale: not routable, the routable tuple is unchanged
    routable = store.routable()
    assert isinstance(routable, IndexedPool)
    assert [(e.id, e.queue) for e in routable] == [(eps[3].id, 0), (eps[4].id, 2)]
    assert [e.id for e in routable.least("queue", 5)] == [eps[3].id, eps[4].id]  # stale ones left out
    assert routable.queue_range() == (0, 2) and eps[0].id not in routable.ids
