from __future__ import annotations

import argparse

import pytest

from epp.cli import build_parser, byte_size, main


@pytest.mark.parametrize(("text", "value"), [("8MiB", 8 << 20), ("512k", 512_000), ("1048576", 1 << 20), ("1.5KiB", 1536)])
def test_byte_size(text: str, value: int) -> None:
    assert byte_size(text) == value


def test_byte_size_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size("lots")


def test_serve_flags_and_defaults() -> None:
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000"])
    assert (args.grpc_port, args.health_port, args.metrics_port) == (9002, 9003, 9090)
    assert args.processing_mode == "full-duplex" and args.scrape_interval_s is None
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for flag in ("--grpc-port", "--health-port", "--metrics-port", "--config", "--endpoints", "--log-level",
                 "--cert", "--key", "--processing-mode", "--scrape-interval-s", "--fallbacks", "--max-body-bytes"):
        assert flag in help_text


def test_the_scrape_period_is_the_flag_else_the_configs() -> None:
    from epp.cli.serve_endpoints import scrape_options
    from epp.config.loader import shipped_config

    def period(argv: list[str], config: str) -> float:
        args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000", *argv])
        return scrape_options(args, shipped_config(config)).interval_s

    assert period([], "default") == 0.2 and period([], "predicted-ttft") == 1.0
    assert period(["--scrape-interval-s", "0.5"], "predicted-ttft") == 0.5


def test_no_endpoints_is_a_startup_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--grpc-port", "0", "--health-port", "-1", "--metrics-port", "-1"]) == 2
    assert "--endpoints" in capsys.readouterr().err


def test_bad_config_names_the_field(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import yaml

    from epp.config.loader import default_config

    raw = dict(default_config().raw)
    raw["requestControl"] = {"fallbacks": "two"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["serve", "--config", str(path), "--endpoints", "10.0.0.1:8000"]) == 2
    assert "requestControl.fallbacks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--grpc-port", "abc", "'abc' is not a port 1-65535"),
        ("--fallbacks", "-1", "must be >= 0"),
        ("--scrape-interval-s", "0", "must be > 0"),
        ("--scrape-timeout-s", "-1", "must be > 0"),
        ("--grace-s", "-1", "must be >= 0"),
        ("--shutdown-delay-s", "soon", "'soon' is not a number"),
        ("--max-body-bytes", "-5", "at least 1 byte"),
        ("--metrics-path", "metrics", "must start with /"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and message in err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--cert", __file__], "--key"),
        (["--key", __file__], "--cert"),
        (["--cert", "/nonexistent/cert.pem", "--key", __file__], "--cert"),
    ],
)
def test_tls_files_are_checked_at_startup(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ports = ["--grpc-port", "0", "--health-port", "-1", "--metrics-port", "-1"]
    assert main(["serve", "--endpoints", "10.0.0.1:8000", *ports, *argv]) == 2
    assert f"config field {field!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--grpc-port", "--health-port", "--metrics-port"])
def test_port_in_use_is_a_clear_startup_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"--grpc-port": "0", "--health-port": "0", "--metrics-port": "0", flag: str(port)}
        argv = ["serve", "--host", "127.0.0.1", "--endpoints", "10.0.0.1:8000", "--no-scrape"]
        assert main([*argv, *(x for kv in ports.items() for x in kv)]) == 1
    err = capsys.readouterr().err
    assert f"epp: cannot start: cannot listen on 127.0.0.1:{port} ({flag})" in err
    assert "Traceback" not in err


def test_a_cert_that_is_not_pem_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    pem = tmp_path / "bad.pem"
    pem.write_text("not a certificate\n")
    ports = ["--grpc-port", "0", "--health-port", "-1", "--metrics-port", "-1", "--no-scrape"]
    argv = ["serve", "--host", "127.0.0.1", "--endpoints", "10.0.0.1:8000", *ports]
    assert main([*argv, "--cert", str(pem), "--key", str(pem)]) == 1
    assert "--cert/--key are not a PEM certificate" in capsys.readouterr().err
