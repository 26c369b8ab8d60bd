"""``--help`` formatting (epp's) and signal handling shared by the ``epp-sim`` subcommands."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from epp.clihelp import HelpFormatter as HelpFormatter  # the subcommands import it from here


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: what a long-running ``epp-sim`` command waits on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def deprecated_alias(group: Any, old: str, new: argparse.Action) -> None:
    """Accept ``old`` as a spelling of the option ``new`` (same type and destination) for one
    release: using it prints a note naming the new one. ``--help`` shows only the new name,
    with the old one in its text."""
    new_name = new.option_strings[0]

    class _Alias(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            print(f"note: {old} is deprecated, use {new_name}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    group.add_argument(old, dest=new.dest, type=new.type, metavar=new.metavar,
                       action=_Alias, help=argparse.SUPPRESS)
    new.help = f"{new.help or ''} (formerly {old})".strip()


def parse_pd(spec: str) -> tuple[int, int]:
    """``--pd P:D`` (the stack's and the replay's): P prefill and D decode servers, both >= 1."""
    p, sep, d = spec.partition(":")
    if sep and p.strip().isdigit() and d.strip().isdigit() and int(p) >= 1 and int(d) >= 1:
        return int(p), int(d)
    raise ValueError(f"--pd {spec!r}: expected P:D, prefill and decode servers, both >= 1 (2:6)")
