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


def test_runs_side_by_side_pool_sessions_and_show_each(tmp_path, capsys) -> None:
    """``./run bench demo --across``: the runs side by side: two sessions' ``demo.json`` (both in a
    ``demo`` directory, named by their parents), the paired ratio per session and pooled."""
    import json

    from bench.bench_demo import across

    def session(name: str, epp: list[float], router: list[float]):
        d = tmp_path / name / "demo"
        d.mkdir(parents=True)
        rows = [{"policy": p, "round": k, "server_ttft_mean_ms": v, "server_ttft_p90_ms": 2 * v,
                 "hit_rate": 0.9, "req_per_s": 15.0}
                for k, (a, b) in enumerate(zip(epp, router, strict=True))
                for p, v in (("epp", a), ("router", b))]  # fmt: skip
        (d / "demo.json").write_text(json.dumps({"runs": [], "by_round": rows}))
        return d

    ahead = session("one", [100.0, 110.0, 90.0, 100.0], [150.0, 160.0, 140.0, 150.0])
    behind = session("two", [150.0, 160.0, 140.0, 150.0], [100.0, 110.0, 90.0, 100.0])
    across([ahead, behind], {})
    out = capsys.readouterr().out
    assert "one/demo#1" in out and "two/demo#4" in out
    assert "epp below router: server TTFT mean in 4 of 8 runs" in out
    lines = {line.split("(")[0].strip(): line for line in out.splitlines() if " runs): " in line}
    assert lines["one/demo"].endswith("0.67x [0.65, 0.68] (router behind)")
    assert "(router ahead)" in lines["two/demo"]
    assert lines["all"].strip().startswith("all (8 runs): mean 1.00x") and "(level)" in lines["all"]

