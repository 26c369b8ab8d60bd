"""Servers that sleep and pools that scale from zero, through real Envoy and ``epp serve``
(issue 69)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from epp.envoyconfig import UPSTREAM_HOST_HEADER, EnvoyOptions
from simulator.envoy import start_envoy, with_ports
from simulator.stack import child
from tests.envoy.conftest import EppProcess, chat, pool, until_epp_routes
from tests.envoy.test_cluster_settings import bootstrap
from tests.fake_k8s import OBJECTIVES, PODS, POOLS, FakeKubeApi, pod
from tests.fake_k8s import pool as inference_pool
from tests.integration.test_k8s_serve import kubeconfig

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


async def test_scale_from_zero_requests_wait_for_the_first_ready_endpoint(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The pool has no ready endpoint (its one pod is starting); 20 requests arrive and
    wait in epp; the pod becomes ready after 8 s and serves all 20; the 21st, beyond
    ``scaleFromZeroMaxRequests``, gets 503 ``rejected-no-endpoints``; the waiting-demand
    gauge rises to 20 and falls to 0."""
    api = FakeKubeApi()
    for collection in (PODS(), POOLS(), OBJECTIVES()):
        api.create_collection(collection)
    api.start()
    (server,) = await child.start_replicas(1, 20.0, "meta-llama/Llama-3.1-8B-Instruct", None, None)
    config = tmp_path / "epp.yaml"
    config.write_text(yaml.safe_dump({"flowControl": {"enabled": True,
                                                      "scaleFromZeroMaxRequests": 20}}))  # fmt: skip
    api.put(POOLS(), inference_pool("llama", {"app": "vllm"}, [server.port]))
    api.put(PODS(), pod("llama-0", "127.0.0.1", ready=False))  # scaled up, still starting
    env = {"KUBECONFIG": str(kubeconfig(tmp_path, api.host))}  # added to this environment
    epp = EppProcess([], tmp_path / "epp.log", env=env,
                     extra=("--config", str(config), "--pool-name", "llama"))  # fmt: skip
    envoy = None
    try:
        await epp.start()
        doc = bootstrap(epp.address, f"127.0.0.1:{server.port}", config, "--upstream-host-header")
        envoy = await start_envoy(with_ports(EnvoyOptions()), tmp_path, config=doc)

        async def ask(i: int) -> tuple[int, str, str]:
            async with http.post(envoy.url + "/v1/chat/completions", json=chat(f"cold {i}")) as r:
                await r.read()
                return r.status, r.headers.get(UPSTREAM_HOST_HEADER, ""), r.headers.get(
                    "x-llm-d-request-dropped-reason", "")

        waiting = [asyncio.create_task(ask(i)) for i in range(20)]
        await until_metric(epp, "epp_pool_waiting_requests", 20)
        overflow = await ask(99)
        assert overflow[0] == 503 and overflow[2] == "rejected-no-endpoints"
        await asyncio.sleep(8.0)  # the pod starts
        assert not any(t.done() for t in waiting)  # still waiting, none answered 503
        assert await epp.metric("epp_pool_waiting_requests") == 20
        api.put(PODS(), pod("llama-0", "127.0.0.1", ready=True))
        answers = await asyncio.gather(*waiting)
        assert [a[0] for a in answers] == [200] * 20
        assert {a[1] for a in answers} == {f"127.0.0.1:{server.port}"}
        assert server.emulator.requests_received == 20
        await until_metric(epp, "epp_pool_waiting_requests", 0)
    finally:
        if envoy is not None:
            await envoy.stop()
        await epp.stop()
        await server.close()
        api.close()
