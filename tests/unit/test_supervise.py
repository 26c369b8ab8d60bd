from __future__ import annotations

import asyncio
import logging

import pytest

from epp.supervise import Backoff, spawn, supervise

FAST = Backoff(initial_s=0.001, max_s=0.004)


async def test_a_failing_task_is_logged_counted_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []
    failures: list[str] = []

    async def run() -> None:
        runs.append(1)
        if len(runs) < 4:
            raise ValueError(f"boom {len(runs)}")

    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(supervise("scrape", run, on_failure=failures.append, backoff=FAST), 5)
    assert len(runs) == 4 and failures == ["scrape"] * 3
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 3 and "boom 3" in str(tracebacks[-1].exc_info[1])  # type: ignore[index]


async def test_cancellation_is_not_swallowed() -> None:
    started = asyncio.Event()

    async def run() -> None:
        started.set()
        await asyncio.Event().wait()

    task = spawn("loop", run, backoff=FAST)
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_backoff_grows_to_its_cap() -> None:
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    count = [0]

    async def run() -> None:
        count[0] += 1
        if count[0] <= 5:
            raise RuntimeError("x")

    asyncio_sleep, asyncio.sleep = asyncio.sleep, fake_sleep  # type: ignore[assignment]
    try:
        await supervise("t", run, backoff=Backoff(initial_s=0.1, max_s=0.4))
    finally:
        asyncio.sleep = asyncio_sleep  # type: ignore[assignment]
    assert sleeps == [0.1, 0.2, 0.4, 0.4, 0.4]
