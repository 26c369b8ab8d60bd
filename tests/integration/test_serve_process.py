"""`epp serve` as a process and `start_server` with scraping and the metrics port."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from epp.datastore.scraper import ScrapeOptions
from epp.framework.endpoint import Endpoint, endpoint_id
from epp.server.runner import ServerOptions, start_server
from tests.http_app import serve_app
from tests.integration import envoy_client as ec

ROOT = Path(__file__).resolve().parents[2]
VLLM_PAGE = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.2\n"


async def test_sigterm_reports_not_serving_and_exits_cleanly() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--endpoints", "127.0.0.1:1", "--grpc-port", "0",
        "--health-port", "0", "--metrics-port", "0", "--host", "127.0.0.1", "--no-scrape",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stderr is not None
    ports: dict[str, object] = {}
    while not ports:
        line = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert line, "epp exited before serving"
        record = json.loads(line)
        assert {"ts", "level", "logger", "msg"} <= set(record)
        if record["msg"].startswith("epp serving"):
            ports = dict(kv.split("=") for kv in record["msg"].split(": ", 1)[1].split() if "=" in kv)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['grpc']}") as ch:
        s = ec.Stream(ch)
        await s.send(ec.request_headers(), ec.request_body(b'{"model":"m","prompt":"p"}', True))
        assert ec.destination((await s.recv_n(2))[0]) == "127.0.0.1:1"
        proc.send_signal(signal.SIGTERM)
        # the open stream still completes during the drain
        await s.send(ec.response_headers(), ec.response_body(b"{}", True))
        assert len(await s.recv_n(2)) == 2
        assert await s.close() == grpc.StatusCode.OK
    rest = await asyncio.wait_for(proc.stderr.read(), 30)
    assert await proc.wait() == 0
    assert b"stopped" in rest


async def test_scraped_metrics_feed_the_pool_and_metrics_port() -> None:
    async def page(_: web.Request) -> web.Response:
        return web.Response(text=VLLM_PAGE)

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner, port = await serve_app(app)
    ep = Endpoint(endpoint_id("127.0.0.1", port), "127.0.0.1", port)
    updated = asyncio.Event()
    handle = await start_server(
        None, [ep],
        ServerOptions(host="127.0.0.1", grpc_port=0, health_port=-1, metrics_port=0, scraping=ScrapeOptions(interval_s=0.05)),
    )
    handle.datastore.on_metrics(lambda e: updated.set())
    try:
        await asyncio.wait_for(updated.wait(), 10)
        got = handle.datastore.get(ep.id)
        assert got is not None and got.metrics.kv_usage == 0.2 and not got.stale
        handle.metrics.refresh_pool(
            handle.datastore.snapshot(), handle.index.stats(), handle.datastore.in_flight()
        )
        url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        for name in ("epp_pool_ready_endpoints 1.0", "epp_pool_average_kv_cache_utilization 0.2",
                     "epp_endpoint_in_flight_requests{", "epp_prefix_index_entries", "epp_scrapes_total"):
            assert name in text, name
    finally:
        await handle.stop(0)
        await runner.cleanup()


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )
    return key, cert


async def test_tls_on_the_grpc_port(tls_files: tuple[Path, Path]) -> None:
    key, cert = tls_files
    handle = await start_server(
        None, [Endpoint(endpoint_id("10.0.0.1", 8000), "10.0.0.1", 8000)],
        ServerOptions(host="127.0.0.1", grpc_port=0, health_port=-1, metrics_port=-1, scrape=False,
                      cert_file=str(cert), key_file=str(key)),
    )
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{handle.grpc_port}", creds) as ch:
            s = ec.Stream(ch)
            await s.send(ec.request_headers(), ec.request_body(b'{"model":"m","prompt":"x"}', True))
            assert ec.destination((await s.recv_n(2))[0]) == "10.0.0.1:8000"
            s.call.cancel()
    finally:
        await handle.stop(0)


def log_until_serving(proc: subprocess.Popen[str]) -> str:
    """An ``epp serve`` process's log (text, on stderr) up to its ``epp serving`` line."""
    assert proc.stderr is not None
    seen = ""
    while "epp serving" not in seen:
        line = proc.stderr.readline()
        assert line, f"epp exited: {seen}"
        seen += line
    return seen


def test_serve_says_at_start_what_its_envoy_needs(tmp_path: Path) -> None:
    """Issue 69: the settings that span Envoy and epp are logged at start, from epp's own
    config (here flow control with a 12 s queue and a 1 MiB body cap)."""
    config = tmp_path / "epp.yaml"
    config.write_text("flowControl: {enabled: true, maxQueueSeconds: 12}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.cli", "serve", "--endpoints", "127.0.0.1:1", "--grpc-port", "0",
         "--health-port", "-1", "--metrics-port", "-1", "--host", "127.0.0.1", "--no-scrape",
         "--log-format", "text", "--config", str(config), "--max-body-bytes", "1MiB"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        seen = log_until_serving(proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    needs = next(line for line in seen.splitlines() if "the Envoy in front of this epp needs" in line)
    assert "message_timeout >= 17s" in needs and "flowControl.maxQueueSeconds" in needs
    assert "per_connection_buffer_limit_bytes <= 1048576 (--max-body-bytes)" in needs
    assert "skip flow control's queue" in needs  # fail-open's consequence, said
