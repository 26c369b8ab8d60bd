"""Disaggregated serving in the engine and the replay: loading a prefill's KV, splitting a
request across a prefiller and a decoder, and the decider's choice."""

from __future__ import annotations

import pytest

from simulator.model.cache import PrefixCache
from simulator.model.cost import CostModel
from simulator.model.engine import Engine, EngineRequest
from simulator.replay.policies import pd_config, policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer, pd_roles
from simulator.replay.report import summarize
from tests.unit.simulator.test_replay import ListWorkload, req


def run(workload: ListWorkload, decider: str, roles: tuple[str, ...], **params: int):  # type: ignore[no-untyped-def]
    cfg = pd_config(decider, dict(params))
    name, factory = policy_factory("epp", cfg)  # type: ignore[arg-type]
    replayer = Replayer(ReplayConfig(replicas=len(roles), kv_blocks=2048, roles=roles))
    return replayer, replayer.run(workload, factory, name)


def test_engine_loads_external_tokens_instead_of_computing_them() -> None:
    cost = CostModel()
    hashes = list(range(1, 33))  # 32 full blocks of 16 tokens
    plain = Engine(PrefixCache(256, 16), cost)
    plain.submit(EngineRequest("a", 512, hashes, 4), 0.0)
    loaded = Engine(PrefixCache(256, 16), cost)
    loaded.submit(EngineRequest("a", 512, hashes, 4, external_tokens=512), 0.0)

    def first(e: Engine) -> tuple[float, int]:
        while (t := e.next_event_time()) is not None:
            for f in e.advance(t).first_tokens:
                return f.time_s, f.cached_tokens
        raise AssertionError

    t_plain, c_plain = first(plain)
    t_loaded, c_loaded = first(loaded)
    assert c_plain == 0 and c_loaded == 496  # the last block holds the last token: computed
    assert t_loaded == pytest.approx(cost.prefill_s(16, 496) + cost.decode_step_s(1))
    assert t_plain == pytest.approx(cost.prefill_s(512, 0) + cost.decode_step_s(1))
    assert (loaded.external_queries_tokens, loaded.external_hits_tokens) == (512, 496)
    assert (plain.external_queries_tokens, plain.external_hits_tokens) == (0, 0)


def test_always_split_prefills_on_the_prefiller_and_decodes_on_the_decoder() -> None:
    work = ListWorkload([req(i, 0.2 * i, prefix=i % 3, tokens=1024, out=20) for i in range(12)])
    replayer, result = run(work, "always-disagg-pd-decider", pd_roles("1:1"))
    cost = replayer.config.cost
    for o in result.outcomes:
        assert (o.prefiller, o.replica, o.finished_count) == (0, 1, 1)
        # the decoder starts once the prefill ended and its KV arrived
        assert o.first_token_s >= o.prefill_done_s + cost.kv_transfer_s(1024) - 1e-9
        assert o.finish_s > o.first_token_s
    prefiller, decoder = replayer.engines
    assert prefiller.completed == decoder.completed == 12
    # the decoder loaded every prompt's full blocks it lacked (a shared prefix stays cached)
    assert decoder.external_hits_tokens > 0
    assert prefiller.external_hits_tokens == 0
    s = summarize(result)
    assert s.split_share == 1.0 and s.tpot_p50_s > 0


def test_never_split_serves_on_the_decoder_alone() -> None:
    work = ListWorkload([req(i, 0.2 * i, prefix=0, tokens=1024, out=20) for i in range(8)])
    replayer, result = run(work, "never-disagg-pd-decider", pd_roles("1:1"))
    assert all(o.prefiller == -1 and o.replica == 1 for o in result.outcomes)
    assert replayer.engines[0].completed == 0
    assert summarize(result).split_share == 0.0


def test_threshold_decider_splits_long_uncached_prompts_only() -> None:
    # one long cold prompt, then short turns sharing it: only the cold one is worth a split
    work = ListWorkload([req(0, 0.0, prefix=7, tokens=2048, out=8)]
                        + [req(i, 1.0 + 0.5 * i, prefix=7, tokens=2048, out=8) for i in range(1, 6)])  # fmt: skip
    _, result = run(work, "prefix-based-pd-decider", pd_roles("1:2"), nonCachedTokens=1500)
    split = [o.request_id for o in result.outcomes if o.prefiller >= 0]
    assert split == ["r0"]


def test_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="P:D"):
        pd_roles("2")
    with pytest.raises(ValueError, match="P:D"):
        pd_roles("0:4")
    with pytest.raises(ValueError, match="roles for"):
        ReplayConfig(replicas=3, roles=pd_roles("1:1"))
    with pytest.raises(ValueError, match="unknown role"):
        ReplayConfig(replicas=1, roles=("prefiller",))
    name, factory = policy_factory("least-load")
    with pytest.raises(ValueError, match="does not read endpoint roles"):
        Replayer(ReplayConfig(replicas=2, roles=pd_roles("1:1"))).run(
            ListWorkload([req(0, 0.0, 0)]), factory, name
        )
