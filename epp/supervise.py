"""Supervised background tasks: a task that dies is logged, counted and restarted.

Every long-running loop in epp (metric scrapes, the index sweeper, housekeeping, Kubernetes
watches, sync followers) runs under :func:`supervise`, so an unexpected exception costs one
restart with backoff instead of a loop that is silently gone for the life of the process.

This module imports nothing from epp: any package may use it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FailureHook = Callable[[str], None]
"""Called with the task's kind (a bounded label value) each time a run raises."""


@dataclass(slots=True, frozen=True)
class Backoff:
    initial_s: float = 0.1
    max_s: float = 30.0
    healthy_after_s: float = 60.0
    """A run that lasted this long resets the delay to ``initial_s``."""


DEFAULT_BACKOFF = Backoff()


async def supervise(
    kind: str,
    run: Callable[[], Awaitable[None]],
    *,
    name: str = "",
    on_failure: FailureHook | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Await ``run()`` until it returns; each time it raises, log the traceback, call
    ``on_failure(kind)`` and start it again after an exponentially growing delay.

    Cancellation is never swallowed. ``name`` (default ``kind``) identifies the task in logs.
    """
    label = name or kind
    delay = backoff.initial_s
    while True:
        started = clock()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            if clock() - started >= backoff.healthy_after_s:
                delay = backoff.initial_s
            log.exception("background task %s failed; restarting in %.2fs", label, delay)
            if on_failure is not None:
                on_failure(kind)
        await asyncio.sleep(delay)
        delay = min(backoff.max_s, delay * 2)


def spawn(
    kind: str,
    run: Callable[[], Awaitable[None]],
    *,
    name: str = "",
    on_failure: FailureHook | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> asyncio.Task[None]:
    """:func:`supervise` as a task on the running loop."""
    return asyncio.create_task(
        supervise(kind, run, name=name, on_failure=on_failure, backoff=backoff),
        name=f"epp-{name or kind}",
    )
