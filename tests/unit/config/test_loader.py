from __future__ import annotations

from pathlib import Path

import pytest

from epp.config.loader import (
    SHIPPED,
    EppConfig,
    default_config,
    load_config,
    loads_config,
    shipped_config,
)
from epp.errors import ConfigError
from epp.plugins.approxprefix import PrefixIndexConfig

BASE = """
plugins:
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: p
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


def approx(cfg: EppConfig) -> PrefixIndexConfig:
    """The approximate producer's parameters (the prefixIndex section, or its own)."""
    params = cfg.plugins["approx-prefix-cache-producer"].params
    assert isinstance(params, PrefixIndexConfig)
    return params


def test_shipped_configs_load() -> None:
    d = default_config()
    assert d.profile.scorers == (
        ("predicted-ttft-scorer", 8.0), ("prefix-cache-scorer", 3.0), ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0), ("prefix-home-scorer", 0.25),
    )
    assert d.plugins["predicted-ttft-scorer"].params.session_spread_seconds == 0.2
    assert shipped_config("predicted-blend").profile.scorers == d.profile.scorers[:4]
    assert shipped_config("prefix-load").profile.scorers == d.profile.scorers[1:4]
    assert d.profile.picker == "max-score-picker"
    # the agentic profile is the default with token load, whatever the default weighs
    agentic = shipped_config("agentic")
    assert agentic.profile.scorers == (*d.profile.scorers, ("token-load-scorer", 1.0))
    assert agentic.plugins["predicted-ttft-scorer"].params == d.plugins["predicted-ttft-scorer"].params
    fc = shipped_config("filter-chain")
    assert fc.profile.filters == ("lora-affinity-filter", "load-threshold-filter", "longest-prefix-filter")


def test_defaults_and_camel_case_parameters() -> None:
    cfg = loads_config(BASE + "prefixIndex: {blockChars: 32, ttlSeconds: 60}\n")
    assert approx(cfg).block_chars == 32 and approx(cfg).ttl_seconds == 60.0
    assert approx(cfg).capacity_per_endpoint_chunks == 31_250
    assert cfg.saturation.queue_threshold == 5 and cfg.saturation.kv_cache_threshold == 0.8


@pytest.mark.parametrize(
    "text,field",
    [
        ("plugins: []", "plugins"),
        (BASE.replace("prefix-cache-scorer\n-", "prefix-cache-scorr\n-"), "plugins[0].type"),
        (BASE.replace("- type: max-score-picker", "- type: max-score-picker\n  parameters: {x: 1}"),
         "plugins[1].parameters.x"),
        (BASE.replace("weight: 3", "weight: heavy"), "schedulingProfiles[0].plugins[0].weight"),
        (BASE.replace("- pluginRef: max-score-picker", "- pluginRef: nope"),
         "schedulingProfiles[0].plugins[1].pluginRef"),
        (BASE.replace("  - pluginRef: max-score-picker\n", ""), "schedulingProfiles[0].plugins"),
        (BASE + "prefixIndex: {blockChars: 0}\n", "prefixIndex.blockChars"),
        (BASE + "prefixIndex: {ttlSeconds: -1}\n", "prefixIndex.ttlSeconds"),
        (BASE + "saturation: {queueThreshold: 2.5}\n", "saturation.queueThreshold"),
        (BASE.replace("- type: prefix-cache-scorer",
                      "- type: prefix-cache-scorer\n  parameters: {minMatchChunks: true}"),
         "plugins[0].parameters.minMatchChunks"),
        (BASE.replace("- type: max-score-picker",
                      "- type: bounded-load-filter\n  parameters: {loadFactor: 0.9}\n"
                      "- type: max-score-picker"),
         "plugins[1].parameters.loadFactor"),
        (BASE.replace("- type: max-score-picker",
                      "- type: kv-cache-utilization-scorer\n  parameters: {freeBelow: 1.0}\n"
                      "- type: max-score-picker"),
         "plugins[1].parameters.freeBelow"),
        (BASE.replace("- type: max-score-picker",
                      "- type: queue-scorer\n  parameters: {heldMatchRatio: 1.5}\n"
                      "- type: max-score-picker"),
         "plugins[1].parameters.heldMatchRatio"),
        (BASE.replace("- type: max-score-picker",
                      "- type: queue-scorer\n  parameters: {fullAtWaiting: -1}\n"
                      "- type: max-score-picker"),
         "plugins[1].parameters.fullAtWaiting"),
        ("kind: Other\n" + BASE, "kind"),
        ("plugins: [", "<yaml>"),
    ],
)
def test_bad_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads_config(text)
    assert err.value.field == field
    assert field in str(err.value)


def test_the_scraping_section_sets_the_period_a_profile_wants() -> None:
    assert default_config().scraping.interval_seconds == 0.2
    assert shipped_config("predicted-ttft").scraping.interval_seconds == 1.0
    assert shipped_config("cache-aware").scraping.interval_seconds == 1.0
    assert loads_config(BASE + "scraping: {intervalSeconds: 0.5}\n").scraping.interval_seconds == 0.5
    for bad, says in (("0", "must be positive"), ("2", "not shorter than saturation"),
                      ("fast", "expected a number")):
        with pytest.raises(ConfigError) as err:
            loads_config(BASE + f"scraping: {{intervalSeconds: {bad}}}\n")
        assert err.value.field == "scraping.intervalSeconds" and says in str(err.value)
    # a longer staleness bound admits a longer period
    cfg = loads_config(BASE + "scraping: {intervalSeconds: 2}\nsaturation: {metricsStalenessSeconds: 5}\n")
    assert cfg.scraping.interval_seconds == 2.0
    # the share of a server's time scrapes may take
    assert (default_config().scraping.server_share, default_config().scraping.max_interval_seconds) == (0.02, 1.0)
    off = loads_config(BASE + "scraping: {serverShare: 0, maxIntervalSeconds: 3}\n").scraping
    assert (off.server_share, off.max_interval_seconds) == (0.0, 3.0)
    for bad, says in (("1", "must be in [0, 1)"), ("-0.1", "must not be negative")):
        with pytest.raises(ConfigError) as err:
            loads_config(BASE + f"scraping: {{serverShare: {bad}}}\n")
        assert err.value.field == "scraping.serverShare" and says in str(err.value)


def test_a_config_with_other_sections_only_keeps_the_default_profile() -> None:
    cfg = loads_config("requestControl: {fallbacks: 1}\nprefixIndex: {ttlSeconds: 30}\n")
    assert cfg.profile == default_config().profile
    assert approx(cfg).ttl_seconds == 30.0 and cfg.raw["requestControl"] == {"fallbacks": 1}
    with pytest.raises(ConfigError) as info:
        loads_config(BASE.split("schedulingProfiles:")[0].replace("plugins:", "x:") + "schedulingProfiles: []\n")
    assert info.value.field == "plugins"


def test_yaml_errors_name_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        loads_config("plugins: [\n", "my-epp.yaml")
    assert "my-epp.yaml" in str(info.value) and "<unicode string>" not in str(info.value)


def test_unknown_top_level_section_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = loads_config(BASE + "prefixIndx: {blockChars: 32}\nrequestControl: {fallbacks: 1}\n", "my.yaml")
    assert approx(cfg).block_chars == 64  # the misspelt section is not applied...
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "'prefixIndx'" in warnings[0] and "my.yaml" in warnings[0]


def test_prefix_producer_is_added_implicitly_with_the_prefix_index_section(caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    with caplog.at_level(logging.DEBUG):
        cfg = loads_config(
            "plugins: [{type: prefix-cache-scorer}, {type: max-score-picker}]\n"
            "schedulingProfiles: [{name: p, plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: max-score-picker}]}]\n"
            "prefixIndex: {blockChars: 32}\n"
        )
    assert cfg.producers == ("approx-prefix-cache-producer",)
    assert cfg.plugins["approx-prefix-cache-producer"].params.block_chars == 32
    added = [r for r in caplog.records if "which approx-prefix-cache-producer produces" in r.getMessage()]
    assert [r.levelname for r in added] == ["DEBUG"]


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_config_loads_without_a_line_at_info_or_above(name: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """Every start with a shipped profile logs nothing about the config that reads like a
    warning (the implicitly added producer is by design)."""
    import logging

    with caplog.at_level(logging.INFO, logger="epp.config"):
        shipped_config(name)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("epp.config")] == []


def test_explicit_producer_parameters_override_the_section_and_no_producer_when_none_reads() -> None:
    cfg = loads_config(
        "plugins:\n"
        "- {type: approx-prefix-cache-producer, name: idx, parameters: {ttlSeconds: 30}}\n"
        "- {type: prefix-cache-scorer}\n- {type: max-score-picker}\n"
        "schedulingProfiles: [{plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: max-score-picker}]}]\n"
        "prefixIndex: {blockChars: 128, ttlSeconds: 99}\n"
    )
    assert cfg.producers == ("idx",)
    params = cfg.plugins["idx"].params
    assert (params.block_chars, params.ttl_seconds) == (128, 30)
    plain = loads_config(
        "plugins: [{type: queue-scorer}, {type: random-picker}]\n"
        "schedulingProfiles: [{plugins: [{pluginRef: queue-scorer}, {pluginRef: random-picker}]}]\n"
    )
    assert plain.producers == ()


def test_a_producer_in_a_profile_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\].plugins\[0\].pluginRef.*producer"):
        loads_config(
            "plugins: [{type: approx-prefix-cache-producer}, {type: max-score-picker}]\n"
            "schedulingProfiles: [{plugins: [{pluginRef: approx-prefix-cache-producer}, {pluginRef: max-score-picker}]}]\n"
        )


def test_a_missing_config_name_lists_the_shipped_profiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as bare:
        load_config("predicted_ttft")  # a typo of a shipped name
    assert "shipped profile: default, prefix-load, predicted-blend, filter-chain, predicted-ttft" in str(bare.value)
    with pytest.raises(ConfigError) as path:
        load_config("my-epp.yaml")  # a file name: no profile list
    assert "cannot read my-epp.yaml" in str(path.value)
    assert "shipped profile" not in str(path.value)
