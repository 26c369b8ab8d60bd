"""The paired comparison the benches print their verdicts with (bench/stats.py)."""

from __future__ import annotations

import math

from bench.stats import describe, paired_ratio, verdict


def test_a_policy_twice_as_fast_on_every_draw_puts_the_default_behind() -> None:
    base = [2.0, 5.0, 40.0, 1.0]  # draws far apart, as seeds are
    ratio, lo, hi = paired_ratio([b / 2 for b in base], base)
    assert math.isclose(ratio, 0.5) and math.isclose(lo, 0.5) and math.isclose(hi, 0.5)
    assert describe([b / 2 for b in base], base) == "0.50x [0.50, 0.50] (the default behind)"
    assert describe([b * 2 for b in base], base).endswith("(the default ahead)")


def test_mixed_draws_are_level_and_the_interval_holds_the_mean() -> None:
    base = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    values = [0.5, 2.0, 0.8, 1.25, 0.9, 1.1]
    ratio, lo, hi = paired_ratio(values, base)
    assert lo < ratio < hi and lo < 1 < hi
    assert describe(values, base, "epp").endswith("(level)")
    assert paired_ratio(values, base) == (ratio, lo, hi)  # a fixed generator: reruns agree


def test_two_draws_give_a_ratio_but_no_interval() -> None:
    ratio, lo, hi = paired_ratio([1.0, 2.0], [2.0, 2.0])
    assert math.isclose(ratio, math.sqrt(0.5)) and math.isnan(lo) and math.isnan(hi)
    assert describe([1.0, 2.0], [2.0, 2.0]) == "0.71x (2 draws: too few for an interval)"
    assert all(math.isnan(v) for v in paired_ratio([0.0], [1.0]))


def test_the_verdict_reads_the_interval_not_the_text() -> None:
    assert verdict(0.6, 0.9) == "behind" and verdict(1.01, 1.3) == "ahead"
    assert verdict(0.9, 1.1) == "level" and verdict(math.nan, math.nan) == ""
