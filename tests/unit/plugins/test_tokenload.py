"""token-load-scorer / token-load-filter: tokens in flight per endpoint from epp's own
accounting (pick, first token, response end), and what they do with them."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from epp.config.loader import loads_config
from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, ResponseInfo
from epp.observability.metrics import EppMetrics
from epp.plugins.tokenload import (
    TokenLoadFilter,
    TokenLoadParams,
    TokenLoadScorer,
    _TokensCollector,
)
from epp.requestcontrol.director import Director
from epp.wiring import build_scheduler

CONFIG = """
plugins:
- type: token-load-filter
  parameters: {maxTokens: 30000}
- type: token-load-scorer
- type: max-score-picker
schedulingProfiles:
- plugins:
  - {pluginRef: token-load-filter}
  - {pluginRef: token-load-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


def ep(n: int, blocks: int = 0) -> Endpoint:
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000,
                    metrics=Metrics(scraped_at_s=1.0, block_size_tokens=16 if blocks else 0,
                                    num_gpu_blocks=blocks))  # fmt: skip


def req(rid: str, tokens: int, max_tokens: int | None = None) -> InferenceRequest:
    body = {"max_tokens": max_tokens} if max_tokens is not None else None
    return InferenceRequest(rid, "m", "x" * (4 * tokens), body=body)


def director(pool: list[Endpoint]) -> tuple[Director, Datastore, TokenLoadScorer]:
    """The config above behind a Director, as epp serve runs it (the Director keeps the
    prefill accounting the scorer reads)."""
    cfg = loads_config(CONFIG)
    sched = build_scheduler(cfg, random.Random(1))
    store = Datastore(stale_after_s=60.0)
    store.on_removed(sched.remove_endpoint)
    for e in pool:
        store.upsert(e)
        store.update_metrics(e.id, e.metrics)
    scorer = sched.plugin(TokenLoadScorer)
    assert scorer is not None
    return Director(store, sched, cfg.saturation, EppMetrics(CollectorRegistry()),
                    clock=lambda: 1.0), store, scorer  # fmt: skip


def prefill_tokens(store: Datastore) -> dict[EndpointId, float]:
    return {eid: chars / 4 for eid, chars in store.prefill.own().items()}


def test_tokens_are_counted_at_the_pick_prefill_drops_at_the_first_token_all_at_the_end() -> None:
    pool = [ep(1), ep(2)]
    d, store, scorer = director(pool)
    big = d.route(req("a", 20_000, max_tokens=100), None)
    a = big.target_id
    assert scorer.held[a] == 20_100 and prefill_tokens(store) == {a: 20_000}
    # the next requests go elsewhere: the scorer prefers the other endpoint
    small = d.route(req("b", 100), None)
    b = small.target_id
    assert b != a and scorer.held[b] == 100 + 256  # decodeTokens
    d.first_token(big, 0.5)
    assert prefill_tokens(store) == {b: 100} and scorer.held[a] == 20_100
    d.finish(big, ResponseInfo(200))
    d.abandon(small, "cancelled")  # a cancel releases too
    assert scorer.held == {} and prefill_tokens(store) == {}


def test_the_filter_keeps_endpoints_under_their_caps_and_all_when_none_is() -> None:
    f = TokenLoadFilter("f", TokenLoadParams(max_tokens=50_000, max_share=0.5))
    pool = [ep(1, blocks=4096), ep(2), ep(3)]  # ep1 holds 65,536 tokens of KV
    f.held = {pool[0].id: 40_000, pool[1].id: 60_000, pool[2].id: 10_000}
    assert [e.id for e in f.filter(None, pool)] == [pool[2].id]  # type: ignore[arg-type]
    f.held = {e.id: 90_000 for e in pool}
    assert f.filter(None, pool) == pool  # type: ignore[arg-type]


def test_prefill_weighs_more() -> None:
    s = TokenLoadScorer("s", TokenLoadParams(prefill_weight=4.0))
    pool = [ep(1), ep(2)]
    s.held = {pool[0].id: 1_000, pool[1].id: 1_600}
    state = CycleState(req("q", 10), 1.0, random.Random(0))
    state.prefill = {pool[0].id: 4_000.0}  # 1,000 tokens to prefill, at 4 characters a token
    assert s.score(state, pool) == [0.0, 1.0 - 1_600 / 4_000]


def test_the_exported_series_forget_endpoints_with_nothing_in_flight_and_those_gone() -> None:
    """epp_endpoint_tokens_in_flight kept a zero series for every pod ever seen: with pods
    coming and going it grew without end (issue 70, item 10)."""
    pool = [ep(n) for n in range(1, 42)]
    d, store, scorer = director(pool)
    collector = _TokensCollector(scorer)

    def series() -> set[tuple[str, str]]:
        return {(s.labels["endpoint"], s.labels["phase"]) for fam in collector.collect()
                for s in fam.samples}  # fmt: skip

    for i in range(40):  # each pod serves one request, then leaves the pool
        routing = d.route(req(f"r{i}", 50), None)
        assert series()  # counted while in flight
        d.first_token(routing, 0.1)
        d.finish(routing, ResponseInfo(200))
        store.remove(routing.target_id)
    assert series() == set() and scorer.held == {} and len(store.prefill) == 0
    last = d.route(req("last", 50), None)
    store.remove(last.target_id)  # gone with a request in flight
    assert last.target_id not in {eid for eid, _ in series()}


def test_a_scale_leaves_small_loads_nearly_even_and_large_ones_as_without_it() -> None:
    pool = [ep(1), ep(2)]
    plain = TokenLoadScorer("s", TokenLoadParams(prefill_weight=1.0))
    scaled = TokenLoadScorer("s", TokenLoadParams(prefill_weight=1.0, scale_tokens=100_000))
    for s in (plain, scaled):
        s.held = {pool[0].id: 2_000, pool[1].id: 500}
    assert plain.score(None, pool) == [0.0, 0.75]  # type: ignore[arg-type]
    assert scaled.score(None, pool) == [0.98, 0.995]  # type: ignore[arg-type]
    for s in (plain, scaled):
        s.held = {pool[0].id: 200_000, pool[1].id: 50_000}
        assert s.score(None, pool) == [0.0, 0.75]  # type: ignore[arg-type]
