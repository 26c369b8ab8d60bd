"""Figures per policy, the rich table and the JSON report.

Definitions (over served requests; rejected ones are counted apart):

* ``hit_rate``: token-weighted prefix-cache hit rate, ``sum(cached_tokens) /
  sum(prompt_tokens)``, what ``vllm:prefix_cache_hits_total / queries_total`` reports (a
  request prefilled apart counts the prefiller's hits: the decoder loads the rest);
* TTFT: first token minus arrival; end-to-end (e2e): finish minus arrival;
* ``throughput_tok_s``: output tokens / (last finish - first arrival);
* TPOT (time per output token): ``(finish - first token) / (output tokens - 1)`` per request
  of two or more output tokens, what a streaming client sees between tokens;
* ``split_share``: share of requests prefilled apart (disaggregated serving);
* ``queue_share``: ``sum(admitted - arrival) / sum(TTFT)``, the share of time to first
  token spent waiting in a replica's queue rather than computing the prefill;
* ``load_imbalance``: max / mean of requests routed per replica (1.0 is perfectly even).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from simulator.replay.replayer import ReplayResult


@dataclass(slots=True, frozen=True)
class PolicyStats:
    policy: str
    requests: int
    served: int
    rejected: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    throughput_tok_s: float
    queue_share: float
    load_imbalance: float
    requests_per_replica: list[int]
    wall_s: float
    sim_requests_per_s: float
    """Requests simulated per second of wall time (replayer speed)."""
    ttft_pred_count: int = 0
    """Responses whose TTFT a cost model predicted (``predicted-ttft-scorer``), and its
    error on them: median of |predicted - observed| / observed, and mean |predicted -
    observed| in seconds (nan without such a model)."""
    ttft_pred_rel_p50: float = float("nan")
    ttft_pred_abs_mean_s: float = float("nan")
    scrape_interval_s: float = float("nan")
    """The scrape period the policy saw (nan: it reads no metrics)."""
    tpot_p50_s: float = float("nan")
    tpot_p90_s: float = float("nan")
    split_share: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(result: ReplayResult) -> PolicyStats:
    outs = result.outcomes
    served = [o for o in outs if not o.rejected]
    arrival = np.array([o.arrival_s for o in served])
    first = np.array([o.first_token_s for o in served])
    admitted = np.array([o.admitted_s for o in served])
    finish = np.array([o.finish_s for o in served])
    ttft = first - arrival
    e2e = finish - arrival
    prompt = sum(o.prompt_tokens for o in served)
    cached = sum(o.cached_tokens for o in served)
    output = sum(o.output_tokens for o in served)
    per_replica = np.bincount([o.replica for o in outs if o.replica >= 0], minlength=result.config.replicas)
    span = float(finish.max() - min(o.arrival_s for o in outs)) if served else 0.0

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if a.size else float("nan")

    ttft_sum = float(ttft.sum())
    multi = [o for o in served if o.output_tokens > 1]
    tpot = np.array([(o.finish_s - o.first_token_s) / (o.output_tokens - 1) for o in multi])
    pred = np.array(result.ttft_predictions, dtype=float).reshape(-1, 2)
    observed = pred[:, 1]
    err = np.abs(pred[:, 0] - observed)
    rel = err[observed > 0] / observed[observed > 0]
    return PolicyStats(
        policy=result.policy,
        requests=len(outs),
        served=len(served),
        rejected=len(outs) - len(served),
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_s=pct(ttft, 50),
        ttft_p90_s=pct(ttft, 90),
        ttft_p99_s=pct(ttft, 99),
        e2e_p50_s=pct(e2e, 50),
        e2e_p99_s=pct(e2e, 99),
        throughput_tok_s=output / span if span > 0 else 0.0,
        queue_share=float((admitted - arrival).sum()) / ttft_sum if ttft_sum > 0 else 0.0,
        load_imbalance=float(per_replica.max() / per_replica.mean()) if outs else 0.0,
        requests_per_replica=[int(x) for x in per_replica],
        wall_s=result.wall_s,
        sim_requests_per_s=len(outs) / result.wall_s if result.wall_s > 0 else 0.0,
        ttft_pred_count=len(pred),
        ttft_pred_rel_p50=pct(rel, 50),
        ttft_pred_abs_mean_s=float(err.mean()) if err.size else float("nan"),
        scrape_interval_s=result.scrape_interval_s,
        tpot_p50_s=pct(tpot, 50),
        tpot_p90_s=pct(tpot, 90),
        split_share=sum(o.prefiller >= 0 for o in served) / len(served) if served else 0.0,
    )


def stats_table(stats: Sequence[PolicyStats], title: str = "") -> Table:
    table = Table(title=title or None)
    for col in (
        "policy", "hit rate", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "e2e p99",
        "out tok/s", "queue share", "imbalance", "rejected", "sim req/s",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    splitting = any(s.split_share for s in stats)
    if splitting:
        table.add_column("split", justify="right")
    predicting = any(s.ttft_pred_count for s in stats)
    if predicting:
        table.add_column("TTFT pred. error", justify="right")
    for s in stats:
        extra = [_served(s, f"{s.split_share:.0%}")] if splitting else []
        extra += [_pred_error(s)] if predicting else []
        table.add_row(
            s.policy,
            _served(s, f"{s.hit_rate:.1%}"),
            _secs(s.ttft_p50_s, "s"),
            _secs(s.ttft_p90_s, "s"),
            _secs(s.ttft_p99_s, "s"),
            _ms(s.tpot_p50_s),
            _ms(s.tpot_p90_s),
            _secs(s.e2e_p99_s, "s"),
            _served(s, f"{s.throughput_tok_s:,.0f}"),
            _served(s, f"{s.queue_share:.0%}"),
            _served(s, f"{s.load_imbalance:.2f}"),
            str(s.rejected),
            f"{s.sim_requests_per_s:,.0f}",
            *extra,
        )
    return table


def _served(s: PolicyStats, text: str) -> str:
    """A figure of the served requests, or "-" when none was served (every one rejected)."""
    return text if s.served else "-"


def _secs(value: float, unit: str) -> str:
    """Seconds with two decimals, or "-" when no request finished (nan)."""
    return "-" if math.isnan(value) else f"{value:.2f}{unit}"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:.0f}ms"


def _pred_error(s: PolicyStats) -> str:
    """The cost model's TTFT prediction error: median relative / mean absolute."""
    if not s.ttft_pred_count:
        return "-"
    return f"{s.ttft_pred_rel_p50:.0%} / {s.ttft_pred_abs_mean_s:.2f}s"


def markdown_table(stats: Sequence[PolicyStats]) -> str:
    head = (
        "| policy | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 | output tok/s "
        "| queue share | imbalance |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = "".join(
        f"| {s.policy} | {_served(s, f'{s.hit_rate:.1%}')} | {_secs(s.ttft_p50_s, ' s')} "
        f"| {_secs(s.ttft_p90_s, ' s')} | {_secs(s.ttft_p99_s, ' s')} "
        f"| {_secs(s.e2e_p50_s, ' s')} | {_secs(s.e2e_p99_s, ' s')} "
        f"| {_served(s, f'{s.throughput_tok_s:,.0f}')} | {_served(s, f'{s.queue_share:.0%}')} "
        f"| {_served(s, f'{s.load_imbalance:.2f}')} |\n"
        for s in stats
    )
    return head + rows


def print_table(stats: Sequence[PolicyStats], console: Console | None = None, title: str = "") -> None:
    (console or Console()).print(stats_table(stats, title))


def write_json(path: str | Path, stats: Sequence[PolicyStats], extra: dict[str, Any] | None = None) -> None:
    """One object per policy (a list); sweep points carry their parameter in ``extra``."""
    rows = [{**s.to_json(), **(extra or {})} for s in stats]
    Path(path).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
