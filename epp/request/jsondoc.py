"""JSON from clients and model servers, parsed fast without changing what is accepted.

orjson reads a 16 KB ASCII prompt body (UTF-8 check included) in half the time the standard
library takes to decode and parse it, and an SSE stream's events in about a quarter; text in
other scripts costs the same either way (measured by ``bench/bench_scheduling.py`` at commit
af00e66: docs/results/scheduling.md at that commit). Where orjson refuses a text (``NaN``, ``Infinity``, a number beyond a double, a lone
surrogate escape, nesting past 1,024 levels, invalid UTF-8) the standard library decides, so
the set of accepted documents and every error message stay the standard library's.

One difference remains in documents both accept: an integer beyond 64 bits reads as a float.
epp reads no such field (token counts and ids are bounded far below), and a body that epp
may re-serialize (a model rewrite is configured or asked for) is read with :func:`strict`
instead.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes) -> Any:
    """The document in the UTF-8 text ``data``; raises what ``json.loads(data.decode())``
    raises: ``UnicodeDecodeError``, ``json.JSONDecodeError``, ``ValueError`` (an integer of
    more than 4,300 digits), ``RecursionError``."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data.decode("utf-8"))


def read(data: bytes, exact: bool) -> tuple[Any, bool]:
    """The document (read exactly with ``exact``) and whether it may hold a lone surrogate
    (``"\\ud800"``): only a text the standard library read may, orjson refuses them. Raises
    what :func:`loads` raises."""
    if exact:
        return strict(data), True
    try:
        return orjson.loads(data), False
    except orjson.JSONDecodeError:
        return json.loads(data.decode("utf-8")), True


def strict(data: bytes) -> Any:
    """The standard library's reading, integers exact: for a document epp writes back."""
    return json.loads(data.decode("utf-8"))
