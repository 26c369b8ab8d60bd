"""One name per setting across the epp and epp-sim commands; the old spellings still parse,
with a note naming the new one."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from epp.cli import build_parser as epp_parser
from simulator.cli import build_parser as sim_parser

CASES: list[tuple[Callable[[], argparse.ArgumentParser], list[str], list[str], str, object]] = [
    (sim_parser, ["emulate", "--num-gpu-blocks", "64"], ["emulate", "--kv-blocks", "64"],
     "kv_blocks", 64),
    (sim_parser, ["stack", "--vllm-kv-mib", "16"], ["stack", "--kv-mib", "16"], "kv_mib", 16),
    (sim_parser, ["stack", "--epp-scrape-interval-s", "0.5"],
     ["stack", "--scrape-interval-s", "0.5"], "scrape_interval_s", "0.5"),
    (sim_parser, ["stack", "--bypass", "0.3"], ["stack", "--bypass-share", "0.3"],
     "bypass_share", 0.3),
    (sim_parser, ["replay", "--scrape-interval", "2"], ["replay", "--scrape-interval-s", "2"],
     "scrape_interval_s", 2.0),
    # epp envoy-config's names, which epp-sim's gateway and stack now share
    (sim_parser, ["stack", "--mode", "full-duplex"], ["stack", "--request-body", "full-duplex"],
     "request_body", "full-duplex"),
    (sim_parser, ["gateway", "--mode", "buffered"], ["gateway", "--request-body", "buffered"],
     "request_body", "buffered"),
    (sim_parser, ["gateway", "--extproc", "10.0.0.1:9002"], ["gateway", "--epp", "10.0.0.1:9002"],
     "epp", "10.0.0.1:9002"),
    # --host, as every other epp and epp-sim command names the address it listens on
    (epp_parser, ["envoy-config", "--address", "127.0.0.1"], ["envoy-config", "--host", "127.0.0.1"],
     "host", "127.0.0.1"),
]  # fmt: skip


@pytest.mark.parametrize(("build", "old", "new", "dest", "value"), CASES)
def test_old_spellings_parse_as_the_new_with_a_note(
    build: Callable[[], argparse.ArgumentParser], old: list[str], new: list[str], dest: str,
    value: object, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    parser = build()
    assert getattr(parser.parse_args(new), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(parser.parse_args(old), dest) == value
    assert f"note: {old[1]} is deprecated, use {new[1]}" in capsys.readouterr().err


@pytest.mark.parametrize(("build", "old", "new", "dest", "value"), CASES)
def test_help_names_only_the_new_spelling(
    build: Callable[[], argparse.ArgumentParser], old: list[str], new: list[str], dest: str,
    value: object, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    with pytest.raises(SystemExit):
        build().parse_args([new[0], "--help"])
    text = capsys.readouterr().out
    assert new[1] in text and f"(formerly {old[1]})" in text


def test_an_old_spelling_keeps_the_choices_of_the_new() -> None:
    with pytest.raises(SystemExit):
        sim_parser().parse_args(["gateway", "--mode", "streamed"])
