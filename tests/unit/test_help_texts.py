"""The command lines as a new user meets them: ``--version`` answers from the package
metadata, and no option's help says its default twice."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from epp.cli import build_parser as epp_parser
from epp.cli import main as epp_main
from simulator.cli import build_parser as sim_parser
from simulator.cli import main as sim_main


@pytest.mark.parametrize(("main", "prog"), [(epp_main, "epp"), (sim_main, "epp-sim")])
def test_version_prints_the_installed_version(main, prog, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {version('epp')}"


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


@pytest.mark.parametrize("build", [epp_parser, sim_parser])
def test_no_option_help_states_its_default_twice(build) -> None:  # type: ignore[no-untyped-def]
    seen = 0
    for path, parser in _parsers(build(), ""):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action) if action.help else ""
            if isinstance(formatter, argparse.ArgumentDefaultsHelpFormatter):
                text = formatter._get_help_string(action) % {"default": action.default, "prog": ""}
            defaults = len(re.findall(r"\(default: ", text))
            assert defaults <= 1, f"{path} {action.option_strings[0]}: {text!r}"
            seen += 1
    assert seen > 50  # the walk reached the subcommands' options
