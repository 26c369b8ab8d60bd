"""The argument types every ``epp`` command shares (sizes, ports, bounded numbers, seconds),
and the config ``--config`` names. Each refuses what the setting cannot take (NaN, Inf, a
value past what Envoy or asyncio accepts) with an error naming what the flag accepts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from epp.config.loader import EppConfig, default_config, load_config
from epp.envoyconfig import ENVOY_MAX_BYTES
from epp.request.settings import MAX_BODY_BYTES_LIMIT
from epp.schema import MAX_SECONDS, parse_byte_size


def sizes(maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: ``8MiB``, ``512k``, ``1048576`` -> bytes, at most ``maximum``
    (``why`` names whose limit it is)."""

    def parse(text: str) -> int:
        try:
            size = parse_byte_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if maximum is not None and size > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is {size} bytes; at most {maximum} ({why})")
        return size

    return parse


byte_size = sizes()
"""``8MiB``, ``512k``, ``1048576`` -> bytes (at least 1)."""
body_size = sizes(MAX_BODY_BYTES_LIMIT, "1023MiB: epp's gRPC message limit, an int32, holds "
                  "twice the body")
"""A request body cap (``--max-body-bytes``): at most 1023 MiB."""
envoy_byte_size = sizes(ENVOY_MAX_BYTES, "Envoy's per_connection_buffer_limit_bytes is a uint32")
"""A size Envoy's buffer limit takes: at most 4294967295 bytes."""


def ports(*, any_free: bool = True, off: bool = False) -> Callable[[str], int]:
    """An argparse type: a port 1-65535, with 0 = any free port when ``any_free`` and -1 = off
    when ``off``; the error says which of those this flag accepts."""
    low = -1 if off else 0 if any_free else 1
    extra = [s for s, on in (("0 = any free port", any_free), ("-1 = off", off)) if on]
    accepts = "a port 1-65535" + (f" ({', '.join(extra)})" if extra else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepts}") from None
        if not low <= value <= 65535:
            raise argparse.ArgumentTypeError(f"{text} is not {accepts}")
        return value

    return parse


port = ports()
"""A port 1-65535, 0 = any free port."""
port_or_off = ports(off=True)
"""A port 1-65535, 0 = any free port, -1 = off."""


def number(minimum: float, *, strict: bool, integer: bool = False,
           maximum: float | None = None) -> Any:  # fmt: skip
    """An argparse type: a finite number >= ``minimum`` (> with ``strict``) and <= ``maximum``,
    named in the error."""
    bound = f"> {_plain(minimum)}" if strict else f">= {_plain(minimum)}"
    if maximum is not None:
        bound += f" and <= {_plain(maximum)}"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        if value < minimum or (strict and value == minimum) or (
                maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def _plain(x: float) -> str:
    """``31536000``, not ``3.1536e+07``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def seconds(minimum: float = 0.0, *, strict: bool = True, maximum: float = MAX_SECONDS) -> Any:
    """An argparse type for a ``-s`` / ``-ms`` flag: a finite number of seconds (or
    milliseconds) above ``minimum`` and at most ``maximum`` (a year by default)."""
    return number(minimum, strict=strict, maximum=maximum)


def load(args: argparse.Namespace) -> EppConfig:
    """epp's config: the file or shipped profile ``--config`` names, else the default."""
    return load_config(args.config) if args.config else default_config()
