"""JSON-lines logging. One object per line: ts, level, logger, msg, and exc when present.

Prompt text is never logged above DEBUG; modules log sizes and ids instead.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Hashable
from typing import TextIO

_STD_ATTRS = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            out[key] = value if isinstance(value, (str, int, float, bool)) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _extras(record: logging.LogRecord) -> dict[str, object]:
    """Fields passed with ``extra=`` (endpoint, model, ...): not part of the message itself."""
    return {k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...``: the ``extra=`` fields follow the message, so
    ``--log-format text`` says which endpoint a warning is about, as the JSON lines do."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if not extras:
            return text
        head, sep, tail = text.partition("\n")  # a traceback stays below the fields
        fields = " ".join(f"{k}={v}" for k, v in extras.items())
        return f"{head} {fields}{sep}{tail}"


def setup_logging(level: str = "info", stream: TextIO | None = None, json_lines: bool = True) -> None:
    """Configure the root logger once (idempotent: replaces handlers it installed before)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        JsonFormatter() if json_lines else TextFormatter()
    )
    handler._epp = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_epp", False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class LogEvery:
    """A line per event that can come thousands of times a second (every rejected request
    under overload), written at most once per ``interval_s`` per ``key``; the lines held
    back are counted into the next one. A synchronous log write per event would itself load
    the loop exactly when it is busiest. At DEBUG every event is written."""

    __slots__ = ("_clock", "_held", "_logger", "interval_s", "max_keys")

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0, max_keys: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._held: dict[Hashable, tuple[float, int]] = {}
        """Per key: when its last line was written, and the events held back since."""

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Write ``msg % args`` unless a line of ``key`` was written within the interval;
        returns whether it was written."""
        logger = self._logger
        if not logger.isEnabledFor(level):
            return False
        if logger.isEnabledFor(logging.DEBUG):
            logger.log(level, msg, *args)
            return True
        now = self._clock()
        last, held = self._held.get(key, (-math.inf, 0))
        if now - last < self.interval_s:
            self._held[key] = (last, held + 1)
            return False
        if key not in self._held and len(self._held) >= self.max_keys:
            self._held.clear()  # keys are few (statuses); a flood of new ones starts over
        self._held[key] = (now, 0)
        if held:
            msg += " (and %d more like it since the last such line)"
            args = (*args, held)
        logger.log(level, msg, *args)
        return True
