"""The pick's reason and the dry-run tables, from recorded profile runs."""

from __future__ import annotations

from epp.framework.endpoint import EndpointId
from epp.framework.types import FilterStep, ProfileRun, ScorerColumn
from epp.requestcontrol.explain import pick_reason, run_tables

A, B, C = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000"), EndpointId("10.0.0.3:8000")


def run(candidates: tuple[EndpointId, ...], scores: dict[str, tuple[float, ...]], weights: dict[str, float],
        picked: tuple[EndpointId, ...], profile: str = "default") -> ProfileRun:  # fmt: skip
    columns = tuple(ScorerColumn(n, weights[n], s) for n, s in scores.items())
    totals = tuple(sum(c.weight * c.scores[k] for c in columns) for k in range(len(candidates)))
    return ProfileRun(profile, (A, B, C), (FilterStep("decode-filter", candidates),), candidates,
                      columns, totals, "max-score-picker", picked, 0, 1)  # fmt: skip


def test_the_reason_names_the_runner_up_and_the_largest_weighted_gap_first() -> None:
    r = run((A, B, C), {"prefix": (0.9, 0.1, 0.0), "queue": (0.4, 1.0, 0.2)}, {"prefix": 3, "queue": 1}, (A, B))
    assert pick_reason([r], A) == ("10.0.0.1:8000 over 10.0.0.2:8000 (total 3.10 vs 1.30, profile default): "
                                   "prefix 0.90 vs 0.10 x3, queue 0.40 vs 1.00 x1")  # fmt: skip
    assert pick_reason([r], A, prefiller=C).endswith("; prefill on 10.0.0.3:8000")
    assert pick_reason([r], B) == ""  # no run picked it


def test_a_lone_candidate_and_a_tie_say_so() -> None:
    lone = run((B,), {"queue": (1.0,)}, {"queue": 1}, (B,))
    assert pick_reason([lone], B) == "10.0.0.2:8000, the only candidate of 3 (profile default, decode-filter left it alone)"
    tie = run((A, B), {"queue": (0.5, 0.5)}, {"queue": 1}, (B,))
    assert pick_reason([tie], B).endswith("every score equal: max-score-picker chose")


def test_the_reason_reads_the_run_that_picked_the_target() -> None:
    prefill = run((C,), {"queue": (1.0,)}, {"queue": 1}, (C,), profile="prefill")
    decode = run((A, B), {"prefix": (0.2, 0.8)}, {"prefix": 1}, (B,), profile="decode")
    assert "profile decode" in pick_reason([decode, prefill], B)


def test_run_tables_show_each_filters_survivors_and_each_scorers_column() -> None:
    r = run((A, B), {"prefix": (0.9, 0.1), "queue": (0.4, 1.0)}, {"prefix": 3, "queue": 1}, (A, B))
    empty = ProfileRun("prefill", (A, B, C), (FilterStep("prefill-filter", ()),), (), (), (), "max-score-picker", (), 0, 1)
    text = run_tables([r, empty])
    assert "profile default: 3 endpoints" in text
    assert "filter decode-filter: 2 left: 10.0.0.1:8000, 10.0.0.2:8000" in text
    header = next(line for line in text.splitlines() if "endpoint" in line and "total" in line)
    assert header.split() == ["endpoint", "prefix", "x3", "queue", "x1", "total", "picked"]
    first = next(line for line in text.splitlines() if line.strip().startswith("10.0.0.1"))
    assert first.split() == ["10.0.0.1:8000", "0.900", "0.400", "3.100", "<-", "pick"]
    assert "fallback 1" in text
    assert "filter prefill-filter: 0 left: none" in text and "no candidate left" in text
