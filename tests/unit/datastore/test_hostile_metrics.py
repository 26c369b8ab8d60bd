"""A model server's /metrics page is untrusted input: odd values are rejected or clamped with a
counted reason, oversized or malformed pages are scrape errors, and the endpoint recovers by
itself when its server does."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from epp.datastore.metricsparse import VLLM, PageParser, ScrapeError, sample_lines
from epp.datastore.pagefetch import PageFetcher
from epp.datastore.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, endpoint_id
from epp.observability.metrics import EppMetrics

GOOD = (
    b'vllm:num_requests_waiting{engine="0"} 2.0\n'
    b'vllm:num_requests_running{engine="0"} 3.0\n'
    b'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
)


def parse(page: bytes) -> tuple[object, list[tuple[str, str]]]:
    rejected: list[tuple[str, str]] = []
    m = PageParser(VLLM, lambda f, r: rejected.append((f, r))).parse(page, 1.0)
    return m, rejected


@pytest.mark.parametrize(
    ("value", "reason"),
    [(b"NaN", "not_finite"), (b"+Inf", "not_finite"), (b"-Inf", "not_finite"),
     (b"1" * 5000, "not_a_number"), (b"abc", "not_a_number"), (b"\xff\xfe", "not_a_number")],
)  # fmt: skip
def test_non_finite_or_garbage_values_are_rejected_not_raised(value: bytes, reason: str) -> None:
    page = GOOD.replace(b"} 2.0", b"} " + value)
    m, rejected = parse(page)
    assert m.waiting == 0 and m.running == 3  # type: ignore[attr-defined]
    assert rejected == [("vllm:num_requests_waiting", reason)]


def test_negative_queue_is_clamped_and_does_not_attract_traffic() -> None:
    m, rejected = parse(GOOD.replace(b"} 2.0", b"} -1000"))
    assert m.waiting == 0  # type: ignore[attr-defined]
    assert ("vllm:num_requests_waiting", "negative") in rejected


def test_huge_counts_and_kv_are_clamped() -> None:
    m, rejected = parse(GOOD.replace(b"} 2.0", b"} 1e30").replace(b"} 0.5", b"} 7"))
    assert m.waiting == 1_000_000 and m.kv_usage == 1.0  # type: ignore[attr-defined]
    assert {r for _, r in rejected} == {"too_large"}


@pytest.mark.parametrize("max_lora", ["²", "1" * 400, "-3", "4.5", "\udcff"])
def test_odd_integer_labels_read_as_unknown(max_lora: str) -> None:
    line = f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="a"}} 1.0\n'
    cc = f'vllm:cache_config_info{{block_size="{max_lora}",num_gpu_blocks="12"}} 1.0\n'
    page = GOOD + line.encode("utf-8", "surrogateescape") + cc.encode("utf-8", "surrogateescape")
    m, _ = parse(page)
    assert m.max_adapters == 0 and m.block_size_tokens == 0 and m.num_gpu_blocks == 12  # type: ignore[attr-defined]
    assert m.running_adapters == {"a"}  # type: ignore[attr-defined]


def test_page_that_is_not_utf8_still_parses() -> None:
    page = b"# HELP \xff\xfe broken\n" + GOOD + b'vllm:lora_requests_info{running_lora_adapters="\xff"} 1\n'
    m, _ = parse(page)
    assert (m.waiting, m.running) == (2, 3)  # type: ignore[attr-defined]


def test_a_family_is_one_group_and_longer_names_are_not_it() -> None:
    page = (b"vllm:num_requests_waiting_by_reason 9\n" + GOOD +
            b"vllm:num_requests_waiting_by_reason 9\n")  # fmt: skip
    assert sample_lines(page, b"vllm:num_requests_waiting") == [(b'engine="0"', b"2.0")]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.sampled_from([b"", GOOD]))
def test_any_bytes_parse_or_raise_scrape_error(junk: bytes, base: bytes) -> None:
    for page in (junk, base + junk, junk + base, base.replace(b"2.0", junk[:50])):
        try:
            PageParser(VLLM).parse(page, 1.0)
        except ScrapeError as exc:
            assert exc.reason == "missing_metrics"


# --- transport ---------------------------------------------------------------------------


class PageServer:
    """A raw HTTP server whose answer each test sets (any bytes, even invalid HTTP)."""

    def __init__(self) -> None:
        self.answer = b""
        self.close_after = False
        self.port = 0
        self.requests = 0
        self.connections = 0

    def respond(self, body: bytes, *, status: int = 200, headers: bytes = b"") -> None:
        self.answer = (b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n" % (status, len(body)) + headers
                       + b"\r\n" + body)  # fmt: skip

    async def start(self) -> asyncio.AbstractServer:
        outer = self

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.t: asyncio.Transport = transport  # type: ignore[assignment]
                self.buf = b""
                outer.connections += 1

            def data_received(self, data: bytes) -> None:
                self.buf += data
                while b"\r\n\r\n" in self.buf:
                    _, _, self.buf = self.buf.partition(b"\r\n\r\n")
                    outer.requests += 1
                    self.t.write(outer.answer)
                    if outer.close_after:
                        self.t.close()

        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server


@pytest.fixture
async def page() -> AsyncIterator[PageServer]:
    srv = PageServer()
    server = await srv.start()
    yield srv
    server.close()


async def test_keep_alive_reuses_one_connection(page: PageServer) -> None:
    page.respond(GOOD)
    f = PageFetcher("127.0.0.1", page.port)
    for _ in range(5):
        assert await f.fetch(2.0) == GOOD
    assert page.connections == 1 and f.connects == 1
    page.close_after = True  # a server that closes after each answer still works
    for _ in range(3):
        assert await f.fetch(2.0) == GOOD
    f.close()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [(b"garbage\r\n\r\n", "bad_response"),
     (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "too_large"),
     (b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n", "bad_response"),
     (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx", "bad_response"),
     (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", "bad_response"),
     (b"HTTP/1.1 503 X\r\nContent-Length: 0\r\n\r\n", "http_status")],
)  # fmt: skip
async def test_malformed_answers_are_scrape_errors(page: PageServer, answer: bytes, reason: str) -> None:
    page.answer = answer
    f = PageFetcher("127.0.0.1", page.port)
    with pytest.raises(ScrapeError) as info:
        await f.fetch(2.0)
    assert info.value.reason == reason
    page.respond(GOOD)  # the next fetch works again
    assert await f.fetch(2.0) == GOOD
    f.close()


async def test_compression_bomb_is_cut_off_after_the_cap(page: PageServer) -> None:
    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB inflated, ~64 KB on the wire
    page.respond(bomb, headers=b"Content-Encoding: deflate\r\n")
    plain = PageFetcher("127.0.0.1", page.port, max_bytes=1 << 20)  # asked for identity
    with pytest.raises(ScrapeError) as info:
        await plain.fetch(5.0)
    assert info.value.reason == "bad_response" and "not asked for" in str(info.value)
    plain.close()
    f = PageFetcher("127.0.0.1", page.port, max_bytes=1 << 20, accept_gzip=True)
    with pytest.raises(ScrapeError) as info:
        await f.fetch(5.0)
    assert info.value.reason == "too_large"
    page.respond(gzip.compress(GOOD), headers=b"Content-Encoding: gzip\r\n")
    assert await f.fetch(2.0) == GOOD
    f.close()


async def test_oversized_chunked_page_is_too_large(page: PageServer) -> None:
    chunk = b"x" * 4096
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(40)) + b"0\r\n\r\n"
    page.answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    f = PageFetcher("127.0.0.1", page.port, max_bytes=64 << 10)
    with pytest.raises(ScrapeError) as info:
        await f.fetch(2.0)
    assert info.value.reason == "too_large"
    f.close()


async def test_silent_server_times_out(page: PageServer) -> None:
    page.answer = b""  # accepts, never answers
    f = PageFetcher("127.0.0.1", page.port)
    with pytest.raises(ScrapeError) as info:
        await f.fetch(0.2)
    assert info.value.reason == "timeout"
    f.close()


# --- the scraper keeps going ---------------------------------------------------------------


async def test_endpoint_recovers_after_any_bad_page(page: PageServer) -> None:
    ds = Datastore(stale_after_s=60)
    ep = Endpoint(endpoint_id("127.0.0.1", page.port), "127.0.0.1", page.port)
    ds.replace_all([ep])
    reg = CollectorRegistry()
    scraper = MetricsScraper(ds, EppMetrics(reg), ScrapeOptions(interval_s=0.01, timeout_s=1.0))
    bad_pages = [b"\xff\xfe not utf-8", GOOD.replace(b"2.0", b"NaN").replace(b"3.0", b"Inf")
                 .replace(b"0.5", b"-Inf"), b'vllm:num_requests_waiting{max_lora="\xc2\xb2"} 1' + b"9" * 5000]  # fmt: skip
    for bad in bad_pages:
        page.respond(bad)
        assert not await scraper.scrape_once(ep)
    await scraper.start()  # the poll task runs from here on
    try:
        page.respond(GOOD.replace(b"2.0", b"7"))
        async with asyncio.timeout(5):
            while (got := ds.get(ep.id)) is None or got.metrics.waiting != 7:
                await asyncio.sleep(0.01)
        assert reg.get_sample_value("epp_scrape_errors_total", {"endpoint": ep.id, "reason": "missing_metrics"}) == 3
    finally:
        await scraper.stop()


async def test_a_poll_task_that_dies_is_restarted_and_counted(
    page: PageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    page.respond(GOOD)
    ds = Datastore(stale_after_s=60)
    ep = Endpoint(endpoint_id("127.0.0.1", page.port), "127.0.0.1", page.port)
    ds.replace_all([ep])
    reg = CollectorRegistry()
    scraper = MetricsScraper(ds, EppMetrics(reg), ScrapeOptions(interval_s=0.01))
    real = MetricsScraper.scrape_once
    calls = [0]

    async def flaky(self: MetricsScraper, endpoint: Endpoint) -> bool:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("bug in the loop")
        return await real(self, endpoint)

    monkeypatch.setattr(MetricsScraper, "scrape_once", flaky)
    await scraper.start()
    try:
        async with asyncio.timeout(5):
            while not (got := ds.get(ep.id)) or not got.metrics.known:
                await asyncio.sleep(0.01)
        assert reg.get_sample_value("epp_background_task_failures_total", {"task": "scrape"}) == 1
    finally:
        await scraper.stop()
