"""What epp's config asks of the Envoy in front of it (``epp.envoyconfig.EppNeeds``), how
``epp envoy-config`` derives those settings, refuses contradictions and checks a bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epp.cli import build_parser, envoy_bootstrap, main
from epp.config.loader import default_config, loads_config
from epp.envoyconfig import EnvoyOptions, mismatches, needs_from_config, options_of_bootstrap


@pytest.mark.parametrize(
    ("config", "timeout", "source"),
    [
        ("{}", 5, ""),  # flow control off: the bootstrap's old default
        ("flowControl: {enabled: true}", 35, "flowControl.maxQueueSeconds"),
        ("flowControl: {enabled: true, maxQueueSeconds: 12}", 17, "flowControl.maxQueueSeconds"),
        ("flowControl: {enabled: true, bandMaxQueueSeconds: {100: 60}}", 65,
         "flowControl.bandMaxQueueSeconds.100"),
        ("flowControl: {enabled: true, objectiveMaxQueueSeconds: {premium: 90}}", 95,
         "flowControl.objectiveMaxQueueSeconds.premium"),
        ("flowControl: {enabled: true, maxQueueSeconds: 10, scaleFromZeroSeconds: 600}", 605,
         "flowControl.scaleFromZeroSeconds"),
    ],
)  # fmt: skip
def test_the_message_timeout_covers_the_longest_hold_of_the_config(
    config: str, timeout: int, source: str
) -> None:
    needs = needs_from_config(loads_config(config))
    assert needs.message_timeout_s == timeout and needs.hold_from == source
    assert needs.stream_idle_timeout_s >= max(300, timeout)


def test_precise_keying_adds_to_epps_own_work_in_proportion_to_the_body_cap() -> None:
    from epp.config.loader import shipped_config

    raw = dict(default_config().raw)
    raw["plugins"] = [*raw["plugins"], {"type": "precise-prefix-cache-producer"}]
    cfg = loads_config(yaml.safe_dump(raw))
    small = needs_from_config(cfg, max_body_bytes=1 << 20)
    large = needs_from_config(cfg, max_body_bytes=8 << 20)
    assert "precise-prefix-cache-producer preparing" in large.work_from
    assert needs_from_config(shipped_config("default")).work_s == 5.0
    assert 5.0 < small.work_s < large.work_s  # ~1 s more per MiB of body cap


def test_each_contradiction_is_named_and_the_fail_open_bypass_is_a_warning() -> None:
    needs = needs_from_config(loads_config("flowControl: {enabled: true, maxQueueSeconds: 12}"))
    bad = EnvoyOptions(message_timeout_s=5, stream_idle_timeout_s=10, max_request_bytes=64 << 20)
    found = {str(m).split(" ", 1)[0]: m.fatal for m in mismatches(bad, needs)}
    assert found == {"--message-timeout-s": True, "--stream-idle-timeout-s": True,
                     "--max-request-bytes": True, "--failure": False}  # fmt: skip
    assert mismatches(EnvoyOptions(routing="random"), needs) == []  # no epp in the path


def test_envoy_config_derives_refuses_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text("flowControl: {enabled: true, maxQueueSeconds: 12}\n")
    args = ["envoy-config", "--pool", "10.0.0.1:8000", "--config", str(config)]
    out = envoy_bootstrap(build_parser().parse_args(args))
    derived = options_of_bootstrap(yaml.safe_load(out.yaml))
    assert derived.message_timeout_s == 17 and derived.stream_idle_timeout_s == 300
    assert derived.max_request_bytes == 8 << 20
    assert main([*args]) == 0
    assert "warning: --failure open" in capsys.readouterr().err
    assert main([*args, "--message-timeout-s", "5"]) == 2
    assert "flowControl.maxQueueSeconds" in capsys.readouterr().err
    assert main([*args, "--message-timeout-s", "20"]) == 0  # above the need: the user's choice
    path = tmp_path / "envoy.yaml"
    path.write_text(out.yaml)
    assert main(["envoy-config", "--check", str(path), "--config", str(config)]) == 0
    assert main(["envoy-config", "--check", str(path)]) == 0  # looser config: still agrees
    assert main(["envoy-config", "--check", str(config)]) == 2  # not a bootstrap
    assert "no listener" in capsys.readouterr().err
