"""The replay's lower bound on TTFT (``simulator.replay.bound``): it holds for every request
under every policy, it is reached where a policy can reach it, and it counts what the cache
could hold and no more."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.model.cost import CostModel
from simulator.replay.bound import bound_percentile, ttft_lower_bounds
from simulator.replay.replayer import ReplayConfig
from simulator.replay.report import summarize
from simulator.replay.workload import (
    ChatParams,
    ChatWorkload,
    MooncakeTrace,
    RagParams,
    RagWorkload,
)
from tests.unit.simulator.test_replay import TRACE, ListWorkload, replay, req, small_shared_prefix

COST = CostModel()


def small_chat() -> ChatWorkload:
    return ChatWorkload(ChatParams(num_sessions=8, num_system_prompts=2, system_prompt_len=512,
                                   turns_per_session=3, question_len=48, output_len=24, rate=12.0, seed=5))  # fmt: skip


def small_rag() -> RagWorkload:
    return RagWorkload(RagParams(num_docs=24, doc_len=256, docs_per_query=3, num_requests=60,
                                 rate=10.0, seed=4))  # fmt: skip


WORKLOADS = {"shared-prefix": small_shared_prefix, "chat": small_chat, "rag": small_rag}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("policy", ["epp", "epp:predicted-ttft", "cache-aware", "oracle",
                                    "random"])  # fmt: skip
def test_no_policy_beats_the_bound_on_any_request(workload: str, policy: str) -> None:
    config = ReplayConfig(replicas=4, kv_blocks=400, seed=7)
    result = replay(WORKLOADS[workload](), policy, config)
    bounds = {b.request_id: b.bound_s
              for b in ttft_lower_bounds(WORKLOADS[workload]().requests(), config.cost,
                                         config.block_size_tokens, config.model)}  # fmt: skip
    served = [o for o in result.outcomes if not o.rejected]
    assert len(served) == len(result.outcomes)
    for o in served:
        assert o.first_token_s - o.arrival_s >= bounds[o.request_id] - 1e-9, o.request_id


def test_one_request_alone_costs_its_whole_prefill_and_a_decode_step() -> None:
    (b,) = ttft_lower_bounds([req(0, 0.0, prefix=1, tokens=512)], COST, 16)
    assert b.bound_s == pytest.approx(COST.prefill_s(512) + COST.decode_step_s(1))
    assert b.blocks_needed == (512 + 16) // 16


def test_a_later_request_can_hit_what_an_earlier_one_brought_and_a_lone_replica_reaches_it() -> None:
    # two requests sharing their first 256 tokens, far apart: the second's bound is a prefill
    # of its own 256 tokens with 256 cached, and one replica (nothing else to choose) gives
    # exactly that
    items = [req(0, 0.0, prefix=1), req(1, 10.0, prefix=1)]
    bounds = ttft_lower_bounds(items, COST, 16)
    assert bounds[1].bound_s == pytest.approx(COST.prefill_s(256, 256) + COST.decode_step_s(1))
    result = replay(ListWorkload(items), "round-robin", ReplayConfig(replicas=1, kv_blocks=400))
    ttfts = [o.first_token_s - o.arrival_s for o in result.outcomes]
    assert ttfts == pytest.approx([b.bound_s for b in bounds])


def test_waiting_for_a_request_that_brings_the_prefix_counts_only_if_it_pays() -> None:
    # request 1 arrives first with a long prompt whose first half request 0 (arriving a moment
    # later) also has: waiting for it saves more prefill than the wait costs
    long_ = dataclasses.replace(req(1, 0.0, prefix=1, tokens=2048), arrival_s=0.0)
    soon = req(0, 0.001, prefix=9, tokens=2048)
    shared = dataclasses.replace(soon, prompt=long_.prompt[: 4096] + soon.prompt[4096:])
    (b_long, _) = ttft_lower_bounds([long_, shared], COST, 16)
    hit = 1024
    assert b_long.bound_s == pytest.approx(
        0.001 + COST.prefill_s(2048 - hit, hit) + COST.decode_step_s(1))
    late = dataclasses.replace(shared, arrival_s=5.0)  # too late to be worth the wait
    (b_long, _) = ttft_lower_bounds([long_, late], COST, 16)
    assert b_long.bound_s == pytest.approx(COST.prefill_s(2048) + COST.decode_step_s(1))


def test_the_percentile_leaves_out_requests_too_large_for_the_replicas() -> None:
    items = [req(0, 0.0, prefix=1, tokens=256), req(1, 1.0, prefix=2, tokens=4096)]
    bounds = ttft_lower_bounds(items, COST, 16)
    assert bound_percentile(bounds, 100, 90) == pytest.approx(bounds[0].bound_s)
    assert bound_percentile(bounds, 10_000, 100) == pytest.approx(bounds[1].bound_s)


@pytest.mark.skipif(not TRACE.exists(), reason="../shared trace absent")
@pytest.mark.parametrize("policy", ["epp:predicted-ttft", "cache-aware"])
def test_the_bound_holds_on_the_mooncake_trace_in_overload(policy: str) -> None:
    # a third faster than the trace's pace on small caches: queues form, some prompts are too
    # large for a replica (the replay rejects them and the percentile leaves them out)
    trace = MooncakeTrace.load(TRACE, time_scale=0.6, limit=200)
    config = ReplayConfig(replicas=4, kv_blocks=4096)
    result = replay(trace, policy, config)
    bounds = ttft_lower_bounds(trace.requests(), config.cost, config.block_size_tokens)
    by_id = {b.request_id: b for b in bounds}
    served = [o for o in result.outcomes if not o.rejected]
    assert {o.request_id for o in result.outcomes if o.rejected} == {
        b.request_id for b in bounds if b.blocks_needed > config.kv_blocks}
    for o in served:
        assert o.first_token_s - o.arrival_s >= by_id[o.request_id].bound_s - 1e-9
    p90 = summarize(result).ttft_p90_s
    assert bound_percentile(bounds, config.kv_blocks, 90) <= p90


def test_the_replay_prints_the_bound_under_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    from simulator.cli import main

    assert main(["replay", "--workload", "chat", "--set", "num_sessions=8", "--policies",
                 "epp", "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("TTFT no policy beats"))
    p50, p90, p99 = (float(x.split()[-1].rstrip("s,")) for x in line.split(": ")[1].split(", "))
    assert 0 < p50 <= p90 <= p99
