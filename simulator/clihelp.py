"""``--help`` formatting, deprecated aliases and the stop signal (epp's), and the flag parsers
shared by the ``epp-sim`` subcommands."""

from __future__ import annotations

from epp.clihelp import HelpFormatter as HelpFormatter  # the subcommands import them from here
from epp.clihelp import deprecated_alias as deprecated_alias
from epp.clihelp import stop_event as stop_event


def parse_pd(spec: str) -> tuple[int, int]:
    """``--pd P:D`` (the stack's and the replay's): P prefill and D decode servers, both >= 1."""
    p, sep, d = spec.partition(":")
    if sep and p.strip().isdigit() and d.strip().isdigit() and int(p) >= 1 and int(d) >= 1:
        return int(p), int(d)
    raise ValueError(f"--pd {spec!r}: expected P:D, prefill and decode servers, both >= 1 (2:6)")
