"""Trace replay: determinism, conservation, bounds, capacity, and each policy's behaviour."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console

from epp.framework.endpoint import EndpointId
from simulator.model.cost import CostModel
from simulator.replay.policies import POLICY_NAMES, policy_factory
from simulator.replay.replayer import Outcome, ReplayConfig, Replayer, ReplayResult
from simulator.replay.report import summarize
from simulator.replay.workload import (
    ChatParams,
    ChatWorkload,
    MooncakeTrace,
    SharedPrefixParams,
    SharedPrefixWorkload,
    TraceRequest,
    build_generator,
    engine_block_hashes,
    random_text,
    reply_text,
)

TRACE = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


class ListWorkload:
    name = "hand-made"

    def __init__(self, requests: list[TraceRequest]) -> None:
        self.items = requests

    def __len__(self) -> int:
        return len(self.items)

    def requests(self) -> Iterator[TraceRequest]:
        return iter(self.items)


def req(i: int, t: float, prefix: int, tokens: int = 512, out: int = 16, session: str = "") -> TraceRequest:
    """A prompt of ``tokens`` tokens: the first half is shared by every request with the same
    ``prefix``, the second half is unique to request ``i``."""
    half = tokens * 2
    text = random_text(1000 + prefix, half) + random_text(10**6 + i, tokens * 4 - half)
    return TraceRequest(f"r{i}", t, tokens, out, text, session_id=session)


def small_shared_prefix(rate: float = 20.0) -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        SharedPrefixParams(
            num_groups=6, num_prompts_per_group=12, system_prompt_len=768, question_len=64,
            output_len=24, rate=rate, seed=3,
        )
    )


SMALL = ReplayConfig(replicas=4, kv_blocks=400, seed=7)


def replay(workload: object, policy: str, config: ReplayConfig = SMALL) -> ReplayResult:
    name, factory = policy_factory(policy)
    return Replayer(config).run(workload, factory, name)  # type: ignore[arg-type]


def picks(result: ReplayResult) -> list[int]:
    return [o.replica for o in result.outcomes]


# --- engine-level properties ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["epp", "precise", "cache-aware", "random"])
def test_replay_is_deterministic(policy: str) -> None:
    a = replay(small_shared_prefix(), policy)
    b = replay(small_shared_prefix(), policy)
    key = [(o.replica, o.first_token_s, o.finish_s, o.cached_tokens) for o in a.outcomes]
    assert key == [(o.replica, o.first_token_s, o.finish_s, o.cached_tokens) for o in b.outcomes]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_request_finishes_exactly_once(policy: str) -> None:
    workload = ChatWorkload(ChatParams(num_sessions=8, turns_per_session=4, num_system_prompts=2,
                                       system_prompt_len=256, question_len=32, output_len=16, rate=30))
    result = replay(workload, policy)
    assert [o.request_id for o in result.outcomes] == [r.request_id for r in workload.requests()]
    assert all(o.finished_count == 1 and not o.rejected for o in result.outcomes)
    assert all(o.arrival_s <= o.admitted_s <= o.first_token_s <= o.finish_s for o in result.outcomes)


def test_oversized_request_is_rejected_once_and_others_still_run() -> None:
    huge = req(0, 0.0, prefix=1, tokens=16 * 500)  # more blocks than the cache holds
    result = replay(ListWorkload([huge, req(1, 0.1, prefix=1)]), "epp")
    assert [o.rejected for o in result.outcomes] == [True, False]
    assert [o.finished_count for o in result.outcomes] == [1, 1]
    assert summarize(result).rejected == 1


@pytest.mark.parametrize("policy", ["epp", "random", "precise"])
def test_cache_capacity_is_respected(policy: str) -> None:
    config = ReplayConfig(replicas=2, kv_blocks=120, seed=1, sample_interval_s=0.05)
    result = replay(small_shared_prefix(rate=40), policy, config)
    assert max(result.peak_blocks) <= 120
    assert max(result.peak_blocks) >= 100  # the workload does fill the cache
    replayer = Replayer(config)
    replayer.run(small_shared_prefix(rate=40), policy_factory(policy)[1])
    for engine in replayer.engines:
        c = engine.cache
        assert c.used_blocks == 0
        assert c.cached_blocks + c.free_blocks == c.num_blocks


@pytest.mark.parametrize(
    "workload",
    [
        small_shared_prefix(),
        ChatWorkload(ChatParams(num_sessions=12, turns_per_session=4, num_system_prompts=3,
                                system_prompt_len=384, question_len=48, output_len=32, rate=15, seed=2)),
    ],
    ids=["shared-prefix", "chat"],
)
def test_precise_hit_rate_bounds_every_other_policy(workload: object) -> None:
    """With the profile that weighs only prefix and load (prefix-load), knowing the servers'
    caches from their events gives the top hit rate. (The default trades hit rate for TTFT
    through its cost model, so there the oracle's exact knowledge may place differently.)"""
    family = {"epp", "precise", "oracle"}
    rates = {p: summarize(replay(workload, f"{p}:prefix-load" if p in family else p)).hit_rate
             for p in POLICY_NAMES}
    assert rates["precise"] > 0.3
    for policy, rate in rates.items():
        assert rate <= rates["precise"] + 1e-9, (policy, rates)


def test_prefix_aware_policies_beat_random_on_shared_prefixes() -> None:
    # 16 system prompts of 768 tokens (12k tokens) do not fit one replica's 6.4k-token cache:
    # random thrashes every cache, epp partitions the groups.
    w = SharedPrefixWorkload(SharedPrefixParams(num_groups=16, num_prompts_per_group=8,
                                                system_prompt_len=768, question_len=64,
                                                output_len=24, rate=20, seed=3))
    rates = {p: summarize(replay(w, p)).hit_rate for p in ("epp", "random")}
    assert rates["epp"] > rates["random"] + 0.2


# --- each policy's characteristic behaviour on a tiny hand-made trace ------------------------


def test_round_robin_cycles_through_replicas() -> None:
    result = replay(ListWorkload([req(i, i * 0.01, prefix=i) for i in range(9)]), "round-robin")
    assert picks(result) == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_random_spreads_and_depends_on_seed() -> None:
    trace = ListWorkload([req(i, i * 0.01, prefix=0) for i in range(40)])
    a = picks(replay(trace, "random"))
    b = picks(replay(trace, "random", ReplayConfig(replicas=4, kv_blocks=400, seed=8)))
    assert set(a) == {0, 1, 2, 3}
    assert a != b


def test_replicas_on_a_shared_host_slow_each_other_down() -> None:
    """shared_host_slowdown 1: a replica's steps take twice their cost while the other works."""
    independent = CostModel()
    shared = dataclasses.replace(independent, shared_host_slowdown=1.0)

    def run(trace: list[TraceRequest], cost: CostModel) -> list[Outcome]:
        return replay(ListWorkload(trace), "round-robin", ReplayConfig(replicas=2, kv_blocks=400, cost=cost)).outcomes

    def ttfts(outcomes: list[Outcome]) -> list[float]:
        return [o.first_token_s - o.arrival_s for o in outcomes]

    alone = ttfts(run([req(0, 0.0, prefix=0)], shared))[0]
    assert ttfts(run([req(0, 0.0, prefix=0)], independent)) == pytest.approx([alone])  # nobody else busy
    pair = [req(0, 0.0, prefix=0), req(1, 0.0, prefix=1)]
    assert ttfts(run(pair, independent)) == pytest.approx([alone, alone])
    assert ttfts(run(pair, shared)) == pytest.approx([2 * alone, 2 * alone])
    # a long decode is re-timed when the other replica starts working, and again when it stops
    staggered = [req(0, 0.0, prefix=0, out=400), req(1, 1.0, prefix=1)]
    base, slowed = run(staggered, independent), run(staggered, shared)
    assert slowed[0].first_token_s == pytest.approx(base[0].first_token_s)
    extra = slowed[0].finish_s - base[0].finish_s
    busy = slowed[1].finish_s - slowed[1].arrival_s  # the other replica's work, all slowed
    assert 0.9 * busy / 2 < extra < 1.1 * busy / 2  # during it, r0's steps took twice as long


def test_chunked_prefill_in_the_replay_answers_everyone_and_spreads_long_prompts() -> None:
    whole = replay(small_shared_prefix(), "epp", ReplayConfig(replicas=4, kv_blocks=400, seed=7,
                                                              max_batched_tokens=256))  # fmt: skip
    chunked = replay(small_shared_prefix(), "epp", ReplayConfig(replicas=4, kv_blocks=400, seed=7,
                                                                max_batched_tokens=256, chunked_prefill=True))  # fmt: skip
    assert all(o.finished_count == 1 and not o.rejected for o in chunked.outcomes)
    assert len(chunked.outcomes) == len(whole.outcomes)
    # a 768-token system prompt takes several 256-token steps: some first tokens come later
    assert [o.first_token_s for o in chunked.outcomes] != [o.first_token_s for o in whole.outcomes]


def test_least_load_sends_concurrent_requests_to_distinct_replicas() -> None:
    # Long outputs keep all four in flight; the fifth arrives after the first finishes.
    trace = [req(i, i * 0.001, prefix=0, out=500) for i in range(4)] + [req(9, 60.0, prefix=0)]
    result = replay(ListWorkload(trace), "least-load")
    assert sorted(picks(result)[:4]) == [0, 1, 2, 3]


def test_session_affinity_keeps_a_session_on_one_replica() -> None:
    trace = [req(i, i * 0.05, prefix=i, session=f"s{i % 3}") for i in range(12)]
    result = replay(ListWorkload(trace), "session-affinity")
    by_session: dict[str, set[int]] = {}
    for r, o in zip(trace, result.outcomes, strict=True):
        by_session.setdefault(r.session_id, set()).add(o.replica)
    assert all(len(v) == 1 for v in by_session.values())
    assert len({next(iter(v)) for v in by_session.values()}) == 3  # spread by load at first


def test_chwbl_hashes_the_first_100_characters_within_the_load_bound() -> None:
    # Same first 100 characters (same prefix): same replica while its load stays in bounds.
    spaced = [req(i, i * 5.0, prefix=1) for i in range(5)]
    assert len(set(picks(replay(ListWorkload(spaced), "chwbl")))) == 1
    # A burst of 12 concurrent requests with one key: the bound (1.25 x mean) spills them over.
    burst = [req(i, i * 0.0001, prefix=1, out=400) for i in range(12)]
    spilled = picks(replay(ListWorkload(burst), "chwbl"))
    assert len(set(spilled)) > 1
    assert max(spilled.count(r) for r in set(spilled)) <= 4


def test_cache_aware_follows_its_tree_then_balances_when_imbalanced() -> None:
    # Balanced: a request matching a previous one (> 30% of characters) follows it; a new
    # prefix goes to the replica with the smallest tree.
    trace = [req(0, 0.0, prefix=1), req(1, 1.0, prefix=2), req(2, 2.0, prefix=1), req(3, 3.0, prefix=3)]
    p = picks(replay(ListWorkload(trace), "cache-aware"))
    assert p[2] == p[0]
    assert len({p[0], p[1], p[3]}) == 3
    # Imbalanced (max - min > 64 and max > 1.5 min): 100 concurrent requests with one prefix
    # stop piling up on one replica once it holds 65 more than the others.
    burst = [req(i, i * 0.0001, prefix=1, tokens=64, out=800) for i in range(100)]
    p = picks(replay(ListWorkload(burst), "cache-aware", ReplayConfig(replicas=4, kv_blocks=8000)))
    assert p[:65] == [p[0]] * 65  # 65 - 0 > 64 only after the 65th
    assert p[65] != p[0]
    assert set(p[65:]) == {0, 1, 2, 3}


def test_epp_routes_a_shared_prefix_back_where_it_was_sent() -> None:
    trace = [req(0, 0.0, prefix=1), req(1, 0.5, prefix=2), req(2, 1.0, prefix=1), req(3, 1.5, prefix=2)]
    result = replay(ListWorkload(trace), "epp")
    p = picks(result)
    assert p[2] == p[0] and p[3] == p[1]
    assert [o.cached_tokens > 0 for o in result.outcomes] == [False, False, True, True]


def test_precise_reads_the_true_cache() -> None:
    trace = [req(0, 0.0, prefix=1), req(1, 2.0, prefix=1), req(2, 4.0, prefix=5)]
    result = replay(ListWorkload(trace), "precise")
    assert picks(result)[1] == picks(result)[0]
    assert result.outcomes[1].cached_tokens >= 240


def test_ttft_oracle_takes_the_cached_prefix_unless_its_replica_is_busy_prefilling() -> None:
    # r2 shares r0's prefix: it goes where r0 went; r3 shares r1's prefix, but arrives while a
    # long prompt (r4, sent just before to r1's replica as the only idle-looking choice) is
    # prefilling there, and elsewhere it starts at once
    quiet = [req(0, 0.0, prefix=1), req(1, 0.5, prefix=2), req(2, 1.0, prefix=1)]
    result = replay(ListWorkload(quiet), "ttft-oracle", ReplayConfig(replicas=2, kv_blocks=4000))
    p = picks(result)
    assert p[2] == p[0]
    assert result.outcomes[2].cached_tokens >= 240
    busy = [req(0, 0.0, prefix=1), req(1, 5.0, prefix=1, tokens=3500), req(2, 5.001, prefix=1)]
    result = replay(ListWorkload(busy), "ttft-oracle", ReplayConfig(replicas=2, kv_blocks=4000))
    p = picks(result)
    assert p[1] == p[0]  # the long prompt takes the cached prefix
    assert p[2] != p[1]  # its 0.3 s prefill there costs more than recomputing 256 tokens
    waited = result.outcomes[2].first_token_s - result.outcomes[2].arrival_s
    assert waited < 0.1


def test_ttft_oracle_is_named_only_on_request() -> None:
    assert "ttft-oracle" not in POLICY_NAMES
    with pytest.raises(ValueError, match="ttft-oracle"):
        policy_factory("nope")


# --- workloads --------------------------------------------------------------------------------


def test_mooncake_blocks_become_shared_text_and_engine_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [7, 10]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = MooncakeTrace.load(path, time_scale=0.5).requests()
    assert (len(a.prompt), len(b.prompt)) == (4400, 2800)
    assert a.prompt[:2048] == b.prompt[:2048] and a.prompt[2048:2100] != b.prompt[2048:2100]
    assert b.arrival_s == 1.0
    ha, hb = engine_block_hashes(a, 16, 0), engine_block_hashes(b, 16, 0)
    assert (len(ha), len(hb)) == (1100 // 16, 700 // 16)
    assert ha[:32] == hb[:32] and ha[32] != hb[32]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ('{"timestamp": 0, "input_length": 10', "line 1 column"),
        ('[1, 2]', "a row is a JSON object"),
        ('{"timestamp": 0, "input_length": -10, "output_length": 5, "hash_ids": [1]}',
         "input_length -10 is below 1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}',
         "output_length -1 is negative"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "timestamp nan is not a time"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}',
         "negative block id"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "'hash_ids'"),
    ],
)
def test_mooncake_rows_that_are_not_usable_are_named(tmp_path: Path, row: str, reason: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n\n" + row + "\n")
    with pytest.raises(ValueError) as err:
        MooncakeTrace.load(path)
    assert "t.jsonl:3: not a Mooncake trace row" in str(err.value) and reason in str(err.value)


def test_bad_trace_rows_are_skipped_and_counted_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulator.cli import main

    good = '{"timestamp": %d, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([good % 0, '{"timestamp": 1', good % 5, "[]", good % 9]) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: .*--skip-bad-rows"):
        MooncakeTrace.load(path)
    trace = MooncakeTrace.load(path, skip_bad_rows=True)
    assert len(trace) == 3 and [w.split(": ")[0][-9:] for w in trace.skipped] == ["t.jsonl:2", "t.jsonl:4"]
    assert trace.with_time_scale(2.0).skipped == trace.skipped
    assert main(["replay", "--policies", "random", "--no-progress", "--trace", str(path),
                 "--skip-bad-rows"]) == 0  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped 2 bad row(s)" in err and "t.jsonl:2" in err
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"no trace rows \(1 bad, the first: .*bad.jsonl:1"):
        MooncakeTrace.load(tmp_path / "bad.jsonl", skip_bad_rows=True)


def test_a_policy_with_no_finished_request_reports_dashes_not_nan() -> None:
    from simulator.replay.report import markdown_table, stats_table

    # larger than a replica's whole KV cache (400 blocks of 16 tokens): rejected everywhere
    result = replay(ListWorkload([req(0, 0.0, prefix=1, tokens=8000)]), "epp")
    stats = summarize(result)
    assert stats.rejected == 1
    text = markdown_table([stats])
    assert "nan" not in text and "| - |" in text
    rendered = Console(width=300, record=True)
    rendered.print(stats_table([stats]))
    assert "nan" not in rendered.export_text()


def test_chat_turns_extend_the_previous_turn_with_its_reply() -> None:
    w = ChatWorkload(ChatParams(num_sessions=1, turns_per_session=3, rate=1.0))
    first, second, _ = w.requests()
    assert second.prompt.startswith(first.prompt + "<|assistant|>")
    assert second.session_id == first.session_id


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_mooncake_trace_head_replays() -> None:
    trace = MooncakeTrace.load(TRACE, time_scale=1.0, limit=120)
    result = replay(trace, "epp", ReplayConfig(replicas=4, kv_blocks=16384))
    assert len(result.outcomes) == 120
    assert all(o.finished_count == 1 for o in result.outcomes)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "chat", "--set", "rate=-1"], "parameter 'rate': must be > 0"),
        (["--workload", "chat", "--set", "rate=fast"], "parameter 'rate': expected a number"),
        (["--workload", "rag", "--set", "num_docs=2.5"], "parameter 'num_docs': expected an integer"),
        (["--workload", "shared-prefix", "--set", "question_len=-3"], "'question_len': must be >= 0"),
        (["--workload", "shared-prefix", "--set", "num_groups=0"], "has no requests"),
        (["--set", "rate=4"], "--set configures a generator: add --workload"),
        (["--workload", "chat", "--sweep", "rate=0"], "--sweep rate: must be > 0"),
        (["--workload", "chat", "--sweep", "replicas=two"], "--sweep replicas: 'two' is not an integer"),
    ],
)
def test_bad_replay_input_is_one_error_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from simulator.cli import main

    assert main(["replay", "--policies", "random", "--no-progress", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert err.startswith("error:") and message in err


def test_negative_limit_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from simulator.cli import main

    with pytest.raises(SystemExit):
        main(["replay", "--limit", "-5"])
    assert "argument --limit: must be >= 0" in capsys.readouterr().err


def test_inference_perf_config_reads_its_shared_prefix_section() -> None:
    from simulator.replay.workload import build_generator

    config = {
        "load": {"type": "constant", "stages": [{"rate": 20, "duration": 30}]},
        "api": {"type": "chat"},
        "server": {"type": "vllm"},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_unique_system_prompts": 4, "num_users_per_system_prompt": 5,
            "system_prompt_len": 100, "question_len": 50, "output_len": 50,
            "question_len_std": 3, "enable_multi_turn_chat": True,
        }},
    }
    workload = build_generator("shared-prefix", config)
    assert isinstance(workload, SharedPrefixWorkload)
    assert (workload.p.num_groups, workload.p.num_prompts_per_group, workload.p.rate) == (4, 5, 20.0)


def test_flow_control_in_the_replay_protects_the_quiet_tenant_and_answers_everyone() -> None:
    """The same Director queue as epp serve: with a noisy neighbour bursting, the quiet
    tenant's TTFT tail shrinks, and every request is served or rejected exactly once."""
    import numpy as np

    from epp.config.loader import default_config, parse_config
    from simulator.replay.policies import EppPolicy
    from simulator.replay.replayer import ReplayConfig, Replayer
    from simulator.replay.workload import TenantsParams, TenantsWorkload

    workload = TenantsWorkload(TenantsParams(duration_s=40, burst_every_s=20, burst_requests=160))
    config = ReplayConfig(replicas=2, kv_blocks=4096)
    p99: dict[str, float] = {}
    for label, flow in (("off", None), ("on", {"enabled": True, "maxQueueSeconds": 5})):
        raw = dict(default_config().raw)
        if flow:
            raw["flowControl"] = flow
        cfg = parse_config(raw)
        result = Replayer(config).run(workload, lambda c, cfg=cfg: EppPolicy(c, cfg), label)
        assert all(o.finished_count == 1 for o in result.outcomes)  # nothing lost
        quiet = [o for o in result.outcomes if o.tenant == "quiet" and not o.rejected]
        p99[label] = float(np.percentile([o.first_token_s - o.arrival_s for o in quiet], 99))
        if flow:
            assert {o.reason for o in result.outcomes if o.rejected} <= {"expired"}
    assert p99["on"] < 0.7 * p99["off"], p99


def test_the_predicted_ttft_policy_reports_its_prediction_error() -> None:
    result = replay(small_shared_prefix(), "epp:predicted-ttft")
    stats = summarize(result)
    assert stats.ttft_pred_count == stats.served == len(result.outcomes)
    observed = sorted(o.first_token_s - o.dispatched_s for o in result.outcomes)
    assert sorted(p[1] for p in result.ttft_predictions) == pytest.approx(observed)
    assert 0 < stats.ttft_pred_rel_p50 < 1 and stats.ttft_pred_abs_mean_s > 0
    assert summarize(replay(small_shared_prefix(), "epp:prefix-load")).ttft_pred_count == 0


@pytest.mark.parametrize(
    "policy,replay_interval,expected",
    [("epp", None, 0.2), ("epp:predicted-ttft", None, 1.0), ("epp:predicted-ttft", 0.5, 0.5),
     ("random", None, float("nan"))],
)
def test_the_scrape_period_follows_the_epp_config_unless_the_replay_sets_one(
    policy: str, replay_interval: float | None, expected: float
) -> None:
    workload = small_shared_prefix()
    last_arrival = max(r.arrival_s for r in workload.requests())
    _, factory = policy_factory(policy)
    seen: list[float] = []

    def counted(cluster: object) -> object:
        p = factory(cluster)  # type: ignore[arg-type]
        observe = p.observe
        p.observe = lambda metrics, now: (seen.append(now), observe(metrics, now))[1]  # type: ignore[method-assign]
        return p

    config = ReplayConfig(replicas=4, kv_blocks=400, seed=7, scrape_interval_s=replay_interval)
    result = Replayer(config).run(workload, counted)  # type: ignore[arg-type]
    assert summarize(result).scrape_interval_s == pytest.approx(expected, nan_ok=True)
    during = sorted({t for t in seen if t <= last_arrival})  # the drain scrapes at its own pace
    if expected != expected:  # nan: a policy that reads no metrics is not scraped per arrival
        assert during == []
        return
    assert all(abs(t / expected - round(t / expected)) < 1e-6 for t in during if t > 1e-9)
    assert len(during) == pytest.approx(last_arrival / expected, abs=2)


def test_agent_sessions_grow_their_context_and_sub_agents_start_from_their_parents() -> None:
    w = build_generator("agentic", {"num_sessions": 6, "rate": 1, "min_turns": 8, "max_turns": 12,
                                    "subagent_share": 0.5, "max_context": 30_000,
                                    "tool_output_len": 800, "system_prompt_len": 1000})  # fmt: skip
    reqs = list(w.requests())
    assert len(reqs) == len(w) and reqs == sorted(reqs, key=lambda r: r.arrival_s)
    by_agent: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_agent.setdefault(r.session_id, []).append(r)
    mains = [a for a in by_agent if "." not in a]
    subs = [a for a in by_agent if "." in a]
    assert len(mains) == 6 and subs  # sub-agents were spawned
    for agent, turns in by_agent.items():
        for prev, nxt in itertools.pairwise(turns):  # each turn extends the last with its reply
            assert nxt.prompt.startswith(prev.prompt + "<|assistant|>" + reply_text(prev) + "<|tool|>")
        if "." in agent:  # a sub-agent starts from its parent's latest turn and reply
            parent = [r for r in by_agent[agent.split(".")[0]] if r.arrival_s < turns[0].arrival_s][-1]
            assert turns[0].prompt.startswith(parent.prompt + "<|assistant|>" + reply_text(parent))
    assert max(r.prompt_tokens for r in by_agent[mains[0]]) <= 30_000 + 1_000  # max_context
    # sessions of one system prompt share it; the epp default replays them with sessions on
    result = Replayer(ReplayConfig(replicas=4, kv_blocks=4096)).run(w, policy_factory("epp:agentic")[1], "a")
    assert summarize(result).hit_rate > 0.8


# --- index sync between routers -----------------------------------------------------------------


def _placed_then_asked_again(sync_delay_s: float | None) -> int:
    """Eight prefixes, each placed through router 0, then asked for again through router 1
    half a second later; how many of the second requests land where the first went. The
    profile without prefix-home (prefix-load), so that only the index can tell router 1."""
    trace = []
    for g in range(8):
        trace += [req(2 * g, g * 2.0, prefix=g), req(2 * g + 1, g * 2.0 + 0.5, prefix=g)]
    config = dataclasses.replace(SMALL, routers=2, sync_delay_s=sync_delay_s)
    p = picks(replay(ListWorkload(trace), "epp:prefix-load", config))
    return sum(p[2 * g + 1] == p[2 * g] for g in range(8))


def test_with_index_sync_a_router_follows_the_prefixes_another_placed() -> None:
    assert _placed_then_asked_again(0.02) == 8
    # the control: each router knows only what it routed itself
    assert _placed_then_asked_again(None) < 8


def test_a_peers_write_counts_only_once_the_sync_delay_has_passed() -> None:
    # the second request comes 0.5 s after the first: a 1 s delay has not delivered it yet
    assert _placed_then_asked_again(1.0) == _placed_then_asked_again(None)


def test_a_negative_sync_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="sync_delay_s"):
        dataclasses.replace(SMALL, routers=2, sync_delay_s=-0.1)


class _Counter:
    """A router's prefill in flight, set by hand (the ``SharedPrefill`` protocol)."""

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self.peers: Callable[[EndpointId], float] = lambda _e: 0.0

    def prefill_in_flight(self) -> dict[str, float]:
        return self.own

    def use_peer_prefill(self, tokens: Callable[[EndpointId], float]) -> None:
        self.peers = tokens


class _Index:
    """A router's index that shares nothing (the ``SharedIndex`` protocol)."""

    name = "index"
    index = None

    def subscribe(self, sink: object) -> Callable[[], None]:
        return lambda: None

    def apply_remote(self, endpoint_id: EndpointId, hashes: object, stamp_s: float) -> None:
        pass


def test_a_routers_prefill_in_flight_reaches_the_others_as_it_stood_the_sync_delay_ago() -> None:
    from simulator.replay.replayer import _IndexSync

    a = EndpointId("10.0.0.1:8000")
    counters = [_Counter(), _Counter()]
    sync = _IndexSync([_Index(), _Index()], 0.02, counters)  # type: ignore[list-item]
    counters[0].own[a] = 1500.0  # router 0 picks a for a 1,500-token prefill at t = 0
    sync.note(0, 0.0)
    sync.deliver(1, 0.01)
    assert counters[1].peers(a) == 0.0  # not there yet
    sync.deliver(1, 0.03)
    assert counters[1].peers(a) == 1500.0
    counters[0].own.clear()  # its first token came at 0.05
    sync.note(0, 0.05)
    sync.deliver(1, 0.06)
    assert counters[1].peers(a) == 1500.0  # as it stood at 0.04
    sync.deliver(1, 0.08)
    assert counters[1].peers(a) == 0.0
    assert counters[0].peers(a) == 0.0  # a router's own figure is not its peers'


def test_sharing_the_prefill_in_flight_keeps_four_routers_off_each_others_queues() -> None:
    """RAG at 4/s with 4 routers (the sweep's point, one seed): index sync alone still lets the
    routers pile onto the replica holding a popular document; its prefill in flight, shared,
    brings the TTFT p90 down to about one router's."""
    import bench.bench_profiles as bp

    point = bp.Point("rag", 4, 4096, 4, routers=4)
    p90 = {}
    for prefill in (False, True):
        cfg = dataclasses.replace(bp.config_of(point, 0), sync_delay_s=0.02, sync_prefill=prefill)
        p90[prefill] = summarize(replay(bp.workload_of(point, True, 0), "epp", cfg)).ttft_p90_s
    assert p90[True] < 0.9 * p90[False], p90
