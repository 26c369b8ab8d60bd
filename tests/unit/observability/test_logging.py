from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from epp.observability.logging import setup_logging


@pytest.fixture
def restore_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("json_lines", [True, False])
def test_extra_fields_appear_in_both_formats(json_lines: bool, restore_root: logging.Logger) -> None:
    out = io.StringIO()
    setup_logging("info", stream=out, json_lines=json_lines)
    logging.getLogger("epp.test").warning("endpoint metrics stale", extra={"endpoint": "10.0.0.7:8000"})
    line = out.getvalue().strip()
    if json_lines:
        assert json.loads(line)["endpoint"] == "10.0.0.7:8000"
    else:
        assert line.endswith("epp.test: endpoint metrics stale endpoint=10.0.0.7:8000")


def test_text_format_keeps_the_traceback_below_the_fields(restore_root: logging.Logger) -> None:
    out = io.StringIO()
    setup_logging("info", stream=out, json_lines=False)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("epp.test").exception("scrape failed", extra={"endpoint": "e1"})
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("scrape failed endpoint=e1")
    assert rest[0].startswith("Traceback") and rest[-1] == "RuntimeError: boom"
