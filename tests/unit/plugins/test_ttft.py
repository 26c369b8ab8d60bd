"""The predicted-TTFT scorer: prefers the endpoint with less work ahead and more of the
prompt cached, and fits its cost model to observed times to first token."""

from __future__ import annotations

import logging
import random

import pytest

from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.plugins.ttft import PredictedTtftParams, PredictedTtftScorer

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


def ep(eid: EndpointId, waiting: int = 0, running: int = 0) -> Endpoint:
    return Endpoint(eid, eid.split(":")[0], 8000,
                    metrics=Metrics(waiting=waiting, running=running, scraped_at_s=1.0))  # fmt: skip


def state(rid: str, chars: int, matched: dict[EndpointId, int] | None = None) -> CycleState:
    s = CycleState(InferenceRequest(rid, "m", "x" * chars), 0.0, random.Random(0))
    s.prefix = PrefixMatch(list(range(chars // 64)), matched or {}, 64)
    return s


def test_cached_prefix_and_short_queues_score_higher() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    idle, busy = ep(A), ep(B, waiting=6, running=20)
    scores = sc.score(state("r1", 8000), [idle, busy])
    assert scores[0] == 1.0 and scores[1] < 0.5
    cached = sc.score(state("r4", 64_000, {B: 1000}), [ep(A), ep(B, running=2)])
    assert cached[1] == 1.0 and cached[0] < 1.0  # 16k tokens cached on B outweigh 2 running


def test_the_cost_model_fits_observed_ttfts(caplog: pytest.LogCaptureFixture) -> None:
    # one endpoint: the shared model alone (calibration off; it would share the scale)
    sc = PredictedTtftScorer("t", PredictedTtftParams(prefill_seconds_per_token=1e-6, calibration_rate=0))
    caplog.set_level(logging.INFO, logger="epp.plugins.ttft")
    rng = random.Random(1)
    for i in range(400):  # the truth: 0.05 s + 3e-4 s per uncached token
        chars = rng.randrange(400, 40_000)
        s = state(f"r{i}", chars)
        endpoint = ep(A, running=rng.randrange(0, 3))
        sc.score(s, [endpoint])
        sc.post_pick(s, PickResult((endpoint,), s))
        sc.post_response(s, PickResult((endpoint,), s),
                         ResponseInfo(200, ttft_s=0.05 + 3e-4 * chars / 4))  # fmt: skip
    assert abs(sc.coef[1] - 3e-4) < 3e-5 and abs(sc.coef[0] - 0.05) < 0.02
    assert sc.errors.count == 400
    # the fit is logged (first after 50 responses, then at most every 30 s): here once
    fits = [r.getMessage() for r in caplog.records if "predicted-ttft model" in r.getMessage()]
    assert len(fits) == 1 and "after 50 responses" in fits[0] and "per uncached token" in fits[0]


def queued(s: CycleState, chars: dict[EndpointId, float]) -> CycleState:
    """``s`` with ``chars`` prompt characters queued to prefill per endpoint (the Director's
    prefill ledger, which the cycles read: ``CycleState.prefill``)."""
    s.prefill = chars
    return s


def test_prefill_sent_and_not_yet_answered_counts_as_work_queued_there() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams(calibration_rate=0))
    assert sc.features(queued(state("q", 400), {A: 64_000.0}), ep(A))[2] == 16_000  # 4 a token
    scores = sc.score(queued(state("next", 4_000), {A: 64_000.0}), [ep(A), ep(B)])
    assert scores[1] == 1.0 and scores[0] < 0.5  # A is still prefilling 16k tokens
    again = sc.score(state("after", 4_000), [ep(A), ep(B)])
    assert again[0] == again[1] == 1.0


def test_the_first_token_is_the_observation_and_the_end_adds_none() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams(calibration_rate=0))
    big = state("big", 64_000)
    sc.score(big, [ep(A), ep(B)])
    sc.post_pick(big, PickResult((ep(A),), big))
    sc.post_first_token(big, PickResult((ep(A),), big), 1.5)
    assert sc.errors.count == 1
    sc.post_response(big, PickResult((ep(A),), big), ResponseInfo(200, ttft_s=1.5))
    assert sc.errors.count == 1 and not big.data  # what it kept for the request is gone


def test_priors_hold_for_a_feature_the_observations_do_not_move() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    for i in range(50):  # no queue ever: the queued-prefill coefficient keeps its prior
        s = state(f"r{i}", 4_000 + 40 * i)
        sc.score(s, [ep(A)])
        sc.post_pick(s, PickResult((ep(A),), s))
        sc.post_first_token(s, PickResult((ep(A),), s), 0.02 + 9e-5 * (1_000 + 10 * i))
    assert abs(sc.coef[2] - 9e-5) < 1e-5
    assert abs(sc.coef[1] - 9e-5) < 2e-5


def test_the_fit_keeps_learning_when_a_feature_never_moves() -> None:
    # the prior decays with every observation; without a floor, the rows of features the
    # traffic never sets (no queue, no KV use here) vanish and the solve fails for good.
    # Forgetting 0.99 gets there in ~3,000 responses (0.999, the default: ~30,000)
    sc = PredictedTtftScorer("t", PredictedTtftParams(forgetting=0.99, calibration_rate=0))
    rng = random.Random(2)

    def serve(i: int, seconds_per_token: float) -> None:
        chars = rng.randrange(400, 16_000)
        s = state(f"r{i}", chars)
        sc.score(s, [ep(A)])
        sc.post_pick(s, PickResult((ep(A),), s))
        sc.post_first_token(s, PickResult((ep(A),), s), 0.02 + seconds_per_token * chars / 4)

    for i in range(5_000):
        serve(i, 1e-4)
    assert abs(sc.coef[1] - 1e-4) < 1e-5
    for i in range(5_000, 6_000):  # the server got 3x slower
        serve(i, 3e-4)
    assert abs(sc.coef[1] - 3e-4) < 3e-5


def session_state(rid: str, session: str, now_s: float) -> CycleState:
    s = CycleState(InferenceRequest(rid, "m", "x" * 4_000, headers={"x-session-id": session}),
                   now_s, random.Random(0))  # fmt: skip
    s.prefix = PrefixMatch(list(range(4_000 // 64)), {}, 64)
    return s


@pytest.mark.parametrize("learn", [True, False])
def test_new_sessions_spread_over_the_endpoints_their_turns_will_follow(learn: bool) -> None:
    # with learn: false too (a pinned cost model): the sessions were not recorded then
    sc = PredictedTtftScorer("t", PredictedTtftParams(calibration_rate=0, session_spread_seconds=0.2,
                                                      session_window_seconds=60.0, learn=learn))  # fmt: skip
    for i, target in enumerate((A, A, B)):  # sessions s0 and s1 on A, s2 on B
        s = session_state(f"r{i}", f"s{i}", 1.0)
        sc.score(s, [ep(A), ep(B)])
        sc.post_pick(s, PickResult((ep(target),), s))
        sc.post_first_token(s, PickResult((ep(target),), s), 0.1)
    assert sc.sessions_on == {A: 2, B: 1}
    # a new session: A carries one more session, 0.2 s more
    new = sc.score(session_state("r3", "s3", 2.0), [ep(A), ep(B)])
    assert new[1] == 1.0 and new[0] < 1.0
    # a known session is not charged: both endpoints alike
    known = sc.score(session_state("r4", "s0", 2.0), [ep(A), ep(B)])
    assert known[0] == known[1] == 1.0
    # a session moving counts once, where it went
    moved = session_state("r5", "s0", 3.0)
    sc.score(moved, [ep(A), ep(B)])
    sc.post_pick(moved, PickResult((ep(B),), moved))
    assert sc.sessions_on == {A: 1, B: 2}
    # past the window every session is forgotten
    sc.score(session_state("r6", "s9", 100.0), [ep(A), ep(B)])
    assert sc.sessions_on == {} and len(sc._sessions) == 0


def test_the_spread_grows_with_the_requests_the_active_sessions_have_made() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams(calibration_rate=0, session_spread_seconds=0.2,
                                                      session_spread_requests=4))  # fmt: skip
    pool = [ep(A), ep(B)]

    def turn(i: int, session: str, target: int, now_s: float) -> None:
        s = session_state(f"r{i}", session, now_s)
        sc.score(s, pool)
        sc.post_pick(s, PickResult((ep(target),), s))
        sc.post_first_token(s, PickResult((ep(target),), s), 0.1)

    def charge_on_a() -> float:  # a new session's extra seconds on A (one session there)
        charged = sc._spread_sessions(session_state("new", "fresh", 5.0), pool, [1.0, 1.0])
        assert charged[1] == 1.0
        return charged[0] - 1.0

    turn(0, "s0", A, 1.0)  # one session of one request on A: a quarter of the charge
    assert abs(charge_on_a() - 0.05) < 1e-3
    for i in range(1, 4):  # four requests so far: the full charge
        turn(i, "s0", A, 1.0 + i)
    assert sc._sessions.mean_requests() == 4
    assert abs(charge_on_a() - 0.2) < 1e-3


def test_session_spread_is_off_by_default() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    s = session_state("r0", "s0", 1.0)
    sc.score(s, [ep(A), ep(B)])
    sc.post_pick(s, PickResult((ep(A),), s))
    assert sc.sessions_on == {} and len(sc._sessions) == 0


def test_a_slower_endpoint_is_calibrated_apart_from_the_shared_model() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams(calibration_rate=0.1))  # opt-in
    rng = random.Random(2)
    for i in range(300):  # B takes three times as long as A for the same work
        chars = rng.randrange(4_000, 40_000)
        target = A if i % 2 else B
        s = state(f"r{i}", chars)
        sc.score(s, [ep(target)])
        sc.post_pick(s, PickResult((ep(target),), s))
        truth = 0.02 + 9e-5 * chars / 4
        sc.post_first_token(s, PickResult((ep(target),), s), truth * (1 if target == A else 3))
    assert 2.2 < sc.speed[B] / sc.speed[A] < 3.8
    scores = sc.score(state("next", 8_000), [ep(A), ep(B)])
    assert scores[0] == 1.0 and scores[1] < 0.5
    sc.remove_endpoint(B)
    assert B not in sc.speed


def test_count_own_running_sees_requests_no_scrape_has_seen() -> None:
    plain = PredictedTtftScorer("t", PredictedTtftParams())
    own = PredictedTtftScorer("t", PredictedTtftParams(count_own_running=True))

    def q(in_flight: int) -> CycleState:  # three answers still streaming from A
        s = state("q", 400)
        s.in_flight = {A: in_flight}  # epp's in-flight count (the Director's)
        return s

    assert plain.features(q(3), ep(A, running=1))[3] == 1.0  # the scrape says 1 running
    assert own.features(q(3), ep(A, running=1))[3] == 3.0
    assert own.features(q(3), ep(A, running=5))[3] == 5.0  # the server knows more
    assert own.features(q(0), ep(A, running=1))[3] == 1.0  # they ended


def test_shared_prefill_cost_fits_one_cost_for_own_and_queued_tokens() -> None:
    # mostly cache hits (own uncached tokens nearly constant) behind a varying queue: the
    # truth is 0.05 s + 2e-4 s per prefill token, own or queued
    sc = PredictedTtftScorer("t", PredictedTtftParams(shared_prefill_cost=True))
    rng = random.Random(3)
    for i in range(300):
        chars = 4 * rng.randrange(0, 3_000)
        ahead = state(f"q{i}", chars)
        sc.score(ahead, [ep(A)])
        sc.post_pick(ahead, PickResult((ep(A),), ahead))
        tokens_ahead = chars / 4
        hit = queued(state(f"h{i}", 64_000, {A: 1000 - rng.randrange(0, 3)}),  # 0-192 uncached
                     {A: float(chars)})  # fmt: skip
        sc.score(hit, [ep(A)])
        sc.post_pick(hit, PickResult((ep(A),), hit))
        own = 16_000 - 16 * hit.prefix.matched[A]  # 64 chars a block, 4 a token
        sc.post_first_token(hit, PickResult((ep(A),), hit), 0.05 + 2e-4 * (own + tokens_ahead))
        # the one ahead had nothing queued before it: its own tokens are the queue seen
        sc.post_first_token(ahead, PickResult((ep(A),), ahead), 0.05 + 2e-4 * tokens_ahead)
    assert sc.coef[1] == sc.coef[2]
    assert abs(sc.coef[1] - 2e-4) < 2e-5 and abs(sc.coef[0] - 0.05) < 0.02


def test_a_new_prefix_goes_where_the_cache_has_room() -> None:
    # nothing cached anywhere, equal load: the emptier cache wins, by the room it has
    fills = {A: 0.9, B: 0.2}
    s = state("r1", 8000)
    s.prefix = PrefixMatch(s.prefix.hashes, {}, 64, lambda ids: [fills[e] for e in ids])
    scores = PredictedTtftScorer("t", PredictedTtftParams()).score(s, [ep(A), ep(B)])
    assert scores[1] == 1.0 and scores[0] < 0.75
    off = PredictedTtftParams(fill_weight=0, evict_weight=0)
    assert PredictedTtftScorer("t", off).score(s, [ep(A), ep(B)]) == [1.0, 1.0]
    # equally full caches: the term vanishes, whatever their fill (and eviction costs the same
    # everywhere)
    s.prefix = PrefixMatch(s.prefix.hashes, {}, 64, lambda ids: [0.9] * len(ids))
    assert PredictedTtftScorer("t", PredictedTtftParams()).score(s, [ep(A), ep(B)]) == [1.0, 1.0]


def test_cache_room_weighs_only_the_uncached_tokens() -> None:
    # the prompt is cached on the fuller A: little to write there, so A still wins
    s = state("r1", 8000, {A: 120})  # 120 of 125 chunks
    fills = {A: 0.9, B: 0.2}
    s.prefix = PrefixMatch(s.prefix.hashes, s.prefix.matched, 64, lambda ids: [fills[e] for e in ids])
    scores = PredictedTtftScorer("t", PredictedTtftParams()).score(s, [ep(A), ep(B)])
    assert scores[0] == 1.0 and scores[1] < 0.5


def test_full_caches_make_the_tokens_a_pick_writes_cost_more() -> None:
    # A holds 60 of the prompt's 125 chunks but has 3,500 tokens queued; B is idle and holds
    # nothing. Alone, the queue outweighs the cached tokens and B wins. With both caches full,
    # every uncached token written evicts a token of a prefix someone may reuse: B would write
    # 2,000 tokens, A 1,040, and with evict_weight the cached prefix wins.
    def pick(params: PredictedTtftParams, fill: float) -> list[float]:
        sc = PredictedTtftScorer("t", params)
        s = queued(state("r1", 8_000, {A: 60}), {A: 14_000.0})  # 3,500 tokens
        s.prefix = PrefixMatch(s.prefix.hashes, s.prefix.matched, 64, lambda ids: [fill] * len(ids))
        return list(sc.score(s, [ep(A), ep(B)]))

    off = pick(PredictedTtftParams(evict_weight=0), 1.0)
    assert off[1] == 1.0 and off[0] < 1.0
    full = pick(PredictedTtftParams(evict_weight=2), 1.0)
    assert full[0] == 1.0 and full[1] < 1.0
    # empty caches: nothing is evicted, so the term is nothing
    assert pick(PredictedTtftParams(evict_weight=2), 0.0) == off


def test_prefill_under_way_makes_a_pick_that_joins_it_cost_more() -> None:
    # A holds 60 of the prompt's 125 chunks (960 of 2,000 tokens) and is prefilling 1,500
    # tokens epp sent; B is idle and holds nothing. A's saving outweighs its queue, unless
    # the 1,040 tokens the request would prefill there are charged for slowing the 1,500
    # under way (batched in the same steps).
    def pick(params: PredictedTtftParams) -> list[float]:
        sc = PredictedTtftScorer("t", params)
        s = queued(state("r1", 8_000, {A: 60}), {A: 6_000.0})  # 1,500 tokens under way
        return list(sc.score(s, [ep(A), ep(B)]))

    off = pick(PredictedTtftParams(contention_weight=0))
    assert off[0] == 1.0 and off[1] < 1.0
    on = pick(PredictedTtftParams(contention_weight=2))
    assert on[1] == 1.0 and on[0] < 1.0
    # nothing under way on A: nothing to charge, whatever the weight
    idle = PredictedTtftScorer("t", PredictedTtftParams(contention_weight=2))
    assert idle.score(state("r2", 8_000, {A: 60}), [ep(A), ep(B)])[0] == 1.0


def test_a_saturated_pool_keeps_a_prompt_on_its_cache() -> None:
    # A holds 60 of the prompt's 125 chunks (960 of 2,000 tokens) behind 3,500 queued tokens;
    # B holds nothing. With B idle, or with B queueing 500 tokens and no saturation charge, B
    # wins: A's longer queue outweighs what it saves. With both queueing, no endpoint is free
    # to absorb the prefill: charged for it, the 1,040 tokens A would prefill beat B's 2,000.
    def pick(params: PredictedTtftParams, queued_on_b: int) -> list[float]:
        sc = PredictedTtftScorer("t", params)
        ahead = {A: 14_000.0, B: 4.0 * queued_on_b}
        return list(sc.score(queued(state("r1", 8_000, {A: 60}), ahead), [ep(A), ep(B)]))

    off = pick(PredictedTtftParams(), 500)
    assert off[1] == 1.0 and off[0] < 1.0
    on = pick(PredictedTtftParams(saturation_weight=64), 500)
    assert on[0] == 1.0 and on[1] < 1.0
    # B has nothing queued: the pool can absorb the prefill, so nothing is charged
    assert pick(PredictedTtftParams(saturation_weight=64), 0) == pick(PredictedTtftParams(), 0)
    # the charge ramps with the least backlog: half its weight at saturation_backlog_seconds
    sc = PredictedTtftScorer("t", PredictedTtftParams(saturation_weight=64))
    half = 0.1 / sc.coef[2]  # tokens queued on each candidate for a backlog of 0.1 s
    charge = sc._saturation_charge([(1.0, 100.0, half), (1.0, 50.0, 2 * half)])
    assert charge == pytest.approx(32 * sc.coef[1])


def test_requests_sharing_a_client_chosen_id_are_accounted_apart() -> None:
    # x-request-id comes from the client when Envoy keeps it: what the scorer keeps for a
    # request is on that request's own cycle state, so two in flight under one id never
    # cross (their observations, their adapters' slots)
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    one, two = state("same", 8_000), state("same", 4_000)
    for s in (one, two):
        s.request = InferenceRequest("same", "m", s.request.prompt, adapter="lora-x")
        sc.score(s, [ep(A), ep(B)])
    for s, target in ((one, A), (two, B)):
        sc.post_pick(s, PickResult((ep(target),), s))
    assert sc.adapters_on == {A: {"lora-x": 1}, B: {"lora-x": 1}}
    sc.post_first_token(one, PickResult((ep(A),), one), 0.5)
    sc.post_first_token(two, PickResult((ep(B),), two), 0.4)
    sc.post_response(one, PickResult((ep(A),), one), ResponseInfo(200, ttft_s=0.5))
    assert sc.adapters_on == {B: {"lora-x": 1}}
    sc.post_response(two, PickResult((ep(B),), two), ResponseInfo(200, ttft_s=0.4))
    assert sc.adapters_on == {} and sc.errors.count == 2


def lora_ep(eid: EndpointId, running: set[str], max_adapters: int = 1, waiting: set[str] | None = None,
            requests: int = 0) -> Endpoint:  # fmt: skip
    return Endpoint(eid, eid.split(":")[0], 8000,
                    metrics=Metrics(running=requests or len(running), running_adapters=frozenset(running),
                                    waiting_adapters=frozenset(waiting or ()), max_adapters=max_adapters,
                                    scraped_at_s=1.0))  # fmt: skip


def knowing(sc: PredictedTtftScorer, *adapters: str) -> PredictedTtftScorer:
    """The scorer after a scrape in which a server reported ``adapters``."""
    sc.observe_endpoint(lora_ep(EndpointId("10.0.0.9:8000"), set(adapters), max_adapters=len(adapters)))
    return sc


def lora_state(rid: str, adapter: str, now_s: float = 0.0) -> CycleState:
    s = CycleState(InferenceRequest(rid, adapter or "m", "x" * 800, adapter=adapter), now_s, random.Random(0))
    s.prefix = PrefixMatch(list(range(12)), {}, 64)
    return s


def test_an_adapter_waits_where_other_adapters_hold_every_slot() -> None:
    sc = knowing(PredictedTtftScorer("t", PredictedTtftParams()), "x", "y")
    held, free, own = lora_ep(A, {"x"}), lora_ep(B, set()), lora_ep(A, {"y"})
    assert sc.features(lora_state("r1", "y"), held)[6] == 1.0  # x holds A's one slot
    assert sc.features(lora_state("r1", "y"), free)[6] == 0.0
    assert sc.features(lora_state("r1", "y"), own)[6] == 0.0  # y runs there
    assert sc.features(lora_state("r1", ""), held)[6] == 0.0  # the base model needs no slot
    assert sc.features(lora_state("r1", "y"), lora_ep(A, {"x"}, max_adapters=2))[6] == 0.0
    assert sc.features(lora_state("r1", "y"), lora_ep(A, {"x"}, max_adapters=0))[6] == 0.0  # no LoRA state
    scores = sc.score(lora_state("r2", "y"), [held, free])
    assert scores[1] == 1.0 and scores[0] < 0.6


def test_requests_sent_since_the_last_scrape_hold_their_adapters_slots() -> None:
    sc = knowing(PredictedTtftScorer("t", PredictedTtftParams()), "x", "y", "z")
    s = lora_state("r1", "x")
    endpoint = lora_ep(B, set())
    sc.score(s, [endpoint])
    sc.post_pick(s, PickResult((endpoint,), s))
    assert sc.adapters_on == {B: {"x": 1}}
    assert sc.features(lora_state("r2", "y"), endpoint)[6] == 1.0  # x took the free slot
    assert sc.features(lora_state("r2", "x"), endpoint)[6] == 0.0
    # z waits behind x and y both
    assert sc.features(lora_state("r3", "z"), lora_ep(B, {"y"}))[6] == 2.0
    sc.post_response(s, PickResult((endpoint,), s), ResponseInfo(status=200, ttft_s=0.1))
    assert sc.adapters_on == {} and sc.features(lora_state("r4", "y"), endpoint)[6] == 0.0


def test_an_adapter_stays_on_the_endpoint_that_holds_it() -> None:
    """With a free slot elsewhere, a request for an adapter goes where it already runs unless
    that is slower by more than ``adapter_weight`` slot waits; with the weight 0 the free,
    idler endpoint wins."""
    home, spare = lora_ep(A, {"x"}, requests=2), lora_ep(B, set())
    for weight, expect in ((1.0, 0), (0.0, 1)):
        sc = knowing(PredictedTtftScorer("t", PredictedTtftParams(adapter_weight=weight)), "x", "w")
        scores = sc.score(lora_state("r1", "x"), [home, spare])
        assert scores[expect] == 1.0, (weight, scores)
    sc = knowing(PredictedTtftScorer("t", PredictedTtftParams()), "x", "w")
    s = lora_state("r2", "w", now_s=5.0)
    sc.score(s, [spare])
    sc.post_pick(s, PickResult((spare,), s))
    sc.post_response(s, PickResult((spare,), s), ResponseInfo(status=200, ttft_s=0.1))
    # answered, w runs nowhere now; sent to B last, within the window: B still holds it
    idle_a = lora_ep(A, set())
    assert sc.score(lora_state("r3", "w", now_s=10.0), [idle_a, spare])[1] == 1.0
    assert sc.score(lora_state("r4", "w", now_s=60.0), [idle_a, spare]) == [1.0, 1.0]  # window over


def test_a_model_no_server_reports_as_an_adapter_is_the_base_model() -> None:
    """Without ``requestControl.baseModels`` every model name reaches the scorer as an
    adapter; the base model's must not hold slots or stick to the endpoints serving it."""
    sc = knowing(PredictedTtftScorer("t", PredictedTtftParams()), "x")
    busy, idle = lora_ep(A, {"x"}, requests=1), lora_ep(B, set())
    for i, endpoint in enumerate((busy, idle)):  # base-model requests in flight on A and B
        s = lora_state(f"r{i}", "base")
        sc.score(s, [endpoint])
        sc.post_pick(s, PickResult((endpoint,), s))
    assert sc.features(lora_state("r2", "base"), busy)[6] == 0.0
    assert sc.features(lora_state("r2", "x"), idle)[6] == 0.0  # "base" holds no slot on B
    assert sc.score(lora_state("r3", "base"), [busy, idle])[1] == 1.0  # no pull to where it runs


def test_where_servers_name_their_base_model_every_other_model_is_an_adapter_at_once() -> None:
    """An adapter no server has reported yet (its first requests) still waits for a slot and
    sticks to its endpoint, once the servers have said which model is their base."""
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    base = Endpoint(B, "10.0.0.2", 8000, metrics=Metrics(running_adapters=frozenset({"x"}), max_adapters=1,
                                                         served_models=frozenset({"base"}), scraped_at_s=1.0))
    assert sc.features(lora_state("r1", "new"), base)[6] == 0.0  # not known to be an adapter yet
    sc.observe_endpoint(base)
    assert sc.features(lora_state("r2", "new"), base)[6] == 1.0  # x holds the one slot
    assert sc.features(lora_state("r3", "base"), base)[6] == 0.0  # the base model takes no slot


def test_in_a_pool_without_adapters_an_alias_of_the_base_model_is_not_one() -> None:
    """A client naming the base model by another name (no ``baseModels`` in the config) in a
    pool that serves no adapters: no slot waits, no pull to where its requests run."""
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    plain = Metrics(running=1, max_adapters=4, served_models=frozenset({"base"}), scraped_at_s=1.0)
    busy, idle = Endpoint(A, "10.0.0.1", 8000, metrics=plain), lora_ep(B, set(), max_adapters=4)
    sc.observe_endpoint(busy)
    s = lora_state("r1", "alias")
    sc.score(s, [busy])
    sc.post_pick(s, PickResult((busy,), s))
    assert sc.score(lora_state("r2", "alias"), [busy, idle])[1] == 1.0


def test_the_fit_is_solved_at_most_every_fifty_ms_not_per_response() -> None:
    """Solving the 7x7 normal equations per response cost 30-60 us of the loop each (issue
    70, item 13): each response is added at once, and the solve runs at most every 50 ms of
    the observations' clock (or once 64 wait). A few requests a second are each solved for."""
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    solves = 0
    refit = sc.refit

    def counted() -> None:
        nonlocal solves
        solves += 1
        refit()

    sc.refit = counted  # type: ignore[method-assign]

    def respond(i: int, at_s: float) -> None:
        s = CycleState(InferenceRequest(f"r{i}", "m", "x" * 4000), at_s, random.Random(0))
        s.prefix = PrefixMatch([], {}, 64)
        sc.score(s, [ep(A)])
        sc.post_pick(s, PickResult((ep(A),), s))
        sc.post_first_token(s, PickResult((ep(A),), s), 0.01)

    for i in range(1000):  # 1,000 responses a second for one second
        respond(i, i * 0.001)
    assert 15 <= solves <= 40 and sc.errors.count == 1000
    solves = 0
    for i in range(20):  # 4 a second: each one is solved for
        respond(1000 + i, 10.0 + i * 0.25)
    assert solves == 20
