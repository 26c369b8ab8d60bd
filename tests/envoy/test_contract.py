"""The ext_proc contract as a client sees it through real Envoy, where it depends on Envoy's
side: body limits, client disconnects, fallback lists, the subset hint, more than 1,024
concurrent streams. (The API kinds, SSE, usage learning and epp's error statuses run through
Envoy in tests/e2e, where the local stack's gateway is real Envoy.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import DESTINATION_HEADER, SUBSET_NAMESPACE, UPSTREAM_HOST_HEADER, envoy_config
from simulator.envoy import start_envoy
from tests.envoy.conftest import MODEL, chat, free_port, pool

pytestmark = pytest.mark.e2e

BODY_MODES = [
    pytest.param({"request_body": "buffered"}, id="buffered-fail-open"),
    pytest.param({"request_body": "full-duplex", "failure": "closed"}, id="full-duplex"),
]


@pytest.mark.parametrize("mode", BODY_MODES)
async def test_json_and_sse_replies_arrive_intact_and_epp_learns_their_usage(
    tmp_path: Path, http: aiohttp.ClientSession, mode: dict[str, str]
) -> None:
    async with pool(tmp_path, **mode) as p:
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello " * 50)) as r:
            assert r.status == 200
            reply = await r.json()
            assert r.headers[UPSTREAM_HOST_HEADER] in p.endpoints()
        assert reply["usage"]["completion_tokens"] == 4
        async with http.post(p.url + "/v1/chat/completions",
                             json=chat("hello " * 50, stream=True, max_tokens=12)) as r:  # fmt: skip
            assert r.status == 200
            raw = (await r.read()).decode()
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 12
        # the second request found the first one's prompt where epp sent both
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        # epp learns from a reply once its last reply to Envoy is on the wire, so the client
        # can hold the whole stream a moment before the count moves
        deadline = time.monotonic() + 10
        while (seen := _sample(await _metrics(http, p.epps[0].metrics_port),
                               "epp_usage_completion_tokens_total")) < 16:  # fmt: skip
            assert time.monotonic() < deadline, f"epp counted {seen} completion tokens, not 16"
            await asyncio.sleep(0.05)  # poll
        assert seen == 16


@pytest.mark.parametrize("mode", BODY_MODES)
async def test_a_body_over_the_limit_gets_413_and_the_gateway_keeps_serving(
    tmp_path: Path, http: aiohttp.ClientSession, mode: dict[str, str]
) -> None:
    async with pool(tmp_path, max_request_bytes=1 << 20, epp_args=("--max-body-bytes", "1MiB"),
                    **mode) as p:  # fmt: skip
        huge = json.dumps(chat("x" * (2 << 20))).encode()
        async with http.post(p.url + "/v1/chat/completions", data=huge,
                             headers={"content-type": "application/json"}) as r:  # fmt: skip
            assert r.status == 413  # Envoy's buffer limit (buffered) or epp's cap (full-duplex)
        async with http.post(p.url + "/v1/chat/completions", json=chat("small")) as r:
            assert r.status == 200


async def test_a_client_that_leaves_mid_stream_releases_its_request_in_epp(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, speedup=1.0) as p:
        async with http.post(p.url + "/v1/chat/completions",
                             json=chat("tell me a long story", stream=True, max_tokens=400)) as r:  # fmt: skip
            assert r.status == 200
            await r.content.readline()  # the first event, then the client goes away
            r.close()
        deadline = time.monotonic() + 10
        while _sample(await _metrics(http, p.epps[0].metrics_port),
                      "epp_endpoint_in_flight_requests") > 0:  # fmt: skip
            assert time.monotonic() < deadline, "the abandoned request was never released"
            await asyncio.sleep(0.05)  # poll
        async with http.post(p.url + "/v1/chat/completions", json=chat("next")) as r:
            assert r.status == 200


async def test_with_epp_down_a_destination_list_falls_back_past_a_dead_server(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Envoy's side of epp's fallback list: the first name refuses, the next one serves."""
    async with pool(tmp_path) as p:
        dead = f"127.0.0.1:{free_port()}"
        options = dataclasses.replace(p.envoy.options, pool=(*p.endpoints(), dead))
        envoy = await start_envoy(options, tmp_path, name="envoy-dead")
        try:
            p.epps[0].kill()
            await p.epps[0].proc.wait()  # type: ignore[union-attr]
            alive = p.endpoints()[1]
            async with http.post(envoy.url + "/v1/chat/completions", json=chat("hi"),
                                 headers={DESTINATION_HEADER: f"{dead},{alive}"}) as r:  # fmt: skip
                assert r.status == 200
                assert r.headers[UPSTREAM_HOST_HEADER] == alive
        finally:
            await envoy.stop()


async def test_a_subset_hint_set_before_epp_bounds_its_choice(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=3) as p:
        allowed = p.endpoints()[2]
        raw = envoy_config(p.envoy.options)
        hcm = raw["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"]["http_filters"].insert(0, {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_NAMESPACE,
                              "value": {"x-gateway-destination-endpoint-subset": [allowed]}}],
            },
        })  # fmt: skip
        envoy = await start_envoy(p.envoy.options, tmp_path, name="envoy-subset", config=raw)
        try:
            for i in range(6):
                async with http.post(envoy.url + "/v1/chat/completions", json=chat(f"q{i}")) as r:
                    assert r.status == 200
                    assert r.headers[UPSTREAM_HOST_HEADER] == allowed
        finally:
            await envoy.stop()


async def test_more_than_1024_concurrent_streams_are_all_routed_by_epp(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Envoy caps a cluster at 1,024 concurrent requests unless told otherwise; every HTTP
    request holds an ext_proc stream, so past that the gateway would fail or go unrouted."""
    n = 1100
    async with pool(tmp_path, replicas=2, speedup=1.0, max_num_seqs=8) as p:
        peak = 0

        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 24}
            async with http.post(p.url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        while not all(t.done() for t in tasks):
            counters = await p.envoy.admin_json("/stats?format=json&filter=^cluster.epp.upstream_rq_active$")
            peak = max([peak, *(int(s.get("value", 0)) for s in counters["stats"])])
            await asyncio.sleep(0.2)  # sampling
        statuses = [t.result() for t in tasks]
        stats = await p.envoy.counters("http.inference.ext_proc.")
        overflow = await p.envoy.counters("cluster.epp.upstream_rq_pending_overflow")
    assert statuses == [200] * n
    assert peak > 1024
    assert stats["http.inference.ext_proc.failure_mode_allowed"] == 0  # none went unrouted
    assert stats["http.inference.ext_proc.streams_failed"] == 0
    assert sum(overflow.values()) == 0


async def _metrics(http: aiohttp.ClientSession, port: int) -> str:
    async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip
