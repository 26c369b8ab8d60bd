"""A model-server replica that dies mid-run: epp stops routing to it, clients keep being served."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from simulator.emulator import RunningEmulator
from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import start_stack
from tests.e2e.conftest import FAST, post

pytestmark = pytest.mark.e2e


async def test_a_dead_replica_leaves_the_rotation_and_requests_keep_succeeding(
    tmp_path: Path,
) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text("saturation: {metricsStalenessSeconds: 0.5}\n")  # default profile kept
    stack = await start_stack(dataclasses.replace(FAST, config=str(config)))
    try:
        (epp,) = [h for h in stack._inline if hasattr(h, "grpc_port")]
        replicas = [r for r in stack._inline if isinstance(r, RunningEmulator)]
        victim = replicas[0]
        dead = f"{victim.host}:{victim.port}"
        async with aiohttp.ClientSession() as http:
            body = {"model": stack.options.model, "prompt": "warm up " * 40, "max_tokens": 2}
            status, _, raw = await post(http, stack.gateway_url + "/v1/completions", body)
            assert status == 200, raw

            await victim.close()  # the replica and its /metrics are gone
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10.0
            while dead in {e.id for e in epp.datastore.routable()} and loop.time() < deadline:
                await asyncio.sleep(0.05)  # polling a condition: scrapes fail, then it is stale
            assert dead not in {e.id for e in epp.datastore.routable()}

            served = set()
            for i in range(12):
                body = {"model": stack.options.model, "prompt": f"request {i} " * 30, "max_tokens": 2}
                status, headers, raw = await post(http, stack.gateway_url + "/v1/completions", body)
                assert status == 200, raw
                served.add(headers[UPSTREAM_HOST_HEADER])
            assert dead not in served and len(served) == len(replicas) - 1
    finally:
        await stack.stop()
