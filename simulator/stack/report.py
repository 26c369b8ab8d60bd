"""Summaries of demo runs: the replicas' own counters plus client-side timings; table, PNG.

The prefix cache hit rate is vLLM's definition, read from each replica's ``/metrics``:
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` (tokens found in the
cache over prompt tokens looked up), summed over replicas.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from simulator.stack.driver import RequestRecord, RunRecords


@dataclass(slots=True, frozen=True)
class ReplicaCounters:
    url: str
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    requests: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    """``vllm:time_to_first_token_seconds`` cumulative buckets (le, count): the server's own
    TTFT, from arrival at the server to its first token."""
    queue_sum_s: float = 0.0
    queue_count: float = 0.0
    """``vllm:request_queue_time_seconds``: time requests waited to be scheduled (for KV
    blocks or a batch slot)."""
    preemptions: float = 0.0
    """``vllm:num_preemptions_total``: running requests evicted for KV (their KV is
    computed again)."""
    steps: float = 0.0
    step_tokens: float = 0.0
    """``vllm:iteration_tokens_total`` count and sum: the engine's steps and the tokens they
    ran (prefill and decode). Fewer, fuller steps do the same work for less per-step overhead,
    which matters where the servers share a host's cores."""

    def minus(self, before: ReplicaCounters) -> ReplicaCounters:
        """What the counters gained since ``before`` (a run on servers that served others)."""
        earlier = dict(before.ttft_buckets)
        return ReplicaCounters(
            self.url,
            self.prefix_queries - before.prefix_queries,
            self.prefix_hits - before.prefix_hits,
            self.requests - before.requests,
            self.ttft_sum_s - before.ttft_sum_s,
            self.ttft_count - before.ttft_count,
            tuple((le, n - earlier.get(le, 0.0)) for le, n in self.ttft_buckets),
            self.queue_sum_s - before.queue_sum_s,
            self.queue_count - before.queue_count,
            self.preemptions - before.preemptions,
            self.steps - before.steps,
            self.step_tokens - before.step_tokens,
        )

    def plus(self, other: ReplicaCounters) -> ReplicaCounters:
        buckets = dict(self.ttft_buckets)
        for le, n in other.ttft_buckets:
            buckets[le] = buckets.get(le, 0.0) + n
        return ReplicaCounters(
            self.url,
            self.prefix_queries + other.prefix_queries,
            self.prefix_hits + other.prefix_hits,
            self.requests + other.requests,
            self.ttft_sum_s + other.ttft_sum_s,
            self.ttft_count + other.ttft_count,
            tuple(sorted(buckets.items())),
            self.queue_sum_s + other.queue_sum_s,
            self.queue_count + other.queue_count,
            self.preemptions + other.preemptions,
            self.steps + other.steps,
            self.step_tokens + other.step_tokens,
        )


async def scrape_replicas(urls: Sequence[str]) -> list[ReplicaCounters]:
    out = []
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            values: dict[str, float] = {}
            buckets: dict[float, float] = {}
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    values[s.name] = values.get(s.name, 0.0) + s.value
                    if s.name == "vllm:time_to_first_token_seconds_bucket":
                        le = float(s.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + s.value
            out.append(
                ReplicaCounters(
                    url,
                    values.get("vllm:prefix_cache_queries_total", 0.0),
                    values.get("vllm:prefix_cache_hits_total", 0.0),
                    values.get("vllm:request_success_total", 0.0),
                    values.get("vllm:time_to_first_token_seconds_sum", 0.0),
                    values.get("vllm:time_to_first_token_seconds_count", 0.0),
                    tuple(sorted(buckets.items())),
                    values.get("vllm:request_queue_time_seconds_sum", 0.0),
                    values.get("vllm:request_queue_time_seconds_count", 0.0),
                    values.get("vllm:num_preemptions_total", 0.0),
                    values.get("vllm:iteration_tokens_total_count", 0.0),
                    values.get("vllm:iteration_tokens_total_sum", 0.0),
                )
            )
    return out


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i]


@dataclass(slots=True, frozen=True)
class RunSummary:
    policy: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    wall_s: float
    req_per_s: float
    output_tok_per_s: float
    per_replica_requests: list[int]
    per_replica_hit_rate: list[float]
    ttfts_ms: list[float] = field(repr=False)
    first_error: str = ""
    server_ttft_mean_ms: float = float("nan")
    """The servers' own TTFT (``vllm:time_to_first_token_seconds``), all replicas."""
    server_ttft_p90_ms: float = float("nan")
    server_ttft_p50_ms: float = float("nan")
    server_ttft_buckets: list[tuple[str, float]] = field(default_factory=list)
    """The servers' TTFT histograms merged: cumulative (le, count) as Prometheus writes them
    ("0.1", "+Inf"); what ``epp-sim calibrate --from-log --measure server`` fits to."""
    server_queue_mean_ms: float = float("nan")
    """The servers' mean wait to be scheduled (``vllm:request_queue_time_seconds``)."""
    preemptions: int = 0
    """Requests the servers preempted for KV (``vllm:num_preemptions_total``)."""
    engine_steps: int = 0
    """The servers' engine steps over the run, all replicas (``vllm:iteration_tokens_total``;
    0 where the servers do not report it)."""
    engine_step_tokens: float = float("nan")
    """Tokens a step ran, on average over those steps."""
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    """Every request of the run (user, turn, group, upstream, TTFT...): ``requests.jsonl``."""
    cpu_steal: float = float("nan")
    """Share of this machine's CPU time the hypervisor gave to other guests during the
    workload (``steal`` in ``/proc/stat``; NaN where there is none): a noisy host slows one
    policy's run and not another's."""
    round: int = 0
    """The demo's round (``--rounds``), from 0."""
    counters: list[ReplicaCounters] = field(default_factory=list, repr=False)
    """The servers' counters over the run (``merge_runs`` adds them up)."""
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each role of the stack used during the workload (``simulator.stack.cpu``:
    vllm, epp, router, gateway+client); empty where ``/proc`` is not readable."""

    @property
    def imbalance(self) -> float:
        """max / mean requests per replica (1.0 = perfectly even)."""
        loads = self.per_replica_requests
        mean = sum(loads) / len(loads) if loads else 0
        return max(loads) / mean if mean else float("nan")


def summarize(policy: str, run: RunRecords, replicas: Sequence[ReplicaCounters]) -> RunSummary:
    ok = [r for r in run.records if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    queries = sum(r.prefix_queries for r in replicas)
    hits = sum(r.prefix_hits for r in replicas)
    wall = max(run.wall_s, 1e-9)
    errors = [r for r in run.records if not r.ok]
    buckets = merged_buckets(replicas)
    steps = sum(r.steps for r in replicas)
    return RunSummary(
        policy=policy,
        requests=len(run.records),
        errors=len(errors),
        hit_rate=hits / queries if queries else 0.0,
        ttft_p50_ms=_pct(ttfts, 0.5),
        ttft_p90_ms=_pct(ttfts, 0.9),
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else float("nan"),
        e2e_p50_ms=_pct([r.e2e_s * 1000 for r in ok], 0.5),
        wall_s=run.wall_s,
        req_per_s=len(ok) / wall,
        output_tok_per_s=sum(r.completion_tokens for r in ok) / wall,
        per_replica_requests=[int(r.requests) for r in replicas],
        per_replica_hit_rate=[
            r.prefix_hits / r.prefix_queries if r.prefix_queries else 0.0 for r in replicas
        ],
        ttfts_ms=ttfts,
        first_error=(f"HTTP {errors[0].status}: {errors[0].error}" if errors else ""),
        server_ttft_mean_ms=_server_mean(replicas),
        server_ttft_p90_ms=1000 * histogram_quantile(buckets, 0.9),
        server_ttft_p50_ms=1000 * histogram_quantile(buckets, 0.5),
        server_ttft_buckets=[(_le_text(le), n) for le, n in buckets],
        server_queue_mean_ms=_queue_mean(replicas),
        preemptions=int(sum(r.preemptions for r in replicas)),
        engine_steps=int(steps),
        engine_step_tokens=sum(r.step_tokens for r in replicas) / steps if steps else float("nan"),
        records=list(run.records),
        counters=list(replicas),
    )


def merge_runs(runs: Sequence[RunSummary]) -> RunSummary:
    """One policy's rounds as one run: every request, the servers' counters added up, the
    wall times summed (throughput over the time the policy ran), the steal averaged."""
    if not runs:
        raise ValueError("no runs to merge")
    counters = list(runs[0].counters)
    for s in runs[1:]:
        counters = [a.plus(b) for a, b in zip(counters, s.counters, strict=True)]
    records = RunRecords([r for s in runs for r in s.records], sum(s.wall_s for s in runs))
    steal = [s.cpu_steal for s in runs if not math.isnan(s.cpu_steal)]
    cpu: dict[str, float] = {}
    for s in runs:
        for role, seconds in s.cpu_s.items():
            cpu[role] = cpu.get(role, 0.0) + seconds
    merged = summarize(runs[0].policy, records, counters)
    return replace(merged, cpu_steal=statistics.fmean(steal) if steal else float("nan"), cpu_s=cpu)


CPU_ROLES = {"vllm": "vllm", "emulator": "emulator", "epp": "epp", "router": "router",
             "envoy": "envoy", "gateway+client": "gw"}  # fmt: skip
"""Roles in the order printed, and their short names in the table."""


def cpu_per_request(s: RunSummary) -> str:
    """CPU ms per request by role ("vllm 71, epp 5.2, gw 14"), the roles in use."""
    if not s.cpu_s or not s.requests:
        return "n/a"
    names = dict(CPU_ROLES)
    if s.cpu_s.get("envoy", 0.0) > 0:  # the root process is then the client alone
        names["gateway+client"] = "client"
    return ", ".join(f"{short} {s.cpu_s[role] * 1e3 / s.requests:.3g}"
                     for role, short in names.items() if s.cpu_s.get(role, 0.0) > 0)  # fmt: skip


def _server_mean(replicas: Sequence[ReplicaCounters]) -> float:
    n = sum(r.ttft_count for r in replicas)
    return 1000 * sum(r.ttft_sum_s for r in replicas) / n if n else float("nan")


def _queue_mean(replicas: Sequence[ReplicaCounters]) -> float:
    n = sum(r.queue_count for r in replicas)
    return 1000 * sum(r.queue_sum_s for r in replicas) / n if n else float("nan")


def merged_buckets(replicas: Sequence[ReplicaCounters]) -> list[tuple[float, float]]:
    """The servers' TTFT histograms added up: cumulative (le, count), le ascending."""
    merged: dict[float, float] = {}
    for r in replicas:
        for le, count in r.ttft_buckets:
            merged[le] = merged.get(le, 0.0) + count
    return sorted(merged.items())


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Quantile ``q`` of a histogram given as cumulative (le, count), le ascending and the
    last +Inf, interpolated inside its bucket as Prometheus' ``histogram_quantile`` does (in
    the histogram's unit; NaN when it is empty; the last finite edge when the rank falls in
    +Inf)."""
    if not buckets or not buckets[-1][1]:
        return float("nan")
    rank = q * buckets[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == math.inf:
                return lo_edge
            span = count - lo_count
            frac = (rank - lo_count) / span if span else 1.0
            return lo_edge + (le - lo_edge) * frac
        lo_edge, lo_count = le, count
    return lo_edge


def _le_text(le: float) -> str:
    return "+Inf" if le == math.inf else repr(le)


def parse_buckets(rows: Sequence[Sequence[Any]]) -> list[tuple[float, float]]:
    """``RunSummary.server_ttft_buckets`` as written to demo.json, back to (le, count)."""
    return sorted((float(le), float(n)) for le, n in rows)


SERVER_ONLY_ROWS = ("server queue mean, preemptions", "engine steps per request, tokens a step")
"""Rows from counters real vLLM reports and the emulator does not: left out of the table when
no run has them (they would read ``nan ms, 0`` and ``n/a`` for every policy)."""


def table_rows(runs: Sequence[RunSummary]) -> list[tuple[str, list[str]]]:
    """The demo table's rows; a server-only row (``SERVER_ONLY_ROWS``) only when some run's
    servers reported its counters."""
    rows = _all_rows(runs)
    reported = {
        SERVER_ONLY_ROWS[0]: any(not math.isnan(s.server_queue_mean_ms) for s in runs),
        SERVER_ONLY_ROWS[1]: any(s.engine_steps for s in runs),
    }
    return [(label, cells) for label, cells in rows if reported.get(label, True)]


def unreported_rows(runs: Sequence[RunSummary]) -> list[str]:
    """The server-only rows ``table_rows`` left out: what the table's note names."""
    shown = {label for label, _ in table_rows(runs)}
    return [label for label in SERVER_ONLY_ROWS if label not in shown]


def _all_rows(runs: Sequence[RunSummary]) -> list[tuple[str, list[str]]]:
    def loads(s: RunSummary) -> str:
        return (
            " / ".join(str(n) for n in s.per_replica_requests) + f"  (max/mean {s.imbalance:.2f})"
        )

    return [
        ("prefix cache hit rate", [f"{s.hit_rate:.1%}" for s in runs]),
        ("TTFT p50", [f"{s.ttft_p50_ms:.0f} ms" for s in runs]),
        ("TTFT p90", [f"{s.ttft_p90_ms:.0f} ms" for s in runs]),
        ("server TTFT mean / p90", [f"{s.server_ttft_mean_ms:.0f} / {s.server_ttft_p90_ms:.0f} ms"
                                    for s in runs]),
        ("server queue mean, preemptions", [
            f"{s.server_queue_mean_ms:.0f} ms, {s.preemptions}" for s in runs
        ]),
        ("engine steps per request, tokens a step", [
            "n/a" if not s.engine_steps else
            f"{s.engine_steps / max(1, s.requests):.1f}, {s.engine_step_tokens:.0f}" for s in runs
        ]),
        ("throughput", [f"{s.req_per_s:.1f} req/s, {s.output_tok_per_s:.0f} tok/s" for s in runs]),
        ("wall time", [f"{s.wall_s:.1f} s" for s in runs]),
        ("requests per replica", [loads(s) for s in runs]),
        ("errors", [f"{s.errors} of {s.requests}" for s in runs]),
        ("CPU ms per request", [cpu_per_request(s) for s in runs]),
        ("CPU stolen by the host", [
            "n/a" if math.isnan(s.cpu_steal) else f"{s.cpu_steal:.1%}" for s in runs
        ]),
    ]


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine from ``/proc/stat``; (0, 0) elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


def print_table(runs: Sequence[RunSummary], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("")
    for s in runs:
        table.add_column(f"via {s.policy}", justify="right")
    for label, cells in table_rows(runs):
        table.add_row(label, *cells)
    missing = unreported_rows(runs)
    if missing:
        table.caption = (f"not shown: {'; '.join(missing)} (the servers report no queue time "
                         "or engine steps; real vLLM does: --engine vllm)")
        table.caption_justify = "left"
    Console().print(table)


def write_plot(runs: Sequence[RunSummary], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_hit) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for s, color in zip(runs, colors, strict=False):
        xs = sorted(s.ttfts_ms)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax_cdf.step(
            xs,
            ys,
            where="post",
            color=color,
            label=f"{s.policy} (p50 {s.ttft_p50_ms:.0f} ms, p90 {s.ttft_p90_ms:.0f} ms)",
        )
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("time to first token, ms (client-measured, log scale)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(loc="lower right")
    names = [textwrap.fill(s.policy, 10) for s in runs]  # "epp x2 no sync" on two lines
    rates = [s.hit_rate * 100 for s in runs]
    bars = ax_hit.bar(range(len(runs)), rates, color=colors[: len(runs)])
    ax_hit.set_xticks(range(len(runs)), names)
    for bar, rate in zip(bars, rates, strict=True):
        ax_hit.text(bar.get_x() + bar.get_width() / 2, rate + 1, f"{rate:.1f}%", ha="center")
    ax_hit.set_ylim(0, 105)
    ax_hit.set_ylabel("prefix cache hit rate, % of prompt tokens")
    ax_hit.set_title("Prefix cache hit rate (replica counters)")
    fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_rounds(runs: Sequence[RunSummary]) -> None:
    """The demo's rounds, one row each: every policy's server TTFT, hit rate, throughput."""
    from rich.console import Console
    from rich.table import Table

    policies = list(dict.fromkeys(s.policy for s in runs))
    table = Table(title="each round: server TTFT mean / p90, hit rate, req/s (run order: "
                  "the round's first policy ran first)", title_justify="left")  # fmt: skip
    table.add_column("round")
    for p in policies:
        table.add_column(p, justify="right")
    for r in sorted({s.round for s in runs}):
        by = {s.policy: s for s in runs if s.round == r}
        table.add_row(str(r + 1), *(
            "-" if p not in by else
            f"{by[p].server_ttft_mean_ms:.0f} / {by[p].server_ttft_p90_ms:.0f} ms, "
            f"{by[p].hit_rate:.1%}, {by[p].req_per_s:.1f}" for p in policies
        ))  # fmt: skip
    Console().print(table)


def _fields(s: RunSummary) -> dict[str, object]:
    return {k: v for k, v in asdict(s).items() if k not in ("ttfts_ms", "records", "counters")}


def write_json(
    runs: Sequence[RunSummary], path: Path, extra: dict[str, object],
    by_round: Sequence[RunSummary] | None = None,
) -> Path:  # fmt: skip
    """``runs``: one per policy (over all rounds); ``by_round``: every run of every round."""
    doc = {**extra, "runs": [_fields(s) for s in runs]}
    if by_round is not None:
        doc["by_round"] = [_fields(s) for s in by_round]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def write_requests(runs: Sequence[RunSummary], path: Path) -> Path:
    """One JSON line per request and policy: who sent it (user, turn, group), when (start_s
    from the run's start), where it went (upstream), what it cost (TTFT, tokens, cached)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for s in runs:
            for r in s.records:
                out.write(json.dumps({"policy": s.policy, "round": s.round, **asdict(r)}) + "\n")
    return path
