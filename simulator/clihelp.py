"""``--help`` formatting and deprecated aliases (epp's) and signal handling shared by the
``epp-sim`` subcommands."""

from __future__ import annotations

import asyncio
import signal

from epp.clihelp import HelpFormatter as HelpFormatter  # the subcommands import them from here
from epp.clihelp import deprecated_alias as deprecated_alias


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: what a long-running ``epp-sim`` command waits on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def parse_pd(spec: str) -> tuple[int, int]:
    """``--pd P:D`` (the stack's and the replay's): P prefill and D decode servers, both >= 1."""
    p, sep, d = spec.partition(":")
    if sep and p.strip().isdigit() and d.strip().isdigit() and int(p) >= 1 and int(d) >= 1:
        return int(p), int(d)
    raise ValueError(f"--pd {spec!r}: expected P:D, prefill and decode servers, both >= 1 (2:6)")
