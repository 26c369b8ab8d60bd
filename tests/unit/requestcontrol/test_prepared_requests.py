"""A request's preparation (the precise producer tokenizing it) travels with the request:
however many wait in flow control's queue, each is keyed once, in a worker thread, and a
request flow control refuses at once is not keyed at all (issue 70, item 6)."""

from __future__ import annotations

import asyncio
import random
import threading

from prometheus_client import CollectorRegistry

from epp.datastore.store import Datastore
from epp.errors import Overloaded
from epp.extproc.stream import Held  # what the ext_proc stream hands the Director
from epp.flowcontrol.controller import FlowControlConfig
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.observability.metrics import EppMetrics
from epp.plugins.pickers import MaxScorePicker, PickerParams
from epp.plugins.preciseprefix.params import PreciseIndexConfig
from epp.plugins.preciseprefix.producer import PrecisePrefixProducer
from epp.prefix.blockhash import BlockKeys
from epp.requestcontrol.director import Director
from epp.scheduling.profile import Profile
from epp.scheduling.saturation import SaturationConfig
from epp.scheduling.scheduler import Scheduler

A = EndpointId("10.0.0.1:8000")


class ThreadRecordingKeyer:
    """Keys every request alike and records on which thread each was keyed."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.lock = threading.Lock()

    def keys(self, request: InferenceRequest) -> BlockKeys:
        with self.lock:
            self.threads.append(threading.current_thread().name)
        return BlockKeys([1, 2, 3], 16, 48)


async def test_thousands_queued_are_each_keyed_once_off_the_loop_and_refused_ones_never() -> None:
    keyer = ThreadRecordingKeyer()
    producer = PrecisePrefixProducer("precise", PreciseIndexConfig(), keyer)  # type: ignore[arg-type]
    sched = Scheduler(Profile("p", [], [], MaxScorePicker("pick", PickerParams())), [producer],
                      random.Random(0))  # fmt: skip
    store = Datastore(stale_after_s=600.0)
    store.upsert(Endpoint(A, "10.0.0.1", 8000))
    store.update_metrics(A, Metrics(scraped_at_s=0.0))
    flow = FlowControlConfig(enabled=True, saturation="concurrency", max_concurrency=1,
                             max_requests=5_000, max_queue_seconds=600.0)  # fmt: skip
    director = Director(store, sched, SaturationConfig(), EppMetrics(CollectorRegistry()), flow=flow)
    admission = director.enable_admission()
    first = director.route(InferenceRequest("blocker", "m", "x"), None)  # the pool is full
    keyer.threads.clear()  # that one was not prepared ahead: keyed at its pick
    n = 5_000  # more than the 4,096 keys the producer used to keep aside
    held = [Held(InferenceRequest(f"r{i}", "m", "x" * 64), 64, {}) for i in range(n)]
    waiting = [asyncio.ensure_future(director.admit_held(h)) for h in held]
    while admission.controller.count < n:
        await asyncio.sleep(0.01)  # each offer is made on its first step
    refused = [Held(InferenceRequest(f"late{i}", "m", "x" * 64), 64, {}) for i in range(50)]
    for h in refused:  # the queue is full: refused at once
        assert isinstance(await director.admit_held(h), Overloaded)
    keyed_before_routing = len(keyer.threads)
    assert keyed_before_routing <= n  # the 50 refused were never keyed
    dispatcher = asyncio.ensure_future(admission.run())
    try:
        director.finish(first, _ok())
        for h, w in zip(held, waiting, strict=True):
            assert await asyncio.wait_for(w, 30) is None
            routing = director.route(h.request, None, prepared=h.prepared)
            director.finish(routing, _ok())
    finally:
        dispatcher.cancel()
    loop_thread = threading.current_thread().name
    assert len(keyer.threads) == n  # once each, whatever the queue's length
    assert loop_thread not in keyer.threads  # never on the event loop
    assert all(t.startswith("epp-prepare") for t in keyer.threads)


def _ok():  # type: ignore[no-untyped-def]
    from epp.framework.types import ResponseInfo

    return ResponseInfo(200)
