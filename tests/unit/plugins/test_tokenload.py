"""token-load-scorer / token-load-filter: tokens in flight per endpoint from epp's own
accounting (pick, first token, response end), and what they do with them."""

from __future__ import annotations

import random

from epp.config.loader import loads_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import ResponseInfo
from epp.plugins.tokenload import TokenLoadFilter, TokenLoadParams, TokenLoadScorer
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


def test_tokens_are_counted_at_the_pick_prefill_drops_at_the_first_token_all_at_the_end() -> None:
    sched = build_scheduler(loads_config(CONFIG), random.Random(1))
    scorer = sched.plugin(TokenLoadScorer)
    assert scorer is not None
    pool = [ep(1), ep(2)]
    big = sched.schedule(req("a", 20_000, max_tokens=100), pool, 1.0)
    sched.commit(big)
    a = big.target.id
    assert scorer.held[a] == 20_100 and scorer.prefill[a] == 20_000
    # the next requests go elsewhere: the scorer prefers the other endpoint
    small = sched.schedule(req("b", 100), pool, 1.1)
    sched.commit(small)
    assert small.target.id != a and scorer.held[small.target.id] == 100 + 256  # decodeTokens
    sched.on_first_token(big, 0.5)
    assert scorer.prefill[a] == 0 and scorer.held[a] == 20_100
    sched.on_response(big, ResponseInfo(200))
    sched.on_response(small, ResponseInfo(499))  # a cancel releases too
    assert scorer.held[a] == 0 and scorer.held[small.target.id] == 0


def test_the_filter_keeps_endpoints_under_their_caps_and_all_when_none_is() -> None:
    f = TokenLoadFilter("f", TokenLoadParams(max_tokens=50_000, max_share=0.5))
    pool = [ep(1, blocks=4096), ep(2), ep(3)]  # ep1 holds 65,536 tokens of KV
    f.held = {pool[0].id: 40_000, pool[1].id: 60_000, pool[2].id: 10_000}
    assert [e.id for e in f.filter(None, pool)] == [pool[2].id]  # type: ignore[arg-type]
    f.held = {e.id: 90_000 for e in pool}
    assert f.filter(None, pool) == pool  # type: ignore[arg-type]


def test_prefill_weighs_more_and_requests_never_heard_of_again_expire() -> None:
    s = TokenLoadScorer("s", TokenLoadParams(prefill_weight=4.0, ttl_seconds=10.0))
    pool = [ep(1), ep(2)]
    s.held = {pool[0].id: 1_000, pool[1].id: 1_600}
    s.prefill = {pool[0].id: 1_000, pool[1].id: 0}
    assert s.score(None, pool) == [0.0, 1.0 - 1_600 / 4_000]  # type: ignore[arg-type]
    sched = build_scheduler(loads_config(CONFIG), random.Random(1))
    scorer = sched.plugin(TokenLoadScorer)
    assert scorer is not None
    lost = sched.schedule(req("a", 1_000), pool, 1.0)
    sched.commit(lost)  # never finished: the server or the stream vanished
    assert scorer.held[lost.target.id] > 0
    later = sched.schedule(req("b", 10), pool, 1.0 + 601)
    sched.commit(later)
    assert scorer.held[lost.target.id] == (266 if later.target.id == lost.target.id else 0)


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
