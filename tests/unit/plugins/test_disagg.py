"""Prefill/decode disaggregation plugins (epp/plugins/disagg): roles, deciders and the
profile handler, driven through the scheduler the shipped ``pd`` profile builds."""

from __future__ import annotations

import asyncio
import logging
import random
from types import MappingProxyType

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from epp.config.loader import loads_config, shipped_config
from epp.errors import ConfigError
from epp.framework.endpoint import ROLE_LABEL, Endpoint, EndpointId, Metrics
from epp.framework.interfaces import PluginContext
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PrefixMatch, ResponseInfo
from epp.plugins.disagg import (
    CacheAwareDecider,
    CacheAwareDeciderParams,
    DisaggProfileHandler,
    LoadAwareDecider,
    stages,
)
from epp.plugins.disagg.roles import DecodeFilter, PrefillFilter, RoleFilterParams
from epp.wiring import build_scheduler

LONG = "The quick brown fox jumps over the lazy dog near the riverbank. " * 40  # ~640 tokens
SHORT = "hello there"


def ep(n: int, role: str | None) -> Endpoint:
    labels = MappingProxyType({ROLE_LABEL: role} if role else {})
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000, labels=labels,
                    metrics=Metrics(scraped_at_s=1.0))  # fmt: skip


def request(prompt: str, rid: str = "r") -> InferenceRequest:
    return InferenceRequest(rid, "m", prompt)


def test_roles_follow_llm_d_labels() -> None:
    assert stages("prefill") == {"prefill"}
    assert stages("decode") == {"decode"}
    assert stages("both") == stages("prefill-decode") == stages(None) == {"prefill", "decode"}
    assert stages("encode-prefill") == {"prefill"}
    assert stages("encode") == set()
    eps = [ep(1, "prefill"), ep(2, "decode"), ep(3, None), ep(4, "both")]
    state = CycleState(request(SHORT), 0.0, random.Random(1))
    keep_prefill = PrefillFilter("p", RoleFilterParams()).filter(state, eps)
    keep_decode = DecodeFilter("d", RoleFilterParams()).filter(state, eps)
    assert [e.id for e in keep_prefill] == ["10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000"]
    assert [e.id for e in keep_decode] == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]
    custom = PrefillFilter("p", RoleFilterParams(label="role"))
    labelled = Endpoint(EndpointId("10.0.0.9:8000"), "10.0.0.9", 8000,
                        labels=MappingProxyType({"role": "decode"}))  # fmt: skip
    assert custom.filter(state, [labelled]) == []


def test_pd_profile_splits_long_uncached_prompts_and_keeps_short_ones_local() -> None:
    sched = build_scheduler(shipped_config("pd"), random.Random(3))
    handler = sched.handler
    assert isinstance(handler, DisaggProfileHandler)
    pool = [ep(1, "prefill"), ep(2, "decode"), ep(3, "decode")]

    short = sched.schedule(request(SHORT, "a"), pool, 1.0)
    assert short.target.id in ("10.0.0.2:8000", "10.0.0.3:8000")
    assert short.prefill == () and short.decision == "local"

    long = sched.schedule(request(LONG, "b"), pool, 2.0)
    assert long.target.id in ("10.0.0.2:8000", "10.0.0.3:8000")  # decoders only
    assert long.prefiller is not None and long.prefiller.id == "10.0.0.1:8000"
    assert long.decision == "split"

    # the index recorded the prompt on the decoder too: sent again, it stays local there
    again = sched.schedule(request(LONG, "c"), pool, 3.0)
    assert again.target.id == long.target.id
    assert again.decision == "local" and again.prefill == ()
    assert handler.decisions["split"] == 1 and handler.decisions["local"] == 2


def test_no_ready_prefiller_is_served_by_the_decoder_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = build_scheduler(shipped_config("pd"), random.Random(3))
    with caplog.at_level(logging.WARNING):
        result = sched.schedule(request(LONG), [ep(2, "decode")], 1.0)
    assert result.target.id == "10.0.0.2:8000" and result.prefill == ()
    assert result.decision == "no-prefiller"
    assert "no ready prefiller" in caplog.text
    assert isinstance(sched.handler, DisaggProfileHandler)
    assert sched.handler.decisions["no-prefiller"] == 1


def test_a_prefill_decode_endpoint_picked_for_both_is_not_split() -> None:
    sched = build_scheduler(shipped_config("pd"), random.Random(3))
    result = sched.schedule(request(LONG), [ep(4, "prefill-decode")], 1.0)
    assert result.prefill == () and result.decision == "same-endpoint"


def test_cache_aware_decider_keeps_local_what_the_prefiller_would_recompute() -> None:
    decider = CacheAwareDecider("c", CacheAwareDeciderParams(non_cached_tokens=100))
    decoder, prefiller = ep(2, "decode"), ep(1, "prefill")
    state = CycleState(request(LONG), 0.0, random.Random(1))
    hashes = list(range(len(LONG) // 64))
    # the decoder holds half the prompt, the prefiller none: a split would recompute it
    state.prefix = PrefixMatch(hashes, {decoder.id: len(hashes) // 2})
    assert decider.split(state, decoder)  # ~320 tokens uncached on the decoder
    assert not decider.confirm(state, decoder, prefiller)
    state.prefix = PrefixMatch(hashes, {decoder.id: len(hashes) // 2, prefiller.id: len(hashes) // 2})
    assert decider.confirm(state, decoder, prefiller)


def test_load_aware_decider_stops_splitting_while_the_prefiller_is_behind() -> None:
    from epp.datastore.store import Datastore
    from epp.observability.metrics import EppMetrics
    from epp.requestcontrol.director import Director

    text = shipped_config("pd").raw
    assert any(p["type"] == "load-aware-pd-decider" for p in text["plugins"])  # the shipped one
    cfg = loads_config(yaml.safe_dump(text).replace("slackTokens: 32768", "slackTokens: 1000"))
    sched = build_scheduler(cfg, random.Random(3))
    assert any(isinstance(p, LoadAwareDecider) for p in sched.plugins)
    store = Datastore(stale_after_s=60.0)
    for e in (ep(1, "prefill"), ep(2, "decode")):
        store.upsert(e)
        store.update_metrics(e.id, e.metrics)
    d = Director(store, sched, cfg.saturation, EppMetrics(CollectorRegistry()), clock=lambda: 1.0)
    waiting = store.prefill  # the Director's prefill accounting, which the decider reads
    prompts = [f"{i} {LONG}" for i in range(5)]  # ~640 tokens each, sharing nothing at the start
    first = d.route(request(prompts[0], "a"), None)
    second = d.route(request(prompts[1], "b"), None)
    assert first.result.decision == second.result.decision == "split"
    assert waiting.get(EndpointId("10.0.0.1:8000")) == pytest.approx(2 * len(prompts[0]), rel=0.01)
    # the prefiller is now ~1,280 tokens behind the decoder: a third would wait past the slack
    third = d.route(request(prompts[2], "c"), None)
    assert third.result.decision == "local" and third.result.prefill == ()
    assert waiting.get(EndpointId("10.0.0.2:8000")) > 0  # prefilled on the decoder
    # the first two get their first tokens: the prefiller caught up, splitting resumes
    d.first_token(first, 0.5)
    d.finish(second, ResponseInfo(200))
    d.first_token(third, 0.5)
    assert len(waiting) == 0
    assert d.route(request(prompts[3], "d"), None).result.decision == "split"


def test_decisions_are_exported() -> None:
    sched = build_scheduler(shipped_config("pd"), random.Random(3))
    sched.schedule(request(LONG), [ep(1, "prefill"), ep(2, "decode")], 1.0)
    registry = CollectorRegistry()
    handler = sched.handler
    assert isinstance(handler, DisaggProfileHandler)
    assert any(p is handler for p in sched.lifecycle)  # the server starts it: metrics registered
    ctx = PluginContext(spawn=lambda *_: None, register=registry.register,  # type: ignore[arg-type]
                        on_failure=lambda _k: None)  # fmt: skip
    asyncio.run(handler.start(ctx))
    text = generate_latest(registry).decode()
    assert 'epp_pd_decisions_total{decision="split"} 1.0' in text
    assert 'epp_pd_decisions_total{decision="local"} 0.0' in text


PD_HEAD = """
plugins:
- type: decode-filter
- type: prefill-filter
- type: max-score-picker
- type: prefix-based-pd-decider
"""


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (PD_HEAD + """
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]}
""", "schedulingProfiles", "need a profile handler"),
        (PD_HEAD + """
- type: disagg-profile-handler
  parameters: {profiles: {decode: decode, prefill: prefil}, deciders: {prefill: prefix-based-pd-decider}}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]}
""", "disagg-profile-handler", "names profile 'prefil'"),
        (PD_HEAD + """
- type: disagg-profile-handler
  parameters: {deciders: {prefill: nope}}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]}
""", "disagg-profile-handler", "names decider 'nope'"),
        (PD_HEAD + """
- type: disagg-profile-handler
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: prefix-based-pd-decider}, {pluginRef: max-score-picker}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}]}
""", "schedulingProfiles[0].plugins[0].pluginRef", "is a decider"),
        (PD_HEAD + """
- type: disagg-profile-handler
  parameters: {profiles: {decode: decode, encode: e}}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}]}
""", "profiles", "expected the stages decode and prefill"),
    ],
)
def test_bad_pd_configs_name_the_field(text: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads_config(text)
    assert field in str(err.value) and message in str(err.value)


def test_static_endpoints_carry_their_role() -> None:
    cfg = loads_config("""
staticEndpoints:
- {address: 10.0.0.1, port: 8000, role: prefill}
- {address: 10.0.0.2, port: 8000, role: decode}
- 10.0.0.3:8000
""")
    roles = [e.labels.get(ROLE_LABEL) for e in cfg.static_endpoints]
    assert roles == ["prefill", "decode", None]
    with pytest.raises(ConfigError, match="role"):
        loads_config("staticEndpoints:\n- {address: 10.0.0.1, port: 8000, role: prefil}\n")
