"""Pickers: order the scored candidates and return the target plus fallbacks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import Endpoint
from epp.framework.types import CycleState


@dataclass(slots=True, frozen=True)
class PickerParams:
    pass


class MaxScorePicker:
    """Highest score first; ties broken at random (so equal endpoints share the load)."""

    def __init__(self, name: str, params: PickerParams) -> None:
        self.name = name

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        n = len(endpoints)
        if n == 0:
            return []
        rnd = state.rng.random
        if count == 1:
            best = max(scores)
            if scores.count(best) == 1:  # the common case, in C: no per-endpoint Python loop
                return [endpoints[scores.index(best)]]
            top = [i for i in range(n) if scores[i] == best]
            return [endpoints[top[int(rnd() * len(top))]]]
        order = sorted(range(n), key=lambda i: (-scores[i], rnd()))
        return [endpoints[i] for i in order[:count]]


class WeightedRandomPicker:
    """Draw without replacement with probability proportional to score (uniform if all 0)."""

    def __init__(self, name: str, params: PickerParams) -> None:
        self.name = name

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        rng = state.rng
        # Efraimidis-Spirakis: key u^(1/w), take the largest keys.
        keyed = []
        for e, s in zip(endpoints, scores, strict=True):
            w = s if s > 0 else 1e-9
            keyed.append((rng.random() ** (1.0 / w), e))
        keyed.sort(key=lambda kv: kv[0], reverse=True)
        return [e for _, e in keyed[:count]]


class RandomPicker:
    """Uniformly random, ignoring scores."""

    def __init__(self, name: str, params: PickerParams) -> None:
        self.name = name

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        return state.rng.sample(list(endpoints), min(count, len(endpoints)))


class RoundRobinPicker:
    """Cycles through the candidates in id order, ignoring scores."""

    def __init__(self, name: str, params: PickerParams) -> None:
        self.name = name
        self._next = 0

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        n = len(endpoints)
        if n == 0:
            return []
        ordered = sorted(endpoints, key=lambda e: e.id)
        start = self._next % n
        self._next += 1
        return [ordered[(start + k) % n] for k in range(min(count, n))]
