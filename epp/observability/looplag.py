"""How late epp's event loop runs: a timer's overshoot, as a histogram and a warning.

Every ext_proc stream is served by one asyncio loop. In Envoy's default response mode
(``FULL_DUPLEX_STREAMED``) each chunk of every streamed reply goes through epp on its way to
the client, so a loop that stalls (a long synchronous call, a starved CPU) holds every
response in flight for as long: the clients see it as time to first token. The watcher sleeps
``interval_s`` again and again and records how much later than asked it woke up
(``epp_event_loop_lag_seconds``); a wake-up ``warn_s`` or more late is logged as a warning,
at most one line every ``log_every_s`` (with how many there were).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def watch_loop(
    observe: Callable[[float], None],
    interval_s: float = 0.1,
    warn_s: float = 0.25,
    log_every_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Run until cancelled, calling ``observe(lag_s)`` after each ``interval_s`` sleep."""
    stalls, worst, logged = 0, 0.0, -float("inf")
    while True:
        start = clock()
        await sleep(interval_s)
        lag = max(0.0, clock() - start - interval_s)
        observe(lag)
        if lag >= warn_s:
            stalls, worst = stalls + 1, max(worst, lag)
            now = clock()
            if now - logged >= log_every_s:
                log.warning(
                    "event loop stalled %.0f ms (%d stall(s) of %.0f ms or more since the last "
                    "warning, the worst %.0f ms): every stream through epp waited as long",
                    lag * 1e3, stalls, warn_s * 1e3, worst * 1e3,
                )
                stalls, worst, logged = 0, 0.0, now
