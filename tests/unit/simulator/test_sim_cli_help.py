from __future__ import annotations

import argparse

import pytest

from simulator.cli import build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["emulate", "gateway", "stack", "replay"])
def test_help_explains_every_flag_once(command: str) -> None:
    parser = _subparsers()[command]
    text = " ".join(parser.format_help().split())
    assert "(default: None)" not in text and "(default: )" not in text
    assert "(default: False)" not in text and "(default: [])" not in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help, f"epp-sim {command} {action.option_strings} has no help"
        help_text = formatter._get_help_string(action)  # type: ignore[attr-defined]
        assert help_text.count("default:") <= 1, f"{action.option_strings}: {help_text}"


def test_log_level_is_checked() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "loud", "replay"])
    assert build_parser().parse_args(["--log-level", "INFO", "replay"]).log_level == "info"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routing-nice", "5"], "needs --engine vllm"),
        (["--routing-nice", "25", "--engine", "vllm"], "must be 1-19"),
        (["--lora-adapters", "a,b", "--engine", "vllm"], "are for emulated servers"),
        (["--max-loras", "0"], "--max-loras must be at least 1"),
    ],
)
def test_routing_nice_is_checked_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["stack", *argv])
    assert args.run(args) == 2
    assert message in capsys.readouterr().err
