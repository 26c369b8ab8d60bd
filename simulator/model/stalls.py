"""Host-wide stalls: moments when a shared machine runs none of its servers' work.

On a host whose servers share a few CPU cores with everything else (the local stack: two
vLLM servers, Envoy, epp and the client on two cores), the scheduler now and then leaves the
servers without a core for tens to hundreds of milliseconds, all of them at once. A request
that arrives then, or whose step runs then, waits the stall out: a 90 ms cache hit becomes a
400 ms one, on every server together. Neither a step's cost nor per-step noise
(``CostModel.step_noise``) gives that: stalls are additive, and they do not shrink with the
step.

:class:`HostStalls` is one host's schedule of stalls: a Poisson process of ``rate_hz`` starts
a second, each lasting an exponential time of mean ``mean_s`` (overlapping ones merge). It
is drawn from its own seeded generator, lazily as far as the replay asks, so a replay stays
repeatable and costs nothing where there are none. Every engine of a replay holds the same
schedule, so all of them stop together, and maps its work to wall time through it
(:meth:`HostStalls.finish`, :meth:`HostStalls.work`).
"""

from __future__ import annotations

import bisect
import random

_CHUNK_S = 60.0
"""How far ahead the schedule is drawn at a time (seconds of wall time)."""


class HostStalls:
    """A seeded schedule of host-wide stalls (module docstring)."""

    def __init__(self, rate_hz: float, mean_s: float, seed: int = 0) -> None:
        if rate_hz < 0 or mean_s < 0:
            raise ValueError("stall rate and duration must be >= 0")
        self.rate_hz = rate_hz
        self.mean_s = mean_s
        self._rng = random.Random(seed ^ 0x57A11)
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._before: list[float] = []
        """Total stall time before each stall's start (prefix sums)."""
        self._work_at: list[float] = []
        """Work time (wall time less stalls) at each stall's start: increasing."""
        self._drawn = 0.0
        """The schedule is complete up to this time."""
        self._next = self._gap(0.0)
        self._fixed = False

    @classmethod
    def at(cls, intervals: list[tuple[float, float]]) -> HostStalls:
        """A schedule of exactly these (start, end) stalls, in time order and apart."""
        s = cls(0.0, 0.0)
        total = 0.0
        for start, end in intervals:
            if end <= start or (s._ends and start <= s._ends[-1]):
                raise ValueError("stalls must be (start, end) with start < end, in order, apart")
            s._starts.append(start)
            s._ends.append(end)
            s._before.append(total)
            s._work_at.append(start - total)
            total += end - start
        s._drawn = float("inf")
        s._fixed = True
        return s

    @property
    def active(self) -> bool:
        return self._fixed or (self.rate_hz > 0 and self.mean_s > 0)

    def _gap(self, t: float) -> float:
        return t + self._rng.expovariate(self.rate_hz) if self.rate_hz > 0 else float("inf")

    def _draw_to(self, t: float) -> None:
        while self._drawn < t:
            horizon = self._drawn + _CHUNK_S
            while self._next < horizon:
                start, end = self._next, self._next + self._rng.expovariate(1.0 / self.mean_s)
                if self._ends and start <= self._ends[-1]:  # overlaps the last: merge
                    self._ends[-1] = max(self._ends[-1], end)
                else:
                    total = self._through(len(self._starts) - 1)
                    self._starts.append(start)
                    self._ends.append(end)
                    self._before.append(total)
                    self._work_at.append(start - total)
                self._next = self._gap(start)
            self._drawn = horizon

    def stalled(self, t: float) -> float:
        """Total stall time in [0, t]."""
        if not self.active or t <= 0:
            return 0.0
        self._draw_to(t + self.mean_s * 50)  # a stall starting before t may end after it
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        return self._before[i] + min(t, self._ends[i]) - self._starts[i]

    def work(self, start: float, now: float) -> float:
        """Work time (wall time less stalls) between ``start`` and ``now``."""
        if not self.active:
            return now - start
        return (now - start) - (self.stalled(now) - self.stalled(start))

    def _through(self, i: int) -> float:
        """Total stall time to the end of stall ``i`` (0 before the first)."""
        return self._before[i] + self._ends[i] - self._starts[i] if i >= 0 else 0.0

    def finish(self, start: float, work_s: float) -> float:
        """When ``work_s`` of work begun at ``start`` ends, stalls included."""
        if not self.active or work_s <= 0:
            return start + max(0.0, work_s)
        # the work done by wall time t is t - stalled(t), which stands still through each
        # stall: the end is that amount of work plus every stall that starts before the
        # start or before the work is done (one starting just as it is done does not delay it)
        target = start - self.stalled(start) + work_s
        begun = bisect.bisect_right(self._starts, start)
        margin = self.mean_s * 50  # as stalled(): the stalls up to the end are final
        end = target
        while True:
            self._draw_to(end + margin)
            j = max(begun, bisect.bisect_left(self._work_at, target)) - 1
            end = target + self._through(j)
            if end + margin <= self._drawn:
                return max(end, start + work_s)
