"""Engine: continuous batching, FIFO queueing, timing, cache effects, LoRA limits."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.model.cache import PrefixCache, chain_block_ids
from simulator.model.cost import CostModel
from simulator.model.engine import Engine, EngineConfig, EngineRequest, RequestTooLarge

COST = CostModel()


def make_engine(
    max_num_seqs: int = 8, num_blocks: int = 1000, max_loras: int = 4, **cost: float
) -> Engine:
    return Engine(
        PrefixCache(num_blocks=num_blocks, block_size_tokens=16),
        CostModel(**cost),
        EngineConfig(max_num_seqs=max_num_seqs, max_loras=max_loras),
    )


def req(
    rid: str, tokens: int = 160, out: int = 10, family: int = 0, adapter: str = ""
) -> EngineRequest:
    return EngineRequest(
        rid, tokens, chain_block_ids(range(tokens // 16), family), out, adapter=adapter
    )


def drain(engine: Engine) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """Run to idle; first-token and finish times by request, and the admission order."""
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    order: list[str] = []
    while (t := engine.next_event_time()) is not None:
        result = engine.advance(t)
        for f in result.first_tokens:
            first[f.request_id] = f.time_s
            order.append(f.request_id)
        for d in result.finished:
            done[d.request_id] = d.time_s
    return first, done, order


def test_lone_request_timing_follows_cost_model() -> None:
    engine = make_engine()
    engine.submit(req("a", tokens=2000, out=5), now=10.0)
    first, done, _ = drain(engine)
    ttft = COST.prefill_s(2000) + COST.decode_step_s(1)
    assert first["a"] == pytest.approx(10.0 + ttft)
    assert done["a"] == pytest.approx(10.0 + ttft + 4 * COST.decode_step_s(1))


def test_a_slowdown_stretches_the_steps_after_the_next_boundary() -> None:
    engine = make_engine()
    engine.slowdown = 2.0
    engine.submit(req("a", tokens=2000, out=41), now=0.0)
    engine.advance(0.0)
    ttft = 2 * (COST.prefill_s(2000) + COST.decode_step_s(1))
    first = engine.advance(ttft).first_tokens
    assert [f.request_id for f in first] == ["a"] and first[0].time_s == pytest.approx(ttft)
    step = 2 * COST.decode_step_s(1)
    # back to full speed mid-decode: the step under way ends at the old cost, the rest at the new
    engine.slowdown = 1.0
    engine.reprice(ttft + 2.5 * step)
    _, done, _ = drain(engine)
    assert done["a"] == pytest.approx(ttft + 3 * step + 37 * COST.decode_step_s(1))


def lone_ttfts(noise: float, seed: int, n: int = 400) -> list[float]:
    """TTFTs of ``n`` requests sent one at a time (each alone on the engine)."""
    engine = Engine(PrefixCache(num_blocks=1000, block_size_tokens=16),
                    CostModel(step_noise=noise), EngineConfig(), seed=seed)  # fmt: skip
    ttfts = []
    for i in range(n):
        t0 = 100.0 * i
        engine.submit(req(f"r{i}", tokens=1024, out=1, family=i), now=t0)
        first, _, _ = drain(engine)
        ttfts.append(first[f"r{i}"] - t0)
    return ttfts


def test_step_noise_spreads_the_steps_around_their_cost_repeatably() -> None:
    cost = CostModel()
    exact = cost.prefill_s(1024) + cost.decode_step_s(1)
    assert lone_ttfts(0.0, seed=1, n=5) == pytest.approx([exact] * 5)
    noisy = lone_ttfts(0.5, seed=1)
    assert noisy == lone_ttfts(0.5, seed=1)  # the engine's own seeded generator
    assert noisy != lone_ttfts(0.5, seed=2)
    # log-normal of mean 1, sigma 0.5: the mean stays the cost, the median is exp(-1/8) of it
    assert statistics.fmean(noisy) == pytest.approx(exact, rel=0.08)
    assert statistics.median(noisy) == pytest.approx(exact * math.exp(-0.125), rel=0.08)
    assert statistics.stdev(math.log(t) for t in noisy) == pytest.approx(0.5, rel=0.12)


def test_negative_step_noise_is_refused() -> None:
    with pytest.raises(ValueError, match="step_noise' must be >= 0"):
        CostModel(step_noise=-0.1)


def chunked_engine(budget: int) -> Engine:
    return Engine(PrefixCache(num_blocks=1000, block_size_tokens=16), COST,
                  EngineConfig(max_batched_tokens=budget, chunked_prefill=True))  # fmt: skip


def test_chunked_prefill_computes_a_long_prompt_over_several_steps() -> None:
    engine = chunked_engine(512)
    engine.submit(req("a", tokens=2000, out=5), now=0.0)
    engine.advance(0.0)
    assert engine.tokens_generated("a", 0.01) == 0
    first, done, _ = drain(engine)
    # chunks of 512, 512, 512 and 464: the prompt's cost once, a decode step with each chunk
    ttft = COST.prefill_s(2000) + 4 * COST.decode_step_s(1)
    assert first["a"] == pytest.approx(ttft)
    assert done["a"] == pytest.approx(ttft + 4 * COST.decode_step_s(1))


def test_chunked_prefill_shares_its_steps_with_the_running_decodes() -> None:
    engine = chunked_engine(512)
    engine.submit(req("a", tokens=32, out=200), now=0.0)
    engine.advance(0.0)
    engine.submit(req("b", tokens=2000, out=5, family=1), now=0.5)
    admitted: dict[str, float] = {}
    first: dict[str, float] = {}
    while (t := engine.next_event_time()) is not None:
        for f in engine.advance(t).first_tokens:
            first[f.request_id], admitted[f.request_id] = f.time_s, f.admitted_s
        if "b" in admitted and "a" in first:
            break
    # a's decode takes one token of each step: b's chunks are 511, 511, 511 and 467 tokens
    assert first["b"] - admitted["b"] == pytest.approx(COST.prefill_s(2000) + 4 * COST.decode_step_s(2))
    during = engine.tokens_generated("a", first["b"])
    assert during is not None and during == 1 + round((admitted["b"] - first["a"]) / COST.decode_step_s(1)) + 4


def test_max_batch_is_respected_and_waiting_is_fifo() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.submit(req(f"r{i}", family=i), now=0.0)
    assert engine.num_running == 0 and engine.next_event_time() == 0.0
    engine.advance(0.0)  # requests arriving at one instant are admitted together
    assert engine.num_running == 2 and engine.num_waiting == 3
    peak = 0
    order: list[str] = []
    while (t := engine.next_event_time()) is not None:
        result = engine.advance(t)
        order += [f.request_id for f in result.first_tokens]
        peak = max(peak, engine.num_running)
    assert peak == 2
    assert order == ["r0", "r1", "r2", "r3", "r4"]


def test_arrival_mid_decode_joins_at_next_step_boundary() -> None:
    engine = make_engine()
    engine.submit(req("long", out=100), now=0.0)
    engine.advance(0.0)
    start = engine.next_event_time()
    assert start is not None
    engine.advance(start)
    step = COST.decode_step_s(1)
    arrival = start + 10.5 * step
    engine.submit(req("late", family=1), now=arrival)
    first, _, _ = drain(engine)
    boundary = start + 11 * step
    assert first["late"] == pytest.approx(boundary + COST.prefill_s(160) + COST.decode_step_s(2))


def test_repeated_prompt_reports_cached_tokens_and_is_faster() -> None:
    engine = make_engine()
    engine.submit(req("a", tokens=2000), now=0.0)
    drain(engine)
    engine.submit(req("b", tokens=2000), now=100.0)
    engine.advance(100.0)
    t = engine.next_event_time()
    assert t is not None
    result = engine.advance(t)
    assert result.first_tokens[0].cached_tokens == 1984  # 124 blocks; last token recomputed
    assert t - 100.0 < COST.prefill_s(2000) / 4
    assert engine.prefix_cache_hits_tokens == 1984
    assert engine.prefix_cache_queries_tokens == 4000


def test_request_waits_for_kv_blocks_when_cache_is_full() -> None:
    engine = make_engine(num_blocks=12)
    engine.submit(req("a", tokens=160, out=16), now=0.0)  # 11 blocks
    engine.submit(req("b", tokens=160, out=16, family=1), now=0.0)
    engine.advance(0.0)
    assert engine.num_running == 1 and engine.num_waiting == 1
    first, done, _ = drain(engine)
    assert first["b"] > done["a"]


def test_too_large_request_is_rejected_at_submit() -> None:
    engine = make_engine(num_blocks=4)
    with pytest.raises(RequestTooLarge):
        engine.submit(req("huge", tokens=160), now=0.0)
    assert engine.num_waiting == 0


def test_max_loras_holds_back_a_third_adapter_but_not_base_requests() -> None:
    engine = make_engine(max_loras=2)
    engine.submit(req("a", adapter="la", out=50), now=0.0)
    engine.submit(req("b", adapter="lb", out=50, family=1), now=0.0)
    engine.submit(req("c", adapter="lc", family=2), now=0.0)
    engine.submit(req("base", family=3), now=0.0)
    engine.advance(0.0)
    assert engine.running_adapters() == ["la", "lb"]
    assert engine.waiting_adapters() == ["lc"]
    first, done, _ = drain(engine)
    assert first["base"] < done["a"] <= first["c"]


def test_abort_frees_slot_for_the_next_request_at_the_next_step() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.submit(req("a", out=1000), now=0.0)
    engine.submit(req("b", family=1), now=0.0)
    engine.advance(0.5)
    assert engine.abort("a", now=0.5)
    assert not engine.abort("a", now=0.5)
    first, done, _ = drain(engine)
    assert "a" not in done
    assert 0.5 < first["b"] < 0.5 + COST.decode_step_s(1) + COST.prefill_s(160) + 0.02
    assert engine.kv_usage == 0.0


def test_tokens_generated_advances_with_time() -> None:
    engine = make_engine()
    engine.submit(req("a", out=50), now=0.0)
    engine.advance(0.0)
    t = engine.next_event_time()
    assert t is not None
    assert engine.tokens_generated("a", t - 1e-9) == 0
    engine.advance(t)
    step = COST.decode_step_s(1)
    assert engine.tokens_generated("a", t) == 1
    assert engine.tokens_generated("a", t + 10.5 * step) == 11
    assert engine.tokens_generated("missing", t) is None


workload = st.lists(
    st.tuples(st.floats(0, 2.0), st.integers(1, 3000), st.integers(1, 60), st.integers(0, 3)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=50, deadline=None)
@given(workload)
def test_replay_is_deterministic_and_every_request_finishes(
    items: list[tuple[float, int, int, int]],
) -> None:
    def run() -> list[tuple[str, float, int]]:
        engine = make_engine(max_num_seqs=4, num_blocks=2000)
        events: list[tuple[str, float, int]] = []
        for i, (arrival, tokens, out, family) in enumerate(sorted(items)):
            while (t := engine.next_event_time()) is not None and t <= arrival:
                r = engine.advance(t)
                events += [(f.request_id, f.time_s, f.cached_tokens) for f in r.first_tokens]
                events += [(d.request_id, d.time_s, -1) for d in r.finished]
                assert engine.num_running <= 4
            engine.submit(req(f"r{i}", tokens, out, family), now=arrival)
        while (t := engine.next_event_time()) is not None:
            r = engine.advance(t)
            events += [(f.request_id, f.time_s, f.cached_tokens) for f in r.first_tokens]
            events += [(d.request_id, d.time_s, -1) for d in r.finished]
        assert engine.cache.used_blocks == 0
        return events

    first = run()
    assert first == run()
    assert sum(1 for e in first if e[2] == -1) == len(items)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(16, 1200), st.integers(1, 40),
                       st.integers(0, 3)), min_size=1, max_size=25),
    st.integers(0, 24),
)
def test_a_clone_runs_as_the_engine_would_and_a_what_if_leaves_the_engine_unchanged(
    arrivals: list[tuple[float, int, int, int]], cut: int
) -> None:
    """Drive two identical engines; part way through, clone one and ask it a what-if. The
    clone replays the rest exactly as the original does; the what-if equals the first token
    the probe really gets when it is submitted and nothing else arrives; the engine asked is
    unchanged (it ends exactly as its twin)."""
    timeline = sorted((t, i, tokens, out, family) for i, (t, tokens, out, family)
                      in enumerate(arrivals))  # fmt: skip
    cut = min(cut, len(timeline))
    a, b = make_engine(max_num_seqs=4, num_blocks=300), make_engine(max_num_seqs=4, num_blocks=300)
    for engine in (a, b):
        for t, i, tokens, out, family in timeline[:cut]:
            engine.submit(req(f"r{i}", tokens, out, family), now=t)
    now = timeline[cut - 1][0] if cut else 0.0
    probe = req("probe", 400, 5, family=1)
    predicted = a.first_token_if(probe, now)
    clone = a.clone()
    clone.submit(probe, now)
    assert drain(clone)[0]["probe"] == pytest.approx(predicted)
    twin = b.clone()
    for engine in (a, b, twin):
        for t, i, tokens, out, family in timeline[cut:]:
            engine.submit(req(f"r{i}", tokens, out, family), now=max(t, now))
    assert drain(a) == drain(b) == drain(twin)
    assert a.cache.hits_tokens == b.cache.hits_tokens == twin.cache.hits_tokens


def test_a_what_if_too_large_for_the_cache_says_so() -> None:
    engine = make_engine(num_blocks=10)
    with pytest.raises(RequestTooLarge):
        engine.first_token_if(req("big", tokens=2000), 0.0)
