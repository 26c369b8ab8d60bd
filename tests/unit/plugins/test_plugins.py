from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PrefixMatch
from epp.plugins import filters, pickers, scorers


def ep(
    n: int,
    *,
    waiting: int = 0,
    kv: float = 0.0,
    running: tuple[str, ...] = (),
    waiting_adapters: tuple[str, ...] = (),
    max_adapters: int = 0,
    pending: int = 0,
    known: bool = True,
) -> Endpoint:
    m = Metrics(
        waiting=waiting,
        kv_usage=kv,
        running_adapters=frozenset(running),
        waiting_adapters=frozenset(waiting_adapters),
        max_adapters=max_adapters,
        scraped_at_s=1.0 if known else 0.0,
    )
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000, metrics=m, pending=pending)


def state(adapter: str = "", matched: dict[int, int] | None = None, total: int = 10) -> CycleState:
    req = InferenceRequest("r", adapter or "base", "p" * 100, adapter=adapter)
    s = CycleState(req, 1.0, random.Random(7))
    if matched is not None:
        s.prefix = PrefixMatch(
            list(range(total)), {EndpointId(f"10.0.0.{k}:8000"): v for k, v in matched.items()}
        )
    return s


def test_prefix_scorer_ratio_and_min_match_threshold() -> None:
    eps = [ep(0), ep(1), ep(2)]
    sc = scorers.PrefixCacheScorer("p", scorers.PrefixCacheScorerParams(min_match_chunks=3))
    assert sc.score(state(matched={0: 10, 1: 2}), eps) == [1.0, 0.0, 0.0]
    sc2 = scorers.PrefixCacheScorer("p", scorers.PrefixCacheScorerParams(min_match_ratio=0.5))
    assert sc2.score(state(matched={0: 6, 1: 4}), eps) == [0.6, 0.0, 0.0]
    assert sc.score(state(), eps) == [0.0, 0.0, 0.0]


def test_queue_scorer_min_max_with_pending() -> None:
    eps = [ep(0, waiting=0), ep(1, waiting=2, pending=2), ep(2, waiting=2), ep(3, known=False, pending=1)]
    got = scorers.QueueScorer("q", scorers.QueueScorerParams()).score(state(), eps)
    assert got == [1.0, 0.0, 0.5, 0.75]  # never scraped: its in-flight requests are its queue
    same = scorers.QueueScorer("q", scorers.QueueScorerParams()).score(state(), [ep(0), ep(1)])
    assert same == [1.0, 1.0]


def test_queue_scorer_min_spread_softens_a_small_difference_only() -> None:
    sc = scorers.QueueScorer("q", scorers.QueueScorerParams(min_spread=4))
    # one request apart over two servers: a quarter of the range, not all of it
    assert sc.score(state(), [ep(0), ep(1, waiting=1)]) == [1.0, 0.75]
    # apart by minSpread or more: plain min-max, as without it
    assert sc.score(state(), [ep(0, waiting=2), ep(1, waiting=10), ep(2, waiting=6)]) == [1.0, 0.0, 0.5]


def test_load_scores_pull_with_the_pools_waiting_requests() -> None:
    queue = scorers.QueueScorer("q", scorers.QueueScorerParams(full_at_waiting=2))
    kv = scorers.KvCacheUtilizationScorer("k", scorers.KvCacheScorerParams(full_at_waiting=2))
    # nothing waits at any server: epp's own burst since the scrape and KV use do not pull
    idle = [ep(0, pending=3, kv=0.9), ep(1, kv=0.1)]
    assert queue.score(state(), idle) == [1.0, 1.0]
    assert kv.score(state(), idle) == [1.0, 1.0]
    # one request waits: half the pull
    one = [ep(0, waiting=1, pending=3, kv=0.9), ep(1, kv=0.1)]
    assert queue.score(state(), one) == [0.5, 1.0]
    assert kv.score(state(), one) == pytest.approx([0.55, 0.95])
    # as many as fullAtWaiting or more: the plain scores
    busy = [ep(0, waiting=5, kv=0.9), ep(1, waiting=1, kv=0.1)]
    assert queue.score(state(), busy) == [0.0, 1.0]
    assert kv.score(state(), busy) == pytest.approx([0.1, 0.9])
    # a candidate not scraped yet: its load is unknown, so the full pull
    assert queue.score(state(), [ep(0, pending=2), ep(1, known=False)]) == [0.0, 1.0]


def test_load_scores_remember_the_waiting_with_a_decay() -> None:
    params = scorers.QueueScorerParams(full_at_waiting=2, waiting_decay_s=10)
    queue = scorers.QueueScorer("q", params)

    def at(now_s: float) -> CycleState:
        s = state()
        s.now_s = now_s
        return s

    apart = [ep(0, pending=2), ep(1)]
    assert queue.score(at(0.0), apart) == [1.0, 1.0]  # nothing waited yet
    assert queue.score(at(1.0), [ep(0, waiting=4), ep(1)]) == [0.0, 1.0]
    # nothing waits now; 4 waited 10 s ago: remembered as 4/e, of the 2 that give the full pull
    assert queue.score(at(11.0), apart) == pytest.approx([1.0 - 2 / math.e, 1.0])
    # a minute on, the memory has faded to a sliver of the pull
    got = queue.score(at(61.0), apart)
    assert got[0] == pytest.approx(1.0 - 2 * math.exp(-6), rel=1e-6)
    # waiting seen while the queues are level is remembered too
    fresh = scorers.QueueScorer("q", params)
    assert fresh.score(at(0.0), [ep(0, waiting=4), ep(1, waiting=4)]) == [1.0, 1.0]
    assert fresh.score(at(0.0), apart) == [0.0, 1.0]


def test_load_scores_gate_only_a_prompt_a_candidate_holds() -> None:
    params = scorers.KvCacheScorerParams(full_at_waiting=2, held_match_ratio=0.5)
    kv = scorers.KvCacheUtilizationScorer("k", params)
    idle = [ep(0, kv=0.8), ep(1, kv=0.2)]
    # endpoint 0 holds 6 of the prompt's 10 chunks and nothing waits: held where it is
    assert kv.score(state(matched={0: 6}), idle) == [1.0, 1.0]
    # held 3 of 10, or not at all, or a prompt shorter than a chunk: placed by KV use
    for s in (state(matched={0: 3}), state(matched={}), state(matched={}, total=0)):
        assert kv.score(s, idle) == pytest.approx([0.2, 0.8])


def test_kv_scorer() -> None:
    got = scorers.KvCacheUtilizationScorer("k", scorers.KvCacheScorerParams()).score(
        state(), [ep(0, kv=0.25), ep(1, kv=1.0), ep(2, known=False)]
    )
    assert got == [0.75, 0.0, 0.5]
    half = scorers.KvCacheUtilizationScorer("k", scorers.KvCacheScorerParams(free_below=0.5))
    # up to half full: room enough, all alike; above it, down to 0 at full
    assert half.score(state(), [ep(0, kv=0.1), ep(1, kv=0.5), ep(2, kv=0.75), ep(3, kv=1.0)]) == [
        1.0, 1.0, 0.5, 0.0]


def test_lora_affinity_tiers() -> None:
    eps = [
        ep(0, running=("a",), max_adapters=2),
        ep(1, running=("b",), max_adapters=2),  # free slot
        ep(2, running=("b", "c"), waiting_adapters=("a",), max_adapters=2),  # waiting
        ep(3, running=("b", "c"), max_adapters=2),  # none
    ]
    sc = scorers.LoraAffinityScorer("l", scorers.LoraAffinityScorerParams())
    assert sc.score(state(adapter="a"), eps) == [1.0, 0.8, 0.6, 0.0]
    assert sc.score(state(), eps) == [1.0, 1.0, 1.0, 1.0]
    f = filters.LoraAffinityFilter("lf", filters.NoParams())
    assert f.filter(state(adapter="a"), eps) == [eps[0]]
    assert f.filter(state(adapter="a"), eps[1:]) == [eps[1]]
    assert f.filter(state(adapter="a"), eps[2:]) == [eps[2]]
    assert f.filter(state(adapter="a"), eps[3:]) == [eps[3]]  # none qualifies: keep all


def test_load_threshold_filter_keeps_all_when_none_qualify() -> None:
    f = filters.LoadThresholdFilter("t", filters.LoadThresholdParams())
    eps = [ep(0, waiting=6), ep(1, kv=0.9), ep(2, waiting=5, kv=0.8), ep(3, waiting=3, pending=3)]
    assert f.filter(state(), eps) == [eps[2]]
    assert f.filter(state(), [eps[0], eps[1]]) == [eps[0], eps[1]]


@pytest.mark.parametrize(
    "factory,values,kept",
    [
        (filters.LeastQueueFilter, [0, 1, 8, 9], [0, 1]),
        (filters.LeastKvCacheFilter, [0.1, 0.2, 0.9, 0.95], [0, 1]),
    ],
)
def test_least_filters_keep_the_lowest_band(factory, values, kept) -> None:  # type: ignore[no-untyped-def]
    if factory is filters.LeastQueueFilter:
        eps = [ep(i, waiting=v) for i, v in enumerate(values)]
    else:
        eps = [ep(i, kv=v) for i, v in enumerate(values)]
    assert factory("f", filters.NoParams()).filter(state(), eps) == [eps[i] for i in kept]


def test_longest_prefix_filter() -> None:
    f = filters.LongestPrefixFilter("lp", filters.LongestPrefixParams())
    eps = [ep(0), ep(1), ep(2)]
    assert f.filter(state(matched={0: 3, 1: 7, 2: 7}), eps) == [eps[1], eps[2]]
    assert f.filter(state(matched={}), eps) == eps


def test_longest_prefix_filter_holds_to_the_cache_only_while_the_holder_has_room() -> None:
    f = filters.LongestPrefixFilter("lp", filters.LongestPrefixParams(min_match_ratio=0.5, max_queue=1))
    idle, holder, busy_holder = ep(0), ep(1, waiting=1), ep(2, waiting=1, pending=1)
    assert f.filter(state(matched={1: 8}), [idle, holder]) == [holder]
    # the holder queues past the bound: every endpoint stays, for the scorers to weigh
    assert f.filter(state(matched={2: 8}), [idle, busy_holder]) == [idle, busy_holder]
    # under half the prompt held: not a holder
    assert f.filter(state(matched={1: 4}), [idle, holder]) == [idle, holder]


def test_bounded_load_filter_keeps_endpoints_under_the_bound_on_their_mean_load() -> None:
    f = filters.BoundedLoadFilter("bl", filters.BoundedLoadParams())  # 1.25 x the mean
    eps = [ep(0), ep(1), ep(2), ep(3)]

    def kept(loads: list[int]) -> list[int]:
        s = state()
        s.in_flight = {e.id: n for e, n in zip(eps, loads, strict=True)}
        return [eps.index(e) for e in f.filter(s, eps)]

    assert kept([0, 0, 0, 0]) == [0, 1, 2, 3]  # nothing in flight: no bound
    # 16 + 1 in flight over 4: the bound is 1.25 x 4.25 = 5.3; taking this request, the
    # endpoints at 3, 4 and 1 stay within it, the one at 8 would not
    assert kept([3, 8, 4, 1]) == [0, 2, 3]
    assert kept([5, 0, 0, 0]) == [1, 2, 3]
    assert kept([1, 1, 2, 2]) == [0, 1]  # bound 2.19: 2 + 1 is over it
    # level: 1 + 1 is over 1.25 x 5 / 4 everywhere, so the least loaded (all) are kept
    assert kept([1, 1, 1, 1]) == [0, 1, 2, 3]
    assert kept([2, 1, 1, 1]) == [1, 2, 3]  # none within 1.88: the least loaded
    # load_factor 2: an endpoint may take twice its share
    wide = filters.BoundedLoadFilter("bl", filters.BoundedLoadParams(load_factor=2.0))
    s = state()
    s.in_flight = {e.id: n for e, n in zip(eps, [2, 1, 1, 1], strict=True)}
    assert wide.filter(s, eps) == eps  # 2 + 1 <= 2 x 6 / 4
    s.in_flight = {e.id: n for e, n in zip(eps, [5, 0, 0, 0], strict=True)}
    assert wide.filter(s, eps) == eps[1:]  # 5 + 1 > 2 x 6 / 4
    # minInFlight: under it an endpoint always qualifies, however far above the mean
    floor = filters.BoundedLoadFilter("bl", filters.BoundedLoadParams(min_in_flight=4))
    s.in_flight = {e.id: n for e, n in zip(eps, [3, 0, 0, 0], strict=True)}
    assert floor.filter(s, eps) == eps
    s.in_flight = {e.id: n for e, n in zip(eps, [4, 0, 0, 0], strict=True)}
    assert floor.filter(s, eps) == eps[1:]


def test_max_score_picker_breaks_ties_at_random_and_orders_fallbacks() -> None:
    p = pickers.MaxScorePicker("m", pickers.PickerParams())
    eps = [ep(0), ep(1), ep(2)]
    s = state()
    picks = Counter(p.pick(s, eps, [1.0, 1.0, 0.2], 1)[0].id for _ in range(400))
    assert set(picks) == {eps[0].id, eps[1].id} and min(picks.values()) > 120
    assert p.pick(s, eps, [0.1, 0.9, 0.5], 3) == [eps[1], eps[2], eps[0]]


def test_weighted_random_picker_follows_scores() -> None:
    p = pickers.WeightedRandomPicker("w", pickers.PickerParams())
    eps = [ep(0), ep(1)]
    s = state()
    picks = Counter(p.pick(s, eps, [0.9, 0.1], 1)[0].id for _ in range(2000))
    assert 0.85 < picks[eps[0].id] / 2000 < 0.95
    assert len(p.pick(s, eps, [0.0, 0.0], 2)) == 2


def test_random_and_round_robin_pickers() -> None:
    eps = [ep(2), ep(0), ep(1)]
    rr = pickers.RoundRobinPicker("rr", pickers.PickerParams())
    s = state()
    assert [rr.pick(s, eps, [0, 0, 0], 1)[0].address for _ in range(4)] == [
        "10.0.0.0", "10.0.0.1", "10.0.0.2", "10.0.0.0",
    ]
    rp = pickers.RandomPicker("r", pickers.PickerParams())
    seen = {rp.pick(s, eps, [0, 0, 0], 1)[0].id for _ in range(100)}
    assert seen == {e.id for e in eps}
