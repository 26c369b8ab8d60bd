"""``--help`` formatting and signal handling shared by the ``epp-sim`` subcommands."""

from __future__ import annotations

import argparse
import asyncio
import signal


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a value to show: not for unset (None),
    empty or off (False) defaults, nor twice when the help text already says ``default:``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default in ("", []) or default is argparse.SUPPRESS:
            return text
        if "default:" in text or "%(default)" in text:
            return text
        return super()._get_help_string(action) or ""


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: what a long-running ``epp-sim`` command waits on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
