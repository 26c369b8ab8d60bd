"""The SGLang router's cache_aware rule as an epp scorer: prefix holder above the threshold,
else the endpoint sent the least uncached text, and load alone when imbalanced."""

from __future__ import annotations

import random

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.plugins.cacheaware import CacheAwareParams, CacheAwareScorer

A, B, C = (EndpointId(f"10.0.0.{i}:8000") for i in (1, 2, 3))


def ep(eid: EndpointId) -> Endpoint:
    return Endpoint(eid, eid.split(":")[0], 8000)


def state(rid: str, chars: int, matched: dict[EndpointId, int] | None = None) -> CycleState:
    s = CycleState(InferenceRequest(rid, "m", "x" * chars), 0.0, random.Random(0))
    s.prefix = PrefixMatch(list(range(chars // 64)), matched or {}, 64)
    return s


def send(sc: CacheAwareScorer, s: CycleState, target: EndpointId) -> None:
    sc.post_pick(s, PickResult((ep(target),), s))


def test_a_match_over_the_threshold_goes_to_its_holder_else_to_the_least_sent() -> None:
    sc = CacheAwareScorer("c", CacheAwareParams())
    pool = [ep(A), ep(B), ep(C)]
    assert sc.score(state("r0", 6400), pool) == [1.0, 1.0, 1.0]  # nothing sent: all tie
    send(sc, state("r0", 6400), A)
    send(sc, state("r1", 3200), B)
    assert sc.sent_chars == {A: 6400, B: 3200}
    # 40 of 100 chunks held by B (over 0.3), 20 by A
    assert sc.score(state("r2", 6400, {A: 20, B: 40}), pool) == [0.0, 1.0, 0.0]
    # 25 of 100 (under 0.3): the endpoint sent the least text, C
    assert sc.score(state("r3", 6400, {B: 25}), pool) == [0.0, 0.0, 1.0]
    # what a pick had cached does not count as sent
    send(sc, state("r4", 6400, {B: 90}), B)
    assert sc.sent_chars[B] == 3200 + 640


def test_load_alone_decides_when_imbalanced_and_responses_release_it() -> None:
    # through the Director, whose in-flight count (Datastore.in_flight_view) the scorer reads
    from prometheus_client import CollectorRegistry

    from epp.config.loader import parse_config
    from epp.datastore.store import Datastore
    from epp.observability.metrics import EppMetrics
    from epp.requestcontrol.director import Director, Routing
    from epp.wiring import build_scheduler

    cfg = parse_config({
        "plugins": [{"type": "cache-aware-scorer",
                     "parameters": {"balanceAbsThreshold": 3, "balanceRelThreshold": 1.5}},
                    {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "p", "plugins": [
            {"pluginRef": "cache-aware-scorer", "weight": 1}, {"pluginRef": "max-score-picker"}]}],
    })  # fmt: skip
    ds = Datastore()
    ds.replace_all([ep(A), ep(B)])
    director = Director(ds, build_scheduler(cfg, rng=random.Random(1)), cfg.saturation,
                        EppMetrics(CollectorRegistry()), clock=lambda: 1.0)  # fmt: skip
    prompt = "the same long prompt " * 40

    def route(rid: str) -> Routing:
        routing = director.route(InferenceRequest(rid, "m", prompt), None)
        director.settle(routing)  # as the server does once the reply is sent: the pick is recorded
        return routing

    first = route("r0")
    holder = first.target_id
    other = B if holder == A else A
    # the prompt is now held by one endpoint: while loads are balanced it goes there...
    sent = [first] + [route(f"r{i}") for i in (1, 2, 3)]
    assert [r.target_id for r in sent] == [holder] * 4
    assert ds.in_flight() == {holder: 4, other: 0}
    # ...until 4 in flight against 0 is imbalanced (gap over 3, and over 1.5x): load decides,
    # though the prefix is on the first
    assert route("r4").target_id == other
    for r in sent[:3]:
        director.finish(r, ResponseInfo(200))
    assert ds.in_flight() == {holder: 1, other: 1}
    sc = director._scheduler.plugin(CacheAwareScorer)
    assert sc is not None
    # balanced again (the scorer reads the Director's live counts): the prefix decides
    s = state("x", 640, {holder: 10})
    s.in_flight = ds.in_flight_view()
    assert sc.score(s, [ep(holder), ep(other)]) == [1.0, 0.0]
    sc.remove_endpoint(holder)
    assert holder not in sc.sent_chars
