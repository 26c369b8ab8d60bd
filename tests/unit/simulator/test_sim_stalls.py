"""Host-wide stalls (simulator/model/stalls.py): a seeded schedule every engine of a replay
shares; work runs around it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.model.cache import PrefixCache, chain_block_ids
from simulator.model.cost import CostModel
from simulator.model.engine import Engine, EngineConfig, EngineRequest
from simulator.model.stalls import HostStalls
from simulator.replay.policies import policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.report import summarize
from simulator.replay.workload import ChatParams, ChatWorkload


def test_the_schedule_stalls_the_share_of_time_a_poisson_process_gives_and_repeats() -> None:
    s = HostStalls(rate_hz=2.0, mean_s=0.1, seed=3)
    horizon = 2_000.0
    # starts a Poisson process, durations exponential, overlaps merged: busy 1 - exp(-rate x mean)
    assert s.stalled(horizon) / horizon == pytest.approx(1 - math.exp(-0.2), rel=0.05)
    again = HostStalls(rate_hz=2.0, mean_s=0.1, seed=3)
    assert [again.stalled(t) for t in (1.0, 50.0, 700.0)] == [
        s.stalled(t) for t in (1.0, 50.0, 700.0)
    ]
    assert HostStalls(2.0, 0.1, seed=4).stalled(horizon) != s.stalled(horizon)


def test_no_stalls_cost_nothing() -> None:
    s = HostStalls(0.0, 0.1)
    assert (
        not s.active
        and s.finish(3.0, 0.5) == 3.5
        and s.work(3.0, 3.5) == 0.5
        and s.stalled(9.0) == 0.0
    )
    with pytest.raises(ValueError, match=">= 0"):
        HostStalls(-1.0, 0.1)
    with pytest.raises(ValueError, match="host_stall_s' must be >= 0"):
        CostModel(host_stall_s=-0.1)


@settings(max_examples=200, deadline=None)
@given(start=st.floats(0.0, 100.0), work=st.floats(0.0, 5.0))
def test_work_begun_at_any_time_ends_once_that_much_work_is_done(start: float, work: float) -> None:
    s = HostStalls(rate_hz=1.5, mean_s=0.3, seed=1)
    end = s.finish(start, work)
    assert end >= start + work
    assert s.work(start, end) == pytest.approx(work, abs=1e-9)
    # the wall time beyond the work is exactly the stalls in between
    assert end - start - work == pytest.approx(s.stalled(end) - s.stalled(start), abs=1e-9)


def test_work_ending_at_a_stalls_edge_is_solved_not_stepped_through() -> None:
    s = HostStalls.at([(1.0, 2.0), (3.0, 3.5)])
    assert s.finish(0.0, 1.0) == 1.0  # done just as the stall starts: not delayed
    # a hair more: after the stall (a fixed-point iteration crept through it in steps of the
    # hair, without end)
    assert s.finish(0.0, 1.0 + 1e-13) == pytest.approx(2.0 + 1e-13, abs=1e-15)
    assert s.finish(1.5, 0.0) == 1.5 and s.finish(1.5, 1e-300) == pytest.approx(2.0)
    assert s.finish(1.5, 1.0) == pytest.approx(3.0) and s.finish(1.5, 1.2) == pytest.approx(3.7)
    assert s.finish(2.0, 2.0) == pytest.approx(4.5)


def test_engines_sharing_a_schedule_all_wait_a_stall_out() -> None:
    start, end = 1.0, 1.4
    stalls = HostStalls.at([(start, end), (5.0, 5.1)])
    assert stalls.stalled(10.0) == pytest.approx(0.5) and stalls.work(0.9, 1.5) == pytest.approx(
        0.2
    )
    cost = CostModel()
    engines = [Engine(PrefixCache(1000, 16), cost, EngineConfig()) for _ in range(2)]
    for i, eng in enumerate(engines):
        eng.stalls = stalls
        # one request arrives just before the stall, the other during it
        at = start - 0.001 if i == 0 else (start + end) / 2
        eng.submit(EngineRequest(f"r{i}", 160, chain_block_ids(range(10), i), 1), at)
    exact = cost.prefill_s(160) + cost.decode_step_s(1)
    firsts = []
    for eng in engines:
        while (t := eng.next_event_time()) is not None:
            firsts += [f.time_s for f in eng.advance(t).first_tokens]
    assert firsts[0] == pytest.approx(
        end + exact - 0.001, abs=1e-6
    )  # 1 ms of work before, the rest after
    assert firsts[1] == pytest.approx(end + exact, abs=1e-6)


def test_the_replay_applies_a_profiles_stalls_to_every_replica_repeatably() -> None:
    workload = ChatWorkload(
        ChatParams(num_sessions=40, turns_per_session=4, output_len=32, rate=4.0, seed=1)
    )

    def p90(cost: CostModel, seed: int = 0) -> tuple[float, float]:
        cfg = ReplayConfig(replicas=2, kv_blocks=4096, block_size_tokens=16, cost=cost, seed=seed)
        name, factory = policy_factory("round-robin")
        s = summarize(Replayer(cfg).run(workload, factory, name))
        return s.ttft_p50_s, s.ttft_p90_s

    exact = p90(CostModel())
    stalled = CostModel(host_stall_rate_hz=1.0, host_stall_s=0.2)
    assert p90(stalled) == p90(stalled)
    assert p90(stalled) != p90(stalled, seed=1)
    p50, tail = p90(stalled)
    assert tail > exact[1] + 0.05  # a fifth of the requests meet a stall of 0.2 s on average
    assert p50 < exact[0] + 0.05
