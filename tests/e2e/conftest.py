"""Fixtures of the e2e suite: whole local stacks on free loopback ports (inline: one loop)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from simulator.stack import Stack, StackOptions, start_stack

FAST = StackOptions(replicas=3, speedup=20.0, isolation="inline", seed=3)
"""GPU time / 20: requests finish in milliseconds; routing and caching are unchanged."""


@pytest.fixture(params=["buffered", "full-duplex"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def stack(mode: str) -> AsyncIterator[Stack]:
    s = await start_stack(dataclasses.replace(FAST, request_mode=mode))
    try:
        yield s
    finally:
        await s.stop()


def model_of(stack: Stack) -> str:
    return stack.options.model


async def post(
    http: aiohttp.ClientSession, url: str, body: Any = None, *, data: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url, json=body if data is None else None, data=data) as r:
        return r.status, dict(r.headers), await r.read()
