"""The SGLang router's cache_aware rule as an epp scorer: prefix holder above the threshold,
else the endpoint sent the least uncached text, and load alone when imbalanced."""

from __future__ import annotations

import random

from epp.datastore.endpoint import Endpoint, EndpointId
from epp.plugins.cacheaware import CacheAwareParams, CacheAwareScorer
from epp.request.types import InferenceRequest
from epp.scheduling.types import CycleState, PickResult, PrefixMatch, ResponseInfo

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
    sc = CacheAwareScorer("c", CacheAwareParams(balance_abs_threshold=2, balance_rel_threshold=1.5))
    sent = [state(f"r{i}", 640) for i in range(4)]
    for s in sent:
        send(sc, s, A)
    assert sc.in_flight == {A: 4}
    # A holds the whole prompt, but 4 in flight against 0 is imbalanced
    assert sc.score(state("x", 640, {A: 10}), [ep(A), ep(B)]) == [0.0, 1.0]
    for s in sent[:2]:
        sc.post_response(s, PickResult((ep(A),), s), ResponseInfo(200))
    assert sc.in_flight == {A: 2}
    assert sc.score(state("x", 640, {A: 10}), [ep(A), ep(B)]) == [1.0, 0.0]
    sc.remove_endpoint(A)
    assert sc.in_flight == {} and A not in sc.sent_chars
