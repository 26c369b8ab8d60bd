"""``--help`` formatting, deprecated flag names and the stop signal, shared by ``epp`` and
``epp-sim``."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import textwrap
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a value to show: not for unset (None),
    empty (``''``, an empty list such as a repeatable option's) or off (False) defaults, nor
    twice when the help text already says ``default:``; and never breaks a line inside a
    hyphenated name (``x-gateway-destination-endpoint``, ``--allowed-prefillers``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS:
            return text
        if isinstance(default, str | list | tuple | dict | set | frozenset) and not default:
            return text
        if "default:" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action) or ""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)  # fmt: skip


class DeprecatedAlias(argparse.Action):
    """A retired spelling of the option ``new``: sets its destination, with one note on
    stderr naming the new spelling. Added by :func:`deprecated_alias`."""

    def __init__(self, *args: Any, new: argparse.Action, value: str | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.new = new
        self.value = value
        self.use = new.option_strings[0] + ("" if value is None else f" {value}")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        print(f"note: {option_string} is deprecated, use {self.use}", file=sys.stderr)
        setattr(namespace, self.dest, values if self.value is None else self.value)


def deprecated_alias(group: Any, old: str, new: argparse.Action, *, const: str | None = None) -> None:
    """Accept ``old`` as a spelling of the option ``new`` (same type, choices and destination)
    for one release: using it prints one note naming the new one. ``--help`` shows only the
    new name, with the old one in its text. With ``const``, ``old`` is a retired switch that
    takes no value and stands for ``new const`` (``--response-observer`` for ``--response
    observer``)."""
    if const is None:
        group.add_argument(old, dest=new.dest, type=new.type, choices=new.choices,
                           metavar=new.metavar, action=DeprecatedAlias, new=new,
                           help=argparse.SUPPRESS)  # fmt: skip
        _formerly(new, old)
    else:
        group.add_argument(old, dest=new.dest, nargs=0, action=DeprecatedAlias, new=new,
                           value=const, help=argparse.SUPPRESS)  # fmt: skip
        _formerly(new, f"{old} for {new.option_strings[0]} {const}")


def _formerly(new: argparse.Action, spelling: str) -> None:
    """``new``'s help names a retired spelling: ``(formerly A; B)`` for several."""
    text = new.help or ""
    if text.endswith(")") and "(formerly " in text:
        new.help = f"{text[:-1]}; {spelling})"
    else:
        new.help = f"{text} (formerly {spelling})".strip()


def no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Refuse a prefix of an option (``--bypass`` for ``--bypass-ratio``) in ``parser`` and
    every subcommand's parser: a retired name that is the prefix of a current one would
    otherwise be taken silently, and a prefix breaks when a longer option is added."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbreviations(sub)


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: what a long-running command waits on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
