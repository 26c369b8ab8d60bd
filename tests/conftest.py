"""Shared by every tier: a test that runs ``epp.cli.main`` (``serve``, ``pd-sidecar``)
configures the root logger as the process would (a handler on the stderr pytest captured,
level INFO); restored after each test, so later tests neither write to that closed stream nor
see INFO records they did not ask for."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
