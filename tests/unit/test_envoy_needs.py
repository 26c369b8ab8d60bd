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


def test_check_flags_a_route_idle_timeout_below_300_s_with_the_default_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA3 item 8: only a config whose queue outlasted the idle timeout was flagged."""
    out = envoy_bootstrap(build_parser().parse_args(["envoy-config", "--pool", "10.0.0.1:8000"]))
    path = tmp_path / "envoy.yaml"
    path.write_text(out.yaml.replace("idle_timeout: 300s", "idle_timeout: 10s"))
    assert main(["envoy-config", "--check", str(path)]) == 0  # a warning, not a contradiction
    err = capsys.readouterr().err
    assert "warning: --stream-idle-timeout-s 10 (route idle_timeout)" in err
    assert "at least 300" in err


@pytest.mark.parametrize(("text", "words"), [
    ("foo: [\n", "not valid YAML: expected the node content"),
    ("a: 1\n", "no listener with an envoy.filters.http.ext_proc filter"),
    ("- 1\n- 2\n", "not an Envoy bootstrap"),
])  # fmt: skip
def test_check_of_a_file_that_is_no_bootstrap_is_one_line_and_exit_2(
    text: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["envoy-config", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--check {path}: " in err and words in err, err


def test_bare_envoy_config_prints_a_fail_closed_bootstrap_that_says_how_to_fail_open(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """QA3 item 10: fail-open was the default even without the --pool it needs."""
    assert main(["envoy-config"]) == 0
    out = capsys.readouterr().out
    assert "# Fail-closed: no --pool was given" in out and "Give --pool HOST:PORT" in out
    assert options_of_bootstrap(yaml.safe_load(out)).failure == "closed"
    assert main(["envoy-config", "--pool", "10.0.0.1:8000"]) == 0  # with --pool: fail-open
    assert options_of_bootstrap(yaml.safe_load(capsys.readouterr().out)).failure == "open"
    assert main(["envoy-config", "--failure", "open"]) == 2  # asked for, without a pool
    assert "failing open needs the pool's servers" in capsys.readouterr().err


def test_several_pools_read_responses_full_duplex_and_refuse_the_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The summary's access log would reach one epp: with several pools each pool's epp reads
    its responses (the default there), and asking for the summary is refused, not ignored."""
    pools = ["--pool", "chat=m1@10.0.0.11:8000", "--pool", "coder=m2@10.0.0.21:8000",
             "--epp", "chat=127.0.0.1:9002", "--epp", "coder=127.0.0.1:9012"]  # fmt: skip
    assert main(["envoy-config", *pools]) == 0
    out = capsys.readouterr().out
    assert "FULL_DUPLEX_STREAMED" in out and "http_grpc" not in out
    assert main(["envoy-config", *pools, "--response", "summary"]) == 2
    assert "--response summary works with one pool" in capsys.readouterr().err
    assert main(["envoy-config", "--pool", "10.0.0.1:8000"]) == 0  # one pool: the summary
    assert "http_grpc" in capsys.readouterr().out


@pytest.mark.parametrize(("config", "words"), [
    ("requestControl: {maxBodyBytes: 100GiB}", "requestControl.maxBodyBytes': must be <= 1072693248"),
    ("flowControl: {enabled: true, maxQueueSeconds: 4000}", "at most 3600 s"),
])  # fmt: skip
def test_a_config_envoy_cannot_follow_is_refused_naming_envoys_limit(
    config: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(config + "\n")
    assert main(["envoy-config", "--pool", "10.0.0.1:8000", "--config", str(path)]) == 2
    assert words in capsys.readouterr().err
