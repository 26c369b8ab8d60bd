"""Shared by every tier: an `http` client fixture, and the root logger: a test that runs ``epp.cli.main`` (``serve``, ``pd-sidecar``)
configures the root logger as the process would (a handler on the stderr pytest captured,
level INFO); restored after each test, so later tests neither write to that closed stream nor
see INFO records they did not ask for."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import aiohttp
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


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for a test (no per-host connection limit: tests open many streams)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session
