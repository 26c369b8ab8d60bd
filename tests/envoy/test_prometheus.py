"""The Grafana dashboard against a real Prometheus (Debian's ``prometheus`` package): it
scrapes epp and the emulated model servers while traffic goes through real Envoy, and every
dashboard expression evaluates without error; each panel whose feature runs here has data,
and the error panels read 0 on a healthy pool instead of "No data". The panels of features
this run leaves off (flow control, KV events and the precise index, index sync, tracing) are listed in
``FEATURES_OFF`` and must be the only empty ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import yaml

from simulator.vllm import free_port
from tests.envoy.conftest import Pool, chat, pool, until_epp_routes
from tests.prometheus_tools import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana-dashboard.json"
SCRAPE_S = 1
RATE_INTERVAL = "15s"
"""What Grafana's ``$__rate_interval`` would be at this scrape interval and a short range."""
FEATURES_OFF = re.compile(r"flow_control|kv_events|precise_|sync_|tracing_")
"""Metric names of the features this run does not turn on: their panels may be empty."""


@contextlib.asynccontextmanager
async def prometheus(tmp_path: Path, epp_metrics: list[str], servers: list[str]) -> AsyncIterator[str]:
    """Prometheus scraping epp (job ``epp``) and the servers (job ``vllm``) every second."""
    binary = prometheus_tool("prometheus")
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": "epp", "static_configs": [{"targets": epp_metrics}]},
                                 {"job_name": "vllm", "static_configs": [{"targets": servers}]}]}  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115, ASYNC230 - handed to the child
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
    finally:
        log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                assert proc.returncode is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "prometheus did not get ready"
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/-/ready") as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.2)  # readiness poll
        yield url
    finally:
        proc.terminate()
        await proc.wait()


async def traffic(p: Pool, stop: asyncio.Event) -> int:
    """Closed-loop chat through Envoy (streamed and not) until ``stop``; the requests sent."""
    sent = 0

    async def worker(k: int, http: aiohttp.ClientSession) -> None:
        nonlocal sent
        i = 0
        while not stop.is_set():
            i += 1
            body = chat(f"user {k} turn {i}: tell me about bread " * 10, stream=i % 2 == 0, max_tokens=8)
            async with http.post(p.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            sent += 1

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(worker(k, http) for k in range(4)))
    return sent


async def query(http: aiohttp.ClientSession, url: str, expr: str) -> dict[str, object]:
    async with http.get(url + "/api/v1/query", params={"query": expr}) as r:
        return await r.json()  # type: ignore[no-any-return]


def expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


async def test_every_dashboard_expression_evaluates_and_has_data(tmp_path: Path) -> None:
    async with pool(tmp_path, replicas=3) as p, aiohttp.ClientSession() as http:
        await until_epp_routes(p, http)
        epp_metrics = [f"127.0.0.1:{e.metrics_port}" for e in p.epps]
        async with prometheus(tmp_path, epp_metrics, p.endpoints()) as url:
            stop = asyncio.Event()
            load = asyncio.create_task(traffic(p, stop))
            try:
                # until every target was scraped often enough for a rate over RATE_INTERVAL
                deadline = time.monotonic() + 60
                while True:
                    done = await query(http, url, f'count(count_over_time(up[{RATE_INTERVAL}]) >= 5)')
                    counted = done["data"]["result"]  # type: ignore[index]
                    if counted and int(counted[0]["value"][1]) == 1 + len(p.replicas):
                        break
                    assert time.monotonic() < deadline, "prometheus never scraped every target"
                    await asyncio.sleep(0.5)  # waits on Prometheus's scrapes
                results = {}
                for title, expr in expressions():
                    answer = await query(http, url, expr.replace("$__rate_interval", RATE_INTERVAL))
                    assert answer["status"] == "success", f"{title}: {expr}: {answer}"
                    results[(title, expr)] = answer["data"]["result"]  # type: ignore[index]
            finally:
                stop.set()
                sent = await load
    assert sent > 20
    assert len(results) == len(expressions()) >= 57
    empty = [(t, e) for (t, e), r in results.items() if not r]
    assert [e for _, e in empty if not FEATURES_OFF.search(e)] == [], empty
    # the error panels read 0 on a healthy pool, not "No data"
    ratios = [r for (t, _), r in results.items() if t == "Error ratio"]  # epp's answers, all errors
    assert len(ratios) == 2 and all([float(s["value"][1]) for s in r] == [0.0] for r in ratios), ratios
    by_model = [r for (t, e), r in results.items() if t == "Requests and errors by model" and "error" in e]
    assert by_model and all(float(s["value"][1]) == 0.0 for s in by_model[0])
