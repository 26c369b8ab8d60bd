"""epp down, epp back, one of two epp replicas killed under load: through real Envoy with the
bootstrap ``epp envoy-config`` prints. Each phase waits for the event it is about (epp routed,
requests served in the outage, Envoy's health checks took a replica out), never a fixed sleep
that a slow host could cut short."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.envoy.conftest import Load, chat, pool

pytestmark = pytest.mark.e2e


async def until(what: str, done: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # polling Envoy's and epp's counters


def served_since(load: Load, at_s: float) -> int:
    return sum(o.status == 200 for o in load.outcomes if o.started_s >= at_s)


async def test_with_epp_killed_requests_are_served_and_routing_resumes_when_it_returns(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path) as p:
        epp = p.epps[0]
        stop = asyncio.Event()
        load = Load(p.url, http)
        task = asyncio.create_task(load.run_until(stop))

        async def routed_by_epp() -> bool:
            return await epp.routed() > 0

        await until("epp routes", routed_by_epp)
        killed_at = time.monotonic()
        epp.kill()
        await epp.proc.wait()  # type: ignore[union-attr]

        async def outage_served() -> bool:  # Envoy routes by itself meanwhile
            return served_since(load, killed_at) >= 20

        await until("20 requests served with epp down", outage_served)
        back_at = time.monotonic()
        await epp.start()  # the same port
        before = await epp.routed()

        async def routing_again() -> bool:  # Envoy's health check lets it back in
            hosts = await p.envoy.host_stats("epp")
            return hosts[epp.address]["healthy"] and await epp.routed() > before

        # how soon is bench_failover's figure (results/failover.md); here, that it does
        await until("Envoy sends epp requests again", routing_again, timeout_s=60.0)
        stop.set()
        await task
    during = [o for o in load.outcomes if killed_at <= o.started_s < back_at]
    assert len(during) >= 20
    served = sum(o.status == 200 for o in during)
    # Envoy skipped ext_proc and balanced over the pool itself
    assert served == len(during), [o.status for o in during if o.status != 200]
    assert {o.upstream for o in during} <= set(p.endpoints())
    assert len({o.upstream for o in during}) > 1
    failed = [o.status for o in load.outcomes if o.status != 200]
    # only requests in flight through epp when it was killed may fail (their stream died)
    assert len(failed) <= load.workers, failed


async def test_fail_closed_answers_500_when_epp_is_down(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, request_body="full-duplex", failure="closed") as p:
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello")) as r:
            assert r.status == 200
        p.epps[0].kill()
        await p.epps[0].proc.wait()  # type: ignore[union-attr]
        statuses = []
        for i in range(5):
            async with http.post(p.url + "/v1/chat/completions", json=chat(f"hi {i}")) as r:
                statuses.append(r.status)
    assert statuses == [500] * 5


async def test_one_of_two_epp_replicas_killed_under_load_fails_only_its_in_flight_requests(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, epps=2) as p:
        stop = asyncio.Event()
        load = Load(p.url, http, workers=8)
        task = asyncio.create_task(load.run_until(stop))
        victim, survivor = p.epps

        async def both_route() -> bool:
            return await victim.routed() > 0 and await survivor.routed() > 0

        await until("both replicas route", both_route)
        routed_before = await survivor.routed()
        in_flight_at_kill = load.in_flight
        killed_at = time.monotonic()
        victim.kill()

        async def taken_out() -> bool:  # Envoy's health checks, and traffic after them
            streams = await p.envoy.host_stats("epp")
            return not streams[victim.address]["healthy"] and served_since(load, killed_at) >= 30

        await until("the dead replica out of Envoy's rotation", taken_out)
        stop.set()
        await task
        assert await survivor.routed() > routed_before  # the survivor took over
        streams = await p.envoy.host_stats("epp")
    after = [o for o in load.outcomes if o.started_s > killed_at]
    assert len(after) >= 30
    assert all(o.status == 200 for o in after), [o.status for o in after if o.status != 200]
    failed = [o for o in load.outcomes if o.status != 200]
    assert len(failed) <= in_flight_at_kill
    assert not streams[victim.address]["healthy"]  # health checks took it out
