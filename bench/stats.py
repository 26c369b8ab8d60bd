"""Comparing two policies run on the same draws (seeds of a replay, rounds of a live run).

One draw's TTFT percentile moves far more from the next draw's than policies differ, so the
benches compare draw by draw: the geometric mean of a policy's figure over the baseline's on
the same draw, with a bootstrap interval over the draws.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

MIN_DRAWS = 3
"""Fewer paired draws than this give no interval (two draws resample into three means)."""


def paired_ratio(values: Sequence[float], base: Sequence[float], draws: int = 2000,
                 level: float = 0.9) -> tuple[float, float, float]:  # fmt: skip
    """The geometric mean over the draws of ``values[i] / base[i]`` and its ``level``
    bootstrap interval (a fixed generator: a rerun prints the same). NaN where it cannot
    tell: the ratio with no pair of positive figures, the interval below ``MIN_DRAWS``."""
    logs = [math.log(v / b) for v, b in zip(values, base, strict=True) if v > 0 and b > 0]
    mean = math.exp(statistics.fmean(logs)) if logs else math.nan
    if len(logs) < MIN_DRAWS:
        return mean, math.nan, math.nan
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    tail = (1 - level) / 2
    return mean, math.exp(means[int(tail * draws)]), math.exp(means[min(draws - 1, int((1 - tail) * draws))])


def verdict(lo: float, hi: float) -> str:
    """What a paired interval says of the baseline against the policy: ``"behind"`` (the
    policy's figure is lower on the whole interval), ``"ahead"``, ``"level"``, or ``""``
    without an interval."""
    if math.isnan(lo) or math.isnan(hi):
        return ""
    return "behind" if hi < 1 else "ahead" if lo > 1 else "level"


def describe(values: Sequence[float], base: Sequence[float], subject: str = "the default") -> str:
    """``0.96x [0.86, 1.05] (level)``: the paired ratio, its interval and what it says of
    ``subject`` (the baseline) against the policy behind ``values``."""
    ratio, lo, hi = paired_ratio(values, base)
    said = verdict(lo, hi)
    if not said:
        return f"{ratio:.2f}x ({len(values)} draws: too few for an interval)"
    return f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}] ({said if said == 'level' else subject + ' ' + said})"
