"""The across-sessions comparison of bench/bench_calibrated_replay.py: how well one session's
live figures predict another's, beside the replay against its own session."""

from __future__ import annotations

import pytest

from bench.bench_calibrated_replay import Table, across_sessions


def session(scale: float, replay: float, rounds: int = 6) -> Table:
    """Two policies, ``fast`` clearly ahead of ``slow`` every round; live figures times
    ``scale``, the replay's times ``scale * replay``."""
    table: Table = {}
    for label, p50, p90, hit in (("fast", 0.06, 0.30, 0.90), ("slow", 0.09, 0.50, 0.74)):
        cell = table.setdefault(label, {})
        for r in range(rounds):
            wobble = 1 + 0.01 * r
            for side, f in (("live", scale), ("fitted", scale * replay)):
                cell.setdefault(f"{side} p50", []).append(p50 * f * wobble)
                cell.setdefault(f"{side} p90", []).append(p90 * f * wobble)
                cell.setdefault(f"{side} hit", []).append(hit)
    return table


def test_sessions_that_repeat_agree_and_a_replay_20_percent_off_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    across_sessions({"a": session(1.0, 1.2), "b": session(1.05, 1.2)})
    out = capsys.readouterr().out
    assert "its own session's live:    0 of 8 (0%)" in out  # 1.2x: every figure outside 15%
    assert "one session's live against another's:         8 of 8 (100%), the median figure off by 5%" in out
    assert "hit rates within 2 points 4 of 4" in out
    assert "ordered alike by its replay 2 of 2, by another session's live 2 of 2" in out
    assert "by its replay in 2 of 2 sessions, by another session's live in 2 of 2 pairs" in out
    assert "fast 1.20x, 1.20x, +0.0" in out


def test_sessions_far_apart_show_live_does_not_repeat(capsys: pytest.CaptureFixture[str]) -> None:
    across_sessions({"a": session(1.0, 1.0), "b": session(1.5, 1.0)})
    out = capsys.readouterr().out
    assert "its own session's live:    8 of 8 (100%)" in out
    assert "one session's live against another's:         0 of 8 (0%), the median figure off by 50%" in out
