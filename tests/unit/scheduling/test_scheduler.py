from __future__ import annotations

import random

import pytest

from epp.config.loader import default_config, shipped_config
from epp.errors import Unavailable
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import ApiKind, InferenceRequest
from epp.framework.types import ResponseInfo
from epp.plugins.approxprefix import PrefixProducer
from epp.scheduling.saturation import pool_saturated
from epp.scheduling.scheduler import Scheduler
from epp.wiring import build_scheduler

SYSTEM = "You are a helpful assistant. " * 40


def approx(s: Scheduler) -> PrefixProducer:
    producer = s.plugin(PrefixProducer)
    assert producer is not None
    return producer


def pool(n: int, **metrics: float) -> list[Endpoint]:
    m = Metrics(scraped_at_s=1.0, **metrics)  # type: ignore[arg-type]
    return [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000, metrics=m) for i in range(n)]


def req(prompt: str, rid: str = "r", api: ApiKind = ApiKind.COMPLETIONS) -> InferenceRequest:
    return InferenceRequest(rid, "m", prompt, api=api)


def test_shared_prefix_follows_the_first_pick() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(8)
    first = s.schedule(req(SYSTEM + "question one"), eps, 1.0).target
    for i in range(20):
        again = s.schedule(req(SYSTEM + f"another question {i}"), eps, 1.0 + i).target
        assert again == first


def test_a_bounded_load_filter_moves_a_shared_prefix_off_an_endpoint_past_its_share() -> None:
    from epp.config.loader import loads_config

    cfg = loads_config("""
plugins:
- type: bounded-load-filter
  parameters: {loadFactor: 1.5, minInFlight: 2}
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: bounded
  plugins:
  - pluginRef: bounded-load-filter
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
""")
    s = build_scheduler(cfg, random.Random(0))
    eps = pool(4)
    in_flight = {e.id: 0 for e in eps}
    first = s.schedule(req(SYSTEM + "q0"), eps, 1.0, in_flight=in_flight).target
    picks = []
    for i in range(1, 8):  # every request stays in flight
        in_flight[first.id if not picks else picks[-1].id] += 1
        picks.append(s.schedule(req(SYSTEM + f"q{i}"), eps, 1.0 + i, in_flight=in_flight).target)
    # the prefix holder takes requests up to the floor (2 in flight), then has more than 1.5x
    # the mean and the next ones go elsewhere, where the prefix is recorded in turn
    assert picks[0] == first and picks[1] != first
    assert max(in_flight.values()) <= 3


def test_without_shared_prefix_load_decides() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(4)
    busy = Metrics(waiting=4, kv_usage=0.9, scraped_at_s=1.0)
    eps[0] = Endpoint(eps[0].id, eps[0].address, 8000, metrics=busy)
    picks = {s.schedule(req(f"unique prompt {i} " * 10), eps, 1.0).target.id for i in range(30)}
    assert eps[0].id not in picks and len(picks) == 3


def test_prefix_loses_to_a_much_heavier_queue() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(2)
    s.schedule(req(SYSTEM), eps[:1], 1.0)  # eps[0] now holds the prefix
    overloaded = Endpoint(eps[0].id, eps[0].address, 8000, metrics=Metrics(waiting=50, kv_usage=1.0, scraped_at_s=1.0))
    # prefix 3*1.0 vs queue 2*1.0 + kv 2*1.0: the idle endpoint wins
    assert s.schedule(req(SYSTEM + "x"), [overloaded, eps[1]], 2.0).target == eps[1]


def test_fallbacks_are_distinct_and_ordered() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(5)
    result = s.schedule(req(SYSTEM), eps, 1.0, fallbacks=2)
    assert len(result.targets) == 3 and len(set(result.target_ids)) == 3
    scores = {se.endpoint.id: se.score for se in result.scored()}
    assert scores[result.targets[0].id] >= scores[result.targets[1].id] >= scores[result.targets[2].id]


def test_empty_pool_is_unavailable() -> None:
    s = build_scheduler(default_config())
    with pytest.raises(Unavailable):
        s.schedule(req("x"), [], 1.0)


def test_filter_chain_profile() -> None:
    s = build_scheduler(shipped_config("filter-chain"), random.Random(3))
    eps = pool(4)
    first = s.schedule(req(SYSTEM), eps, 1.0).target
    assert all(s.schedule(req(SYSTEM + str(i)), eps, 2.0).target == first for i in range(10))


def test_reply_is_learned_so_the_next_turn_matches_deeper() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(4)
    turn1 = "<|system|>" + SYSTEM + "<|user|>tell me a story"
    r1 = s.schedule(req(turn1, api=ApiKind.CHAT), eps, 1.0)
    reply = "Once upon a time " * 30
    s.on_response(r1, ResponseInfo(prompt_tokens=300, cached_tokens=0, generated_text=reply))
    turn2 = turn1 + "<|assistant|>" + reply + "<|user|>and then?"
    r2 = s.schedule(req(turn2, api=ApiKind.CHAT), eps, 2.0)
    matched = r2.state.prefix.matched[r1.target.id]
    assert matched * 64 > len(turn1) + len(reply) - 64
    assert r2.target == r1.target


def test_far_fewer_cached_tokens_than_predicted_lowers_trust() -> None:
    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(1)
    s.schedule(req(SYSTEM), eps, 1.0)
    r = s.schedule(req(SYSTEM), eps, 2.0)
    before = approx(s).index.capacity(eps[0].id)
    s.on_response(r, ResponseInfo(prompt_tokens=300, cached_tokens=0))
    after = approx(s).index.capacity(eps[0].id)
    assert after < before
    s.on_response(r, ResponseInfo(prompt_tokens=300, cached_tokens=290))
    assert approx(s).index.capacity(eps[0].id) > after


def test_kv_cache_size_sizes_the_endpoint_lru() -> None:
    s = build_scheduler(default_config())
    e = Endpoint(EndpointId("10.0.0.9:8000"), "10.0.0.9", 8000,
                 metrics=Metrics(block_size_tokens=16, num_gpu_blocks=1000, scraped_at_s=1.0))
    s.observe_endpoint(e)
    assert approx(s).index.capacity(e.id) == 16 * 1000 * 4 // 64
    s.remove_endpoint(e.id)
    assert e.id not in approx(s).index.endpoint_ids()


def test_pool_saturation() -> None:
    cfg = default_config().saturation
    assert not pool_saturated(pool(2, waiting=5, kv_usage=0.8), cfg, 1.5)
    assert pool_saturated(pool(2, waiting=6), cfg, 1.5)
    assert pool_saturated(pool(2), cfg, 10.0)  # metrics older than 2 s
    assert pool_saturated([], cfg, 1.0)


def test_debug_logging_says_why_each_endpoint_scored_what_it_did(caplog: pytest.LogCaptureFixture) -> None:
    """``--log-level debug``: one line a pick naming the request, the pick, and per candidate
    the weighted total and every scorer's own score; nothing is formatted at info."""
    import logging

    s = build_scheduler(default_config(), random.Random(0))
    eps = pool(2)
    with caplog.at_level(logging.INFO, logger="epp.scheduling.profile"):
        s.schedule(req(SYSTEM + "q", rid="quiet"), eps, 1.0)
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="epp.scheduling.profile"):
        target = s.schedule(req(SYSTEM + "q", rid="r42"), eps, 2.0).target
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"profile default request r42 -> {target.id}: ")
    for e in eps:
        assert f"{e.id} total=" in line
    for name in ("predicted-ttft-scorer", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
                 "prefix-home-scorer"):  # fmt: skip
        assert line.count(f" {name}=") == 2, name
