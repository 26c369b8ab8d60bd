"""JSON-lines logging. One object per line: ts, level, logger, msg, and exc when present.

Prompt text is never logged above DEBUG; modules log sizes and ids instead.
"""

from __future__ import annotations

import json
import logging
import sys
import time
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
