"""Bad numbers, ports and sizes, on the flags and in the config, stop start-up with an error
naming the flag or field (exit 2), never a traceback nor an Envoy bootstrap Envoy rejects."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.cli import build_parser, main
from epp.config.loader import loads_config
from epp.errors import ConfigError

SERVE = ["serve", "--endpoints", "10.0.0.1:8000"]
ENVOY = ["envoy-config", "--pool", "127.0.0.1:8000"]


@pytest.mark.parametrize(("argv", "words"), [
    ([*ENVOY, "--message-timeout-s", "nan"], "finite"),
    ([*ENVOY, "--message-timeout-s", "inf"], "finite"),
    ([*ENVOY, "--message-timeout-s", "1e12"], "<= 3600"),  # ext_proc's own limit
    ([*ENVOY, "--message-timeout-s", "3601"], "<= 3600"),
    ([*ENVOY, "--upstream-idle-timeout-s", "nan"], "finite"),
    ([*ENVOY, "--stream-idle-timeout-s", "1e40"], "<= 31536000"),
    ([*ENVOY, "--port", "-1"], "1-65535 (0 = any free port)"),
    ([*ENVOY, "--admin-port", "-1"], "1-65535 (0 = any free port)"),
    ([*ENVOY, "--port", "70000"], "1-65535 (0 = any free port)"),
    ([*ENVOY, "--max-body-bytes", "100GiB"], "at most 1072693248 (1023MiB"),
    ([*SERVE, "--max-body-bytes", "100GiB"], "at most 1072693248 (1023MiB"),  # was a traceback
    (["model-router", "--max-body-bytes", "2GiB"], "at most 1072693248 (1023MiB"),
    ([*ENVOY, "--max-request-bytes", "5GiB"], "uint32"),
    ([*ENVOY, "--max-body-bytes", "1e400"], "not a finite size"),
    ([*SERVE, "--scrape-interval-s", "nan"], "finite"),
    ([*SERVE, "--shutdown-delay-s", "nan"], "finite"),
    ([*SERVE, "--shutdown-delay-s", "inf"], "finite"),  # SIGTERM would never stop it
    ([*SERVE, "--response-observer-wait-s", "nan"], "finite"),
    ([*SERVE, "--scrape-timeout-s", "inf"], "finite"),
    ([*SERVE, "--sync-flush-ms", "nan"], "finite"),
    ([*SERVE, "--peer-dns-interval-s", "-1"], "> 0"),
    ([*SERVE, "--sync-batch-records", "0"], ">= 1"),
    ([*SERVE, "--grpc-port", "-1"], "1-65535 (0 = any free port)"),
    ([*SERVE, "--sync-port", "-1"], "1-65535 (0 = any free port)"),
    ([*SERVE, "--health-port", "-2"], "(0 = any free port, -1 = off)"),
    (["pd-sidecar", "--prefill-timeout-s", "nan"], "finite"),
    (["model-router", "--models-refresh-s", "inf"], "finite"),
])  # fmt: skip
def test_a_bad_flag_exits_2_naming_the_flag_and_what_it_takes(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    assert done.value.code == 2
    flag = next(a for a in reversed(argv) if a.startswith("--"))
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and words in err, err


def test_the_ports_each_flag_documents_are_accepted() -> None:
    args = build_parser().parse_args([*SERVE, "--grpc-port", "0", "--health-port", "-1",
                                      "--metrics-port", "-1", "--sync-port", "0"])  # fmt: skip
    assert (args.grpc_port, args.health_port, args.metrics_port, args.sync_port) == (0, -1, -1, 0)
    args = build_parser().parse_args([*ENVOY, "--port", "0", "--admin-port", "65535"])
    assert (args.port, args.admin_port) == (0, 65535)


@pytest.mark.parametrize(("section", "field"), [
    ("flowControl: {enabled: true, maxQueueSeconds: .inf}", "flowControl.maxQueueSeconds"),
    ("flowControl: {enabled: true, maxQueueSeconds: .nan}", "flowControl.maxQueueSeconds"),
    ("flowControl: {enabled: true, scaleFromZeroSeconds: .inf}", "flowControl.scaleFromZeroSeconds"),
    ("flowControl: {bandMaxQueueSeconds: {1: .nan}}", "flowControl.bandMaxQueueSeconds"),
    ("saturation: {metricsStalenessSeconds: .inf}", "saturation.metricsStalenessSeconds"),
    ("scraping: {intervalSeconds: .nan}", "scraping.intervalSeconds"),
    ("prefixIndex: {ttlSeconds: .inf}", "prefixIndex.ttlSeconds"),
    ("flowControl: {maxQueueSeconds: 1e12}", "flowControl.maxQueueSeconds"),  # past a year
])  # fmt: skip
def test_every_float_of_the_config_refuses_nan_and_inf_naming_the_field(section: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads_config(section)
    assert err.value.field.startswith(field), err.value


def test_a_nan_weight_is_refused() -> None:
    doc = """
plugins: [{type: queue-scorer}, {type: max-score-picker}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: queue-scorer, weight: .nan},
                                              {pluginRef: max-score-picker}]}]
"""
    with pytest.raises(ConfigError, match="finite"):
        loads_config(doc)


@pytest.mark.parametrize("command", [[*SERVE], ["envoy-config", "--pool", "127.0.0.1:8000"]])
def test_an_infinite_queue_wait_stops_start_up_with_exit_2(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("flowControl: {enabled: true, maxQueueSeconds: .inf}\n")
    assert main([*command, "--config", str(config)]) == 2
    assert "flowControl.maxQueueSeconds" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "size"), [("64MiB", 64 << 20), ("512k", 512_000), (1048576, 1 << 20),
                                            ("1048576", 1 << 20), ("1.5KiB", 1536)])  # fmt: skip
def test_config_sizes_take_the_units_the_flags_take(text: object, size: int) -> None:
    assert loads_config(f"requestControl: {{maxBodyBytes: {text}}}").request_control.max_body_bytes == size
    assert loads_config(f"flowControl: {{maxBytes: {text}}}").flow_control.max_bytes == size


@pytest.mark.parametrize("text", ["lots", "0", "-5MiB", "1e400", "true", "100GiB"])
def test_a_bad_config_size_names_the_field(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        loads_config(f"requestControl: {{maxBodyBytes: {text}}}")
    assert err.value.field == "requestControl.maxBodyBytes"
