"""A profile: filters in order, then weighted scorers, then one picker.

In a large pool the scorers see a shortlist of the candidates, not every one of them: the
endpoints that can matter. When more than ``shortlist.minCandidates`` candidates survive the
filters and every scorer the profile weighs is a ``Nominator``, each scorer names the
``perScorer`` endpoints it would score highest by its own measure, found without scoring the
rest (the prefix scorer the longest holders, the queue and KV scorers the least loaded, the
predicted-TTFT scorer those and the staircases of its loads and the least-filled caches, the
prefix-home scorer the prompt's home); the profile adds the least queued, and the full
scorer set runs on the union (docs/configuration.md, "Large
pools"). The look-ups come from the ``Pool`` the candidates are: the datastore's routable
pool keeps them indexed, so a decision's cost does not grow with the pool
(``bench/bench_scheduling.py`` prints it at 8 to 1,024 endpoints, against every candidate
scored). Scorers that normalise over the candidates read the whole pool's extremes
(``CycleState.pool``), so a shortlisted endpoint scores as it would among them all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.interfaces import Filter, Nominator, Picker, Scorer
from epp.framework.pool import Pool, as_pool
from epp.framework.shortlist import ShortlistConfig
from epp.framework.types import CycleState, FilterStep, ProfileResult, ProfileRun, ScorerColumn

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class Profile:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
        shortlist: ShortlistConfig | None = None,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(s for s in scorers if s.weight != 0)
        self._weights = tuple(s.weight for s in self.scorers)
        self.picker = picker
        sl = self.shortlist_config = shortlist or ShortlistConfig()
        nominators = [s.scorer for s in self.scorers if isinstance(s.scorer, Nominator)]
        self.shortlists = sl.enabled and bool(self.scorers) and len(nominators) == len(self.scorers)
        """Whether this profile scores a shortlist of a large pool (every scorer nominates)."""
        self._nominators: tuple[Nominator, ...] = tuple(nominators)
        self._min_candidates = sl.min_candidates
        self._per_scorer = sl.per_scorer

    def plugins(self) -> list[object]:
        return [*self.filters, *(s.scorer for s in self.scorers), self.picker]

    def run(self, state: CycleState, endpoints: Sequence[Endpoint], count: int) -> ProfileResult:
        clock = time.perf_counter
        timings = state.timings
        record = state.runs
        start_ns = time.time_ns() if record is not None else 0
        steps: list[FilterStep] | None = [] if record is not None else None
        candidates = endpoints
        for f in self.filters:
            t0 = clock()
            candidates = f.filter(state, candidates)
            timings[f.name] = clock() - t0
            if steps is not None:
                steps.append(FilterStep(f.name, tuple(e.id for e in candidates)))
            if not candidates:
                if record is not None and steps is not None:
                    record.append(self._recorded(endpoints, steps, (), [], [], [], start_ns))
                return ProfileResult([], (), ())
        if self.shortlists and len(candidates) > self._min_candidates:
            t0 = clock()
            pool = as_pool(candidates)
            candidates = self.shortlist(state, pool, count)
            state.pool = pool
            timings["shortlist"] = clock() - t0
        try:
            columns = []
            for ws in self.scorers:
                t0 = clock()
                columns.append(ws.scorer.score(state, candidates))
                timings[ws.scorer.name] = clock() - t0
        finally:
            state.pool = None
        total = self._combine(columns, len(candidates))
        t0 = clock()
        targets = self.picker.pick(state, candidates, total, count)
        timings[self.picker.name] = clock() - t0
        if log.isEnabledFor(logging.DEBUG):
            self._log_scores(state, candidates, columns, total, targets)
        if record is not None and steps is not None:
            record.append(self._recorded(endpoints, steps, candidates, columns, total, targets,
                                         start_ns))  # fmt: skip
        return ProfileResult(targets, candidates, total)

    def _recorded(self, endpoints: Sequence[Endpoint], steps: list[FilterStep],
                  candidates: Sequence[Endpoint], columns: list[Sequence[float]],
                  total: Sequence[float], targets: Sequence[Endpoint], start_ns: int) -> ProfileRun:  # fmt: skip
        return ProfileRun(
            self.name, tuple(e.id for e in endpoints), tuple(steps),
            tuple(e.id for e in candidates),
            tuple(ScorerColumn(ws.scorer.name, ws.weight, tuple(float(x) for x in column))
                  for ws, column in zip(self.scorers, columns, strict=False)),
            tuple(float(x) for x in total), self.picker.name, tuple(e.id for e in targets),
            start_ns, time.time_ns(),
        )  # fmt: skip

    def shortlist(self, state: CycleState, pool: Pool, count: int = 1) -> list[Endpoint]:
        """The endpoints of ``pool`` the scorers get to score: the ``perScorer`` least
        queued, then each scorer's nominees, each endpoint once, in that order; topped up
        with the next least queued to ``count`` (the pick and its fallbacks)."""
        k = self._per_scorer
        chosen: dict[EndpointId, Endpoint] = {e.id: e for e in pool.least("queue", k)}
        for nominator in self._nominators:
            for e in nominator.nominate(state, pool, k):
                chosen.setdefault(e.id, e)
        if len(chosen) < count:
            for e in pool.least("queue", count + len(chosen)):
                chosen.setdefault(e.id, e)
                if len(chosen) >= count:
                    break
        return list(chosen.values())

    def _log_scores(self, state: CycleState, candidates: Sequence[Endpoint], columns: list[Sequence[float]],
                    total: Sequence[float], targets: Sequence[Endpoint]) -> None:  # fmt: skip
        """Why this pick (``--log-level debug``): per candidate (the first 8), the weighted
        total and each scorer's score before its weight."""
        names = [ws.scorer.name for ws in self.scorers]
        parts = []
        for i, e in enumerate(candidates[:8]):
            scores = " ".join(f"{n}={c[i]:.3f}" for n, c in zip(names, columns, strict=True))
            parts.append(f"{e.id} total={total[i]:.3f} {scores}")
        more = f" (+{len(candidates) - 8} more)" if len(candidates) > 8 else ""
        log.debug("profile %s request %s -> %s: %s%s", self.name, state.request.request_id,
                  ",".join(str(t.id) for t in targets), "; ".join(parts), more)  # fmt: skip

    def _combine(self, columns: list[Sequence[float]], n: int) -> list[float]:
        """Weighted sum of the scorers' columns, one pass for the common shapes."""
        w = self._weights
        if len(columns) == 3:
            w0, w1, w2 = w
            return [w0 * a + w1 * b + w2 * c for a, b, c in zip(*columns, strict=True)]
        if len(columns) == 2:
            w0, w1 = w
            return [w0 * a + w1 * b for a, b in zip(*columns, strict=True)]
        if len(columns) == 5:  # the default profile
            w0, w1, w2, w3, w4 = w
            return [w0 * a + w1 * b + w2 * c + w3 * d + w4 * e
                    for a, b, c, d, e in zip(*columns, strict=True)]  # fmt: skip
        total = [0.0] * n
        for weight, column in zip(w, columns, strict=True):
            total = [t + weight * s for t, s in zip(total, column, strict=True)]
        return total
