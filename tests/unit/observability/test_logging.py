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


def test_a_line_per_event_is_written_at_most_once_a_second_per_key(caplog: pytest.LogCaptureFixture) -> None:
    """Under overload every rejected request wrote its own log line, synchronously, on the
    loop (issue 70, item 13): now a line per kind per second, counting the rest."""
    import logging

    from epp.observability.logging import LogEvery

    now = [0.0]
    every = LogEvery(logging.getLogger("epp.test.every"), interval_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="epp.test.every"):
        written = [every.log(logging.INFO, 429, "rejected %d", i) for i in range(1000)]
        written.append(every.log(logging.INFO, 503, "unavailable"))
        now[0] = 1.5
        written.append(every.log(logging.INFO, 429, "rejected %d", 1000))
    lines = [r.getMessage() for r in caplog.records if r.name == "epp.test.every"]
    assert sum(written) == 3
    assert lines == ["rejected 0", "unavailable", "rejected 1000 (and 999 more like it since the last such line)"]
    with caplog.at_level(logging.DEBUG, logger="epp.test.every"):  # debugging: every one
        assert all(every.log(logging.INFO, 429, "again") for _ in range(3))
