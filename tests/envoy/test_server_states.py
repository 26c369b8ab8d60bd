"""Servers that sleep and pools that scale from zero, through real Envoy and ``epp serve``
(issue 69)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import EppProcess, chat, pool, until_epp_routes

pytestmark = pytest.mark.e2e


async def until_metric(epp: EppProcess, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await epp.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.05)  # scrapes run every 0.2 s


async def test_a_sleeping_server_gets_no_request_while_another_serves_and_traffic_after_waking(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=2) as p:
        await until_epp_routes(p, http)
        sleeper, other = p.replicas
        epp = p.epps[0]
        async with http.post(sleeper.url + "/sleep?level=1") as r:  # vLLM's dev endpoint
            assert r.status == 200
        await until_metric(epp, "epp_endpoint_not_serving", 1)
        before = sleeper.emulator.requests_received
        upstreams = []
        for i in range(12):
            async with http.post(p.url + "/v1/chat/completions", json=chat(f"asleep {i}")) as r:
                assert r.status == 200
                upstreams.append(r.headers[UPSTREAM_HOST_HEADER])
        assert sleeper.emulator.requests_received == before  # 0 requests while asleep
        assert set(upstreams) == {other.url.removeprefix("http://")}
        async with http.post(sleeper.url + "/wake_up") as r:
            assert r.status == 200
        await until_metric(epp, "epp_endpoint_not_serving", 0)
        for i in range(16):
            async with http.post(p.url + "/v1/chat/completions",
                                 json=chat(f"awake {i} " + "new topic " * i)) as r:  # fmt: skip
                assert r.status == 200
        assert sleeper.emulator.requests_received > before  # it gets traffic again
        assert await epp.metric("epp_endpoint_not_serving_transitions_total") == 1
