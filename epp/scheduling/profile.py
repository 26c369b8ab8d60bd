"""A profile: filters in order, then weighted scorers, then one picker."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from epp.datastore.endpoint import Endpoint
from epp.scheduling.interfaces import Filter, Picker, Scorer
from epp.scheduling.types import CycleState


@dataclass(slots=True, frozen=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(slots=True, frozen=True)
class ProfileResult:
    targets: list[Endpoint]
    candidates: Sequence[Endpoint]
    totals: Sequence[float]


class Profile:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
        *,
        timed: bool = True,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(s for s in scorers if s.weight != 0)
        self.picker = picker
        self.timed = timed

    def run(self, state: CycleState, endpoints: Sequence[Endpoint], count: int) -> ProfileResult:
        clock = time.perf_counter
        timings = state.timings
        candidates = endpoints
        for f in self.filters:
            t0 = clock()
            candidates = f.filter(state, candidates)
            timings[f.name] = clock() - t0
            if not candidates:
                return ProfileResult([], (), ())
        n = len(candidates)
        total = [0.0] * n
        for ws in self.scorers:
            t0 = clock()
            scores = ws.scorer.score(state, candidates)
            timings[ws.scorer.name] = clock() - t0
            w = ws.weight
            total = [t + w * s for t, s in zip(total, scores)]
        t0 = clock()
        targets = self.picker.pick(state, candidates, total, count)
        timings[self.picker.name] = clock() - t0
        return ProfileResult(targets, candidates, total)
