"""prefix-home-scorer: epp replicas that share nothing send a new prefix to the same
endpoint; silent once the prefix is placed; an endpoint's removal moves only its prefixes."""

from __future__ import annotations

import random
from collections import Counter

from epp.config.loader import loads_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PrefixMatch
from epp.plugins.prefixhome import PrefixHomeParams, PrefixHomeScorer
from epp.wiring import build_scheduler


def ep(n: int, waiting: int = 0) -> Endpoint:
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000,
                    metrics=Metrics(waiting=waiting, kv_usage=0.2, scraped_at_s=1.0))  # fmt: skip


def system(g: int) -> str:
    rng = random.Random(g)
    return "".join(rng.choice("abcdefghij ") for _ in range(4096))


CONFIG = """
plugins:
- type: prefix-home-scorer
- type: prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- plugins:
  - {pluginRef: prefix-home-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: max-score-picker}
"""


def test_replicas_that_share_nothing_agree_on_a_new_prefixs_home() -> None:
    routers = [build_scheduler(loads_config(CONFIG), random.Random(k)) for k in range(4)]
    pool = [ep(n) for n in range(1, 9)]
    homes: Counter[str] = Counter()
    for g in range(64):
        prompt = system(g) + f" question {g}"
        picks = {r.schedule(InferenceRequest(f"{g}-{k}", "m", prompt + str(k)), pool, 1.0)
                 .target.id for k, r in enumerate(routers)}  # fmt: skip
        assert len(picks) == 1, f"group {g} placed on {picks}"
        homes[picks.pop()] += 1
    # the homes spread over the pool, not onto one endpoint
    assert len(homes) == 8 and max(homes.values()) <= 16, homes


def test_without_the_scorer_the_replicas_disagree() -> None:
    """The control: the same routers without prefix-home place a new prefix by their own
    load views and random tie-breaks, on several endpoints."""
    plain = CONFIG.replace("  - {pluginRef: prefix-home-scorer, weight: 1}\n", "")
    routers = [build_scheduler(loads_config(plain), random.Random(k)) for k in range(4)]
    pool = [ep(n) for n in range(1, 9)]
    spread = 0
    for g in range(16):
        prompt = system(g)
        picks = {r.schedule(InferenceRequest(f"{g}-{k}", "m", prompt), pool, 1.0).target.id
                 for k, r in enumerate(routers)}  # fmt: skip
        spread += len(picks) > 1
    assert spread >= 8


def test_a_busy_home_is_passed_over_when_the_load_weighs_more() -> None:
    prompt = system(7)
    pool = [ep(n) for n in range(1, 5)]
    home = build_scheduler(loads_config(CONFIG), random.Random(1)).schedule(
        InferenceRequest("a", "m", prompt), pool, 1.0).target.id
    busy = [ep(n, waiting=9 if e.id == home else 0) for n, e in enumerate(pool, start=1)]
    picked = build_scheduler(loads_config(CONFIG), random.Random(2)).schedule(
        InferenceRequest("b", "m", prompt), busy, 1.0).target.id
    assert picked != home


def test_silent_once_an_endpoint_holds_the_prefix() -> None:
    scorer = PrefixHomeScorer("h", PrefixHomeParams(key_chunks=4, min_match_chunks=4))
    pool = [ep(n) for n in range(1, 5)]
    state = CycleState(InferenceRequest("r", "m", "p"), 1.0, random.Random(0))
    hashes = list(range(100, 110))
    state.prefix = PrefixMatch(hashes, {pool[2].id: 3})  # 3 < 4 chunks: not placed yet
    first = scorer.score(state, pool)
    assert sorted(first) == [0.0, 0.0, 0.0, 1.0]
    state.prefix = PrefixMatch(hashes, {pool[2].id: 4})
    assert list(scorer.score(state, pool)) == [0.0] * 4
    # the key is the chain hash at depth key_chunks: a different tail does not move the home
    state.prefix = PrefixMatch([*hashes[:4], 999, 998], {})
    assert list(scorer.score(state, pool)) == list(first)
    state.prefix = PrefixMatch([], {})  # a request without a prompt
    assert list(scorer.score(state, pool)) == [0.0] * 4


def test_removing_an_endpoint_moves_only_the_prefixes_homed_on_it() -> None:
    scorer = PrefixHomeScorer("h", PrefixHomeParams())
    pool = [ep(n) for n in range(1, 9)]
    keys = [random.Random(k).getrandbits(64) for k in range(2000)]
    before = [pool[scorer.order(k, pool)[0]].id for k in keys]
    gone = pool[3].id
    rest = [e for e in pool if e.id != gone]
    after = [rest[scorer.order(k, rest)[0]].id for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == gone for b, _ in moved)
    assert len(moved) == before.count(gone)
    # and the keys spread evenly: each endpoint homes 1/8 of them, give or take
    counts = Counter(before)
    assert min(counts.values()) > 2000 / 8 * 0.75


def test_a_home_well_above_the_mean_load_is_passed_over() -> None:
    scorer = PrefixHomeScorer("h", PrefixHomeParams(key_chunks=1, min_match_chunks=1))
    idle = [ep(n) for n in range(1, 5)]
    state = CycleState(InferenceRequest("r", "m", "p"), 1.0, random.Random(0))
    for key in range(40):
        state.prefix = PrefixMatch([key], {})
        order = scorer.order(key, idle)
        # the hash's first choice is far above the mean (8 of 8 waiting): the next in hash
        # order gets the request
        busy = [ep(n, waiting=8 if i == order[0] else 0) for i, n in enumerate(range(1, 5))]
        scores = list(scorer.score(state, busy))
        assert scores.index(1.0) == order[1] and sum(scores) == 1.0
        # within 1.25x the mean (9 against a mean of 8.25) the hash still decides
        close = [ep(n, waiting=9 if i == order[0] else 8) for i, n in enumerate(range(1, 5))]
        assert list(scorer.score(state, close)).index(1.0) == order[0]


def big(n: int, waiting: int = 0) -> Endpoint:
    return Endpoint(EndpointId(f"10.1.{n // 250}.{n % 250}:8000"), f"10.1.{n // 250}.{n % 250}", 8000,
                    metrics=Metrics(waiting=waiting, kv_usage=0.2, scraped_at_s=1.0))  # fmt: skip


def test_in_a_large_pool_the_home_is_ranked_in_a_window_of_the_ring_and_spreads_evenly() -> None:
    """Above 16 endpoints the rendezvous runs among the 16 following the key on the ring of
    id hashes: every scorer agrees, the homes spread over the pool, and an endpoint's
    removal moves its own prefixes and about as many again (a window gains a member)."""
    from epp.framework.pool import ScanPool

    pool = [big(n) for n in range(200)]
    keys = [random.Random(k).getrandbits(64) for k in range(4000)]
    a, b = PrefixHomeScorer("a", PrefixHomeParams()), PrefixHomeScorer("b", PrefixHomeParams())
    homes = [a.home_in(k, ScanPool(pool)).id for k in keys]
    assert homes == [b.home_in(k, ScanPool(list(reversed(pool)))).id for k in keys]  # order-free
    counts = Counter(homes)
    assert len(counts) > 190 and max(counts.values()) < 4000 / 200 * 3
    gone = homes[0]
    rest = ScanPool([e for e in pool if e.id != gone])
    after = [a.home_in(k, rest).id for k in keys]
    moved = sum(1 for h, g in zip(homes, after, strict=True) if h != g)
    assert counts[gone] <= moved <= 3 * counts[gone]


def test_in_a_large_pool_a_busy_home_is_passed_over_for_the_next_in_its_window() -> None:
    from epp.framework.pool import ScanPool

    scorer = PrefixHomeScorer("h", PrefixHomeParams())
    pool = [big(n) for n in range(100)]
    for key in range(30):
        home = scorer.home_in(key, ScanPool(pool))
        busy = [big(n, waiting=40 if big(n).id == home.id else 0) for n in range(100)]
        assert scorer.home_in(key, ScanPool(busy)).id != home.id
