"""Cost model: documented calibration, monotonicity, speedup."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.model.cost import CostModel


def test_default_ttft_looks_like_an_8b_model_on_one_gpu() -> None:
    cost = CostModel()
    uncached = cost.prefill_s(2048) + cost.decode_step_s(1)
    cached = cost.prefill_s(0, 2048) + cost.decode_step_s(1)
    assert 0.150 <= uncached <= 0.250
    assert 0.020 <= cached <= 0.030


@given(st.integers(0, 50_000), st.integers(0, 50_000), st.integers(1, 1000))
def test_more_work_never_costs_less(uncached: int, cached: int, extra: int) -> None:
    cost = CostModel()
    assert cost.prefill_s(uncached + extra, cached) > cost.prefill_s(uncached, cached)
    assert cost.prefill_s(uncached, cached + extra) >= cost.prefill_s(uncached, cached)
    # A cached token is cheaper than one to compute.
    assert cost.prefill_s(uncached, cached + extra) < cost.prefill_s(uncached + extra, cached)
    assert cost.decode_step_s(extra + 1) > cost.decode_step_s(extra)


@pytest.mark.parametrize("speedup", [2.0, 50.0, 100.0])
def test_speedup_divides_every_duration(speedup: float) -> None:
    base, fast = CostModel(), CostModel(speedup=speedup)
    assert fast.prefill_s(1000, 500) == pytest.approx(base.prefill_s(1000, 500) / speedup)
    assert fast.decode_step_s(8) == pytest.approx(base.decode_step_s(8) / speedup)


def test_negative_parameters_are_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="decode_base_s"):
        CostModel(decode_base_s=-1.0)
    with pytest.raises(ValueError, match="speedup"):
        CostModel(speedup=0.0)
