"""The event-loop watcher records how late its timer ran and warns about stalls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from epp.observability.looplag import watch_loop


async def test_a_blocked_loop_is_recorded_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    task = asyncio.create_task(watch_loop(lags.append, interval_s=0.01, warn_s=0.1))
    await asyncio.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="epp.observability.looplag"):
        time.sleep(0.3)  # noqa: ASYNC251 - the point: a synchronous call holding the loop
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert lags and min(lags) >= 0
    assert max(lags) >= 0.25  # the 0.3 s block, whatever else the host does
    # how many other wake-ups a busy host makes late is not this test's business (the exact
    # count, on an injected clock, is the next test's)
    assert any("event loop stalled" in r.getMessage() for r in caplog.records)


async def test_warnings_are_rate_limited_and_count_the_stalls(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    lags: list[float] = []

    async def late_sleep(seconds: float) -> None:
        now[0] += seconds + 0.6  # every wake-up 0.6 s late
        await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, logger="epp.observability.looplag"):
        task = asyncio.create_task(watch_loop(lags.append, interval_s=1.0, warn_s=0.5, log_every_s=100.0,
                                              clock=lambda: now[0], sleep=late_sleep))  # fmt: skip
        while len(lags) < 5:
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert all(abs(lag - 0.6) < 1e-9 for lag in lags)
    warnings = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert len(warnings) == 1  # the later stalls wait to be counted into the next line
