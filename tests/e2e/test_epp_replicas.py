"""Several epp replicas behind the gateway, ext_proc streams round-robin over them, as Envoy's
ext_proc cluster spreads them: with index sync a prefix learnt by one replica steers the
other's picks too."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import Stack, start_stack
from tests.e2e.conftest import FAST, model_of, post

pytestmark = pytest.mark.e2e

SYSTEM = "You are the support assistant of a bakery; answer briefly and kindly. " * 40
"""~2,800 characters: long enough that the prefix score outweighs the load scores."""


@contextlib.asynccontextmanager
async def two_epps(sync: bool) -> AsyncIterator[Stack]:
    s = await start_stack(dataclasses.replace(FAST, replicas=4, epp_replicas=2, sync=sync))
    try:
        yield s
    finally:
        await s.stop()


async def _applied(http: aiohttp.ClientSession, metrics_url: str) -> float:
    async with http.get(metrics_url) as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "epp_sync_records_applied_total":
                return float(sample.value)
    return 0.0


async def _wait_applied_above(
    http: aiohttp.ClientSession, metrics_url: str, before: float, timeout_s: float = 10.0
) -> None:
    """Until the replica at ``metrics_url`` applied a record it did not have (readiness
    polling: a record travels within one 20 ms flush)."""
    deadline = time.monotonic() + timeout_s
    while await _applied(http, metrics_url) <= before:
        assert time.monotonic() < deadline, "the peer's index writes never arrived"
        await asyncio.sleep(0.005)  # poll interval


def _chat(stack: Stack, question: str) -> dict[str, object]:
    return {
        "model": model_of(stack),
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
    }


async def test_with_sync_a_prefix_routed_by_alternating_epp_replicas_stays_on_one_replica(
    http: aiohttp.ClientSession,
) -> None:
    async with two_epps(sync=True) as stack:
        await _alternate(stack, http)


async def _alternate(stack: Stack, http: aiohttp.ClientSession) -> None:
    assert len(stack.describe()["epp_grpcs"]) == 2
    assert all(e.sync for e in stack.epps)
    metrics = {e.grpc: e.metrics for e in stack.epps}
    picked, routed_by = [], []
    for i in range(6):
        streams = await stack.gateway.extproc_streams()
        before = {grpc: await _applied(http, url) for grpc, url in metrics.items()}
        status, headers, raw = await post(
            http, stack.gateway_url + "/v1/chat/completions", _chat(stack, f"question {i}")
        )
        assert status == 200, raw
        picked.append(headers[UPSTREAM_HOST_HEADER])
        (target,) = [t for t, n in (await stack.gateway.extproc_streams()).items()
                     if n > streams.get(t, 0)]
        routed_by.append(target)
        (peer,) = metrics.keys() - {target}  # it routes the next request
        await _wait_applied_above(http, metrics[peer], before[peer])
    assert set(routed_by) == set(metrics)
    assert all(a != b for a, b in itertools.pairwise(routed_by)), routed_by
    assert len(set(picked)) == 1, picked


async def test_without_sync_two_epp_replicas_still_serve_every_request(
    http: aiohttp.ClientSession,
) -> None:
    async with two_epps(sync=False) as stack:
        await _serve_without_sync(stack, http)


async def _serve_without_sync(stack: Stack, http: aiohttp.ClientSession) -> None:
    assert [e.sync for e in stack.epps] == [None, None]
    streams = await stack.gateway.extproc_streams()
    for i in range(4):
        status, headers, raw = await post(
            http, stack.gateway_url + "/v1/chat/completions", _chat(stack, f"question {i}")
        )
        assert status == 200, raw
        assert headers[UPSTREAM_HOST_HEADER] in stack.endpoints()
    after = await stack.gateway.extproc_streams()
    assert [after[e.grpc] - streams.get(e.grpc, 0) for e in stack.epps] == [2, 2]
    for epp in stack.epps:
        assert await _applied(http, epp.metrics) == 0
