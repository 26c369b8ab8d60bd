"""One name per setting across the epp and epp-sim commands; the old spellings still parse,
with a note naming the new one."""

from __future__ import annotations

import argparse
import itertools
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from epp.cli import build_parser as epp_parser
from epp.clihelp import DeprecatedAlias
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
    # epp envoy-config's names for what the development gateway and the stack also set
    (sim_parser, ["gateway", "--policy", "random"], ["gateway", "--routing", "random"],
     "routing", "random"),
    (sim_parser, ["stack", "--policy", "round-robin"], ["stack", "--routing", "round-robin"],
     "routing", "round-robin"),
    (sim_parser, ["gateway", "--response-mode", "streamed"], ["gateway", "--response", "streamed"],
     "response", "streamed"),
    (sim_parser, ["stack", "--response-mode", "summary"], ["stack", "--response", "summary"],
     "response", "summary"),
    (sim_parser, ["gateway", "--buffer-limit-bytes", "1024"],
     ["gateway", "--max-request-bytes", "1024"], "max_request_bytes", 1024),
    # epp pd-sidecar's and epp serve's
    (sim_parser, ["stack", "--pd-connector", "nixlv2"], ["stack", "--connector", "nixlv2"],
     "connector", "nixlv2"),
    (sim_parser, ["replay", "--sync-ms", "20"], ["replay", "--sync-flush-ms", "20"],
     "sync_flush_ms", 20.0),
    # epp-sim stack's
    (sim_parser, ["replay", "--routers", "3"], ["replay", "--epp-replicas", "3"], "epp_replicas", 3),
    # vLLM's
    (sim_parser, ["emulate", "--max-batched-tokens", "512"],
     ["emulate", "--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    (sim_parser, ["replay", "--max-batched-tokens", "512"],
     ["replay", "--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    # epp-sim calibrate's name for the run of a stack log to take
    (sim_parser, ["trace", "convert", "--policy", "epp", "x", "--from", "stack", "--out", "y"],
     ["trace", "convert", "--run", "epp", "x", "--from", "stack", "--out", "y"], "runs", "epp"),
    # the unit in the name, as its siblings'
    (sim_parser, ["replay", "--event-delay", "0.2"], ["replay", "--event-delay-s", "0.2"],
     "event_delay_s", 0.2),
]  # fmt: skip


def _flag(argv: list[str]) -> str:
    """The option of a case's command line (after its command and subcommand)."""
    return next(a for a in argv if a.startswith("--"))


@pytest.mark.parametrize(("build", "old", "new", "dest", "value"), CASES)
def test_old_spellings_parse_as_the_new_with_a_note(
    build: Callable[[], argparse.ArgumentParser], old: list[str], new: list[str], dest: str,
    value: object, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    parser = build()
    assert getattr(parser.parse_args(new), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(parser.parse_args(old), dest) == value
    assert f"note: {_flag(old)} is deprecated, use {_flag(new)}" in capsys.readouterr().err


@pytest.mark.parametrize(("build", "old", "new", "dest", "value"), CASES)
def test_help_names_only_the_new_spelling(
    build: Callable[[], argparse.ArgumentParser], old: list[str], new: list[str], dest: str,
    value: object, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    flag = new.index(_flag(new))
    with pytest.raises(SystemExit):
        build().parse_args([*new[:flag], "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert _flag(new) in text and re.search(rf"\(formerly ([^)]*; )?{re.escape(_flag(old))}[ ;)]", text)


def test_an_old_spelling_keeps_the_choices_of_the_new() -> None:
    with pytest.raises(SystemExit):
        sim_parser().parse_args(["gateway", "--mode", "streamed"])


def test_a_retired_switch_is_the_value_it_became(capsys: pytest.CaptureFixture[str]) -> None:
    """``--response-observer`` is ``--response observer`` (epp envoy-config's name), in the
    gateway and in the stack, which then hand epp its observer stream."""
    for command in ("gateway", "stack"):
        assert sim_parser().parse_args([command, "--response-observer"]).response == "observer"
        assert ("note: --response-observer is deprecated, use --response observer"
                in capsys.readouterr().err)  # fmt: skip
    with pytest.raises(SystemExit):  # a switch: it takes no value
        sim_parser().parse_args(["gateway", "--response-observer", "x"])


def test_the_stacks_response_observer_runs_epp_with_its_observer_stream() -> None:
    """``--response observer`` alone or as one of the demo's modes: the gateway sends the
    response on a second stream and epp waits for it (``epp serve --response-observer``)."""
    from simulator.stack.cli import options_from_args
    from simulator.stack.demo import variants

    def options(*argv: str) -> Any:
        args = sim_parser().parse_args(["stack", "--demo", *argv])
        args.scrape_intervals = ()
        return options_from_args(args)

    alone = options("--response", "observer")
    assert (alone.response_mode, alone.response_observer) == (None, True)
    runs = variants(options("--response", "full-duplex,observer"), ("epp",))
    assert [(o.response_mode, o.response_observer) for o in runs] == [
        ("full-duplex", False), (None, True)]


def test_the_stack_names_its_connector_as_the_sidecar_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_parser().parse_args(["stack", "--connector", "nixl"]).connector == "nixlv2"
    assert "use --connector nixlv2" in capsys.readouterr().err


# --- the guard: one flag name per setting across every epp and epp-sim command -------------


def _options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """Every option of every ``epp`` and ``epp-sim`` command: (command, its parser, option)."""
    out: list[tuple[str, argparse.ArgumentParser, argparse.Action]] = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}")
            elif action.option_strings and action.dest not in ("help", "version"):
                out.append((command, parser, action))

    walk(epp_parser(), "epp")
    walk(sim_parser(), "epp-sim")
    return out


def _name(action: argparse.Action) -> str:
    return action.option_strings[-1]


def _visible(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS


def test_a_hidden_option_is_a_deprecated_spelling_of_a_shown_one() -> None:
    """An old name is kept only through ``deprecated_alias``: same destination as the option
    it now spells, shown in the same command, with a note when used."""
    for command, parser, action in _options():
        if _visible(action):
            continue
        assert isinstance(action, DeprecatedAlias), f"{command} {_name(action)}: hidden, not an alias"
        assert action.new in parser._actions and _visible(action.new), (command, _name(action))
        assert action.dest == action.new.dest, (command, _name(action))


def test_one_name_per_destination_across_commands() -> None:
    """Every command spells a setting (its destination in the parsed arguments) the same way,
    and a name sets one destination wherever it appears."""
    names: dict[str, set[str]] = defaultdict(set)
    dests: dict[str, set[str]] = defaultdict(set)
    for command, _parser, action in _options():
        if _visible(action):
            names[action.dest].add(f"{_name(action)} ({command})")
            dests[_name(action)].add(action.dest)
    assert {d: n for d, n in names.items() if len({x.split()[0] for x in n}) > 1} == {}
    assert {n: d for n, d in dests.items() if len(d) > 1} == {}


RETIRED_AND_STILL_A_SETTING = {
    "--response-observer": "epp serve's switch for epp's side (wait for the observer stream); "
    "the gateway's side, how Envoy sends responses, is --response observer (epp envoy-config's)",
}
"""Old names that another command still uses, and why they name a different setting there."""


def test_a_retired_name_names_no_setting_elsewhere() -> None:
    retired = {_name(a) for _c, _p, a in _options() if isinstance(a, DeprecatedAlias)}
    shown = {_name(a) for _c, _p, a in _options() if _visible(a)}
    assert retired & shown == set(RETIRED_AND_STILL_A_SETTING)


DIFFERENT_SETTINGS_ALIKE_VALUES = {
    frozenset({"--processing-mode", "--request-body"}):
        "epp serve's assumption when Envoy sends no protocol_config, for requests and responses",
    frozenset({"--processing-mode", "--response"}): "as above",
    frozenset({"--request-body", "--response"}): "the request's body and the response's",
    frozenset({"--fallback-lb", "--routing"}):
        "Envoy's balancer when epp named no server, against who routes at all",
}  # fmt: skip
"""Differently named options whose values overlap, and why they are two settings."""


def test_options_taking_the_same_values_share_a_name() -> None:
    """Two names whose choices one holds the other's are one setting spelled twice (the
    gateway's ``--policy`` epp|random|round-robin was envoy-config's ``--routing``), unless
    listed above with the reason."""
    chosen = {(_name(a), frozenset(map(str, a.choices))) for _c, _p, a in _options()
              if _visible(a) and a.choices and len(a.choices) > 1}  # fmt: skip
    alike = {frozenset({n1, n2}) for (n1, c1), (n2, c2) in itertools.combinations(chosen, 2)
             if n1 != n2 and (c1 <= c2 or c2 <= c1)}  # fmt: skip
    assert alike == set(DIFFERENT_SETTINGS_ALIKE_VALUES)


def test_a_time_takes_its_unit_in_its_name() -> None:
    """A number of seconds or milliseconds is ``--NAME-s`` / ``--NAME-ms``, as the code base
    names units (``--scrape-interval-s``, ``--sync-flush-ms``)."""
    unitless = {
        f"{command} {_name(a)}" for command, _p, a in _options()
        if _visible(a) and a.type not in (None, str) and not a.choices
        and re.search(r"\b(seconds|milliseconds)\b", a.help or "")
        and not re.search(r"-m?s$", _name(a))
    }  # fmt: skip
    assert unitless == {"epp-sim emulate --speedup"}  # a factor: "latency stays in modelled seconds"


def test_a_prefix_of_an_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--bypass`` for ``--bypass-ratio`` would be taken silently (argparse's abbreviations)."""
    with pytest.raises(SystemExit):
        sim_parser().parse_args(["replay", "--workload", "chat", "--bypass", "0.1"])
    assert "unrecognized arguments: --bypass" in capsys.readouterr().err
