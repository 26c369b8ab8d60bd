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
    assert args.processing_mode == "full-duplex" and args.scrape_interval_s == 0.05
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for flag in ("--grpc-port", "--health-port", "--metrics-port", "--config", "--endpoints", "--log-level",
                 "--cert", "--key", "--processing-mode", "--scrape-interval-s", "--fallbacks", "--max-body-bytes"):
        assert flag in help_text


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
