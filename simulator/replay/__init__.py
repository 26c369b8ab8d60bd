"""Offline trace replay: every routing policy against emulated replicas, in simulated time.

``epp-sim replay`` (see ``docs/replay.md``). The pieces: ``workload`` (Mooncake traces and
generators), ``policies`` (epp's real scheduler and the baselines), ``replayer`` (the
discrete-event loop), ``report``, ``plots`` and ``sweep``.
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``replay`` subcommand (imports the heavy modules only when it is defined)."""
    from simulator.replay.cli import register as add

    add(subparsers)
