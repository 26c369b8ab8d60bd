"""The command lines as a new user meets them: ``--version`` answers from the package
metadata; every option has a help text that states its default once, never as a Python
literal; the tracing variables and the control headers are spelled out where they act."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from epp.cli import build_parser as epp_parser
from epp.cli import main as epp_main
from epp.request.parse import CONTROL_HEADERS
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


def _option_helps(build) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Every option's help as ``--help`` shows it: (``command --option``, text)."""
    for path, parser in _parsers(build(), ""):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action) if action.help else ""
            if isinstance(formatter, argparse.ArgumentDefaultsHelpFormatter):
                text = formatter._get_help_string(action) % {"default": action.default, "prog": ""}
            yield f"{path} {action.option_strings[0]}".strip(), text


@pytest.mark.parametrize("build", [epp_parser, sim_parser])
def test_every_option_has_help_stating_its_default_once_and_never_as_a_python_literal(build) -> None:  # type: ignore[no-untyped-def]
    helps = list(_option_helps(build))
    assert len(helps) > 50  # the walk reached the subcommands' options
    for option, text in helps:
        if option.endswith(("--help", "--version")):
            continue
        assert text.strip(), f"{option} has no help"
        assert len(re.findall(r"\(default: ", text)) <= 1, f"{option}: {text!r}"
        assert not re.search(r"\(default: [\[({]", text), f"{option}: {text!r}"


def test_trust_control_headers_lists_every_header_it_unlocks() -> None:
    (text,) = [t for o, t in _option_helps(epp_parser) if o == "serve --trust-control-headers"]
    assert set(CONTROL_HEADERS) >= {"x-epp-explain", "x-llm-d-inference-objective",
                                    "x-gateway-inference-objective", "x-gateway-model-name-rewrite"}  # fmt: skip
    for name in CONTROL_HEADERS:
        assert f" {name} (" in f" {text}", f"--trust-control-headers does not name {name}"


@pytest.mark.parametrize("command", ["serve", "pd-sidecar"])
def test_the_commands_that_read_otel_variables_say_so_in_their_help(command: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        epp_main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in text and "OTEL_TRACES_EXPORTER" in text
    assert "start-up stops with an error naming the variable" in text
    assert "x-gateway-destination-endpoint" in text or command == "pd-sidecar"  # no name cut at a hyphen


def test_emulate_help_names_every_endpoint_the_emulator_serves() -> None:
    """``epp-sim emulate --help`` lists its HTTP API, the sleep mode's endpoints too (QA3 #15)."""
    from simulator.emulator.config import EmulatorConfig
    from simulator.emulator.server import Emulator

    help_text = " ".join(dict(_parsers(sim_parser(), ""))[" emulate"].format_help().split())
    paths = {r.resource.canonical for r in Emulator(EmulatorConfig()).app().router.routes()}
    pooling = {"/v2/rerank", "/rerank", "/score", "/encode"}  # the "..." of the pooling APIs
    stored = {p for p in paths if "{" in p}  # the stored responses' paths, named as /v1/responses/{id}
    missing = [p for p in sorted(paths - pooling - stored)
               if p not in help_text and p.replace("/v1/audio", "") not in help_text]  # fmt: skip
    assert not missing, f"emulate --help does not mention {missing}"
    assert "/sleep?level" in help_text and "/wake_up" in help_text
