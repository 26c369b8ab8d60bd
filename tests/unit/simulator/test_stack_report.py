"""The demo's server-side TTFT: vLLM's histogram merged over replicas, read as
Prometheus' histogram_quantile reads it."""

from __future__ import annotations

import math

from simulator.stack.report import ReplicaCounters, _server_mean, _server_quantile


def test_server_ttft_quantiles_merge_replicas_and_interpolate() -> None:
    a = ReplicaCounters("a", ttft_sum_s=3.0, ttft_count=10,
                        ttft_buckets=((0.1, 4), (0.5, 8), (1.0, 10), (math.inf, 10)))  # fmt: skip
    b = ReplicaCounters("b", ttft_sum_s=1.0, ttft_count=10,
                        ttft_buckets=((0.1, 10), (0.5, 10), (1.0, 10), (math.inf, 10)))  # fmt: skip
    assert _server_mean([a, b]) == 200.0  # 4 s over 20 first tokens
    # merged: 14 under 0.1 s, 18 under 0.5 s, 20 under 1 s; the median is in the first bucket
    assert math.isclose(_server_quantile([a, b], 0.5), 1000 * 0.1 * 10 / 14)
    assert math.isclose(_server_quantile([a, b], 0.9), 500.0)
    assert math.isnan(_server_quantile([ReplicaCounters("c")], 0.9))


def test_steal_share_is_the_stolen_part_of_the_machine_time() -> None:
    from simulator.stack.report import cpu_times, steal_share

    assert steal_share((10, 1_000), (15, 1_100)) == 0.05
    assert math.isnan(steal_share((10, 1_000), (10, 1_000)))
    steal, total = cpu_times()
    if total:  # Linux: /proc/stat read
        assert 0 <= steal <= total
