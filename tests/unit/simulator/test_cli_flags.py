"""One name per setting across the epp-sim commands; the old spellings still parse, with a
note naming the new one."""

from __future__ import annotations

import pytest

from simulator.cli import build_parser

CASES = [
    (["emulate", "--num-gpu-blocks", "64"], ["emulate", "--kv-blocks", "64"], "kv_blocks", 64),
    (["stack", "--vllm-kv-mib", "16"], ["stack", "--kv-mib", "16"], "kv_mib", 16),
    (["stack", "--epp-scrape-interval-s", "0.5"], ["stack", "--scrape-interval-s", "0.5"],
     "scrape_interval_s", "0.5"),
    (["stack", "--bypass", "0.3"], ["stack", "--bypass-share", "0.3"], "bypass_share", 0.3),
    (["replay", "--scrape-interval", "2"], ["replay", "--scrape-interval-s", "2"],
     "scrape_interval_s", 2.0),
]


@pytest.mark.parametrize(("old", "new", "dest", "value"), CASES)
def test_old_spellings_parse_as_the_new_with_a_note(
    old: list[str], new: list[str], dest: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    assert getattr(parser.parse_args(new), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(parser.parse_args(old), dest) == value
    assert f"note: {old[1]} is deprecated, use {new[1]}" in capsys.readouterr().err


@pytest.mark.parametrize(("old", "new", "dest", "value"), CASES)
def test_help_names_only_the_new_spelling(
    old: list[str], new: list[str], dest: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([new[0], "--help"])
    text = capsys.readouterr().out
    assert new[1] in text and f"(formerly {old[1]})" in text
