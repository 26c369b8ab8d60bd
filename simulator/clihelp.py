"""``--help`` formatting shared by the ``epp-sim`` subcommands."""

from __future__ import annotations

import argparse


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
