from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from epp.observability.hotpath import LightCounter, LightHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


@given(st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), max_size=50))
def test_light_histogram_exports_what_prometheus_client_exports(values: list[float]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    light = LightHistogram("h_seconds", "doc", ["plugin"], buckets=BUCKETS, registry=ours)
    ref = Histogram("h_seconds", "doc", ["plugin"], buckets=BUCKETS, registry=theirs)
    for i, v in enumerate(values):
        light.labels(f"p{i % 2}").observe(v)
        ref.labels(f"p{i % 2}").observe(v)
    for label in ("p0", "p1"):
        for suffix, extra in [("_count", {}), ("_sum", {}), ("_bucket", {"le": "0.01"}),
                              ("_bucket", {"le": "+Inf"}), ("_bucket", {"le": "1.0"})]:
            labels = {"plugin": label, **extra}
            got = ours.get_sample_value("h_seconds" + suffix, labels)
            want = theirs.get_sample_value("h_seconds" + suffix, labels)
            assert got == pytest.approx(want)


def test_light_counter_and_text_format() -> None:
    reg = CollectorRegistry()
    c = LightCounter("epp_requests", "Requests.", ["model", "status"], registry=reg)
    c.labels("m", "200").inc()
    c.labels("m", "200").inc(2)
    assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 3
    text = generate_latest(reg).decode()
    ref = CollectorRegistry()
    Counter("epp_requests", "Requests.", ["model", "status"], registry=ref).labels("m", "200").inc(3)
    # the same exposition as prometheus_client's, less its *_created series
    want = [ln for ln in generate_latest(ref).decode().splitlines() if "_created" not in ln]
    assert text.splitlines() == want


def test_wrong_label_count_is_an_error() -> None:
    h = LightHistogram("x_seconds", "d", ["a"], buckets=BUCKETS, registry=CollectorRegistry())
    with pytest.raises(ValueError):
        h.labels("1", "2")
