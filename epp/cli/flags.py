"""The argument types every ``epp`` command shares (sizes, ports, bounded numbers), and the
config ``--config`` names."""

from __future__ import annotations

import argparse
from typing import Any

from epp.config.loader import EppConfig, default_config, load_config

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2,
          "mb": 1000**2, "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gi": 1024**3, "gib": 1024**3}  # fmt: skip


def byte_size(text: str) -> int:
    """``8MiB``, ``512k``, ``1048576`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8MiB, 512KiB or 1048576")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size") from None
    size = int(value * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return size


def port(text: str) -> int:
    """A port number: 0 = any free port, -1 = off."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 = any free port)") from None
    if not -1 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0 = any free port, -1 = off)")
    return value


def number(minimum: float, *, strict: bool, integer: bool = False) -> Any:
    """An argparse type: a number >= ``minimum`` (> with ``strict``), named in the error."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def load(args: argparse.Namespace) -> EppConfig:
    """epp's config: the file or shipped profile ``--config`` names, else the default."""
    return load_config(args.config) if args.config else default_config()
