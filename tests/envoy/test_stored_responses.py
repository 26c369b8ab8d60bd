"""Stored Responses through real Envoy and ``epp serve`` processes, on emulated servers that
keep responses as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1 (404 from any server but
the one that produced it): a conversation's follow-ups, among other traffic, reach the home
server; so do retrieval and cancel; with two epp replicas syncing, whichever routes a
follow-up sends it home."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import MODEL, Pool, chat, pool, until_epp_routes

FOLLOW_UPS = 8


async def respond(http: aiohttp.ClientSession, p: Pool, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    async with http.post(p.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 4, **body}) as r:
        return r.status, await r.json(), r.headers.get(UPSTREAM_HOST_HEADER, "")


async def other_traffic(http: aiohttp.ClientSession, p: Pool, turn: int) -> set[str]:
    """Chats and new conversations at once, between two follow-ups: they move the load."""

    async def one(k: int) -> str:
        if k % 2:
            async with http.post(p.url + "/v1/chat/completions",
                                 json=chat(f"other traffic {turn}.{k}: " + "lorem ipsum " * 40)) as r:  # fmt: skip
                await r.read()
                return r.headers.get(UPSTREAM_HOST_HEADER, "")
        return (await respond(http, p, {"input": f"a new conversation {turn}.{k}"}))[2]

    return set(await asyncio.gather(*(one(k) for k in range(6))))


async def conversation(
    http: aiohttp.ClientSession, p: Pool, turns: int = FOLLOW_UPS, previous: str = "",
    settle: Callable[[], Awaitable[None]] | None = None,
) -> tuple[str, list[str], set[str], str]:
    """A stored conversation (continuing ``previous`` when given): its first response's
    server, each follow-up's server, the other traffic's servers, and the last response id.
    ``settle`` is awaited before each follow-up."""
    home = ""
    if not previous:
        status, first, home = await respond(http, p, {"input": "Let us plan a trip to Lisbon."})
        assert status == 200, first
        previous = first["id"]
    served: list[str] = []
    others: set[str] = set()
    for turn in range(turns):
        others |= await other_traffic(http, p, turn)
        if settle is not None:
            await settle()
        status, out, upstream = await respond(http, p, {"input": f"and day {turn + 1}?",
                                                        "previous_response_id": previous})  # fmt: skip
        assert status == 200, (turn, out)  # any other server answers 404
        served.append(upstream)
        previous = out["id"]
    return home, served, others, previous


async def test_follow_ups_retrieve_and_cancel_reach_the_server_holding_the_response(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=4) as p:
        await until_epp_routes(p, http)
        home, served, others, _ = await conversation(http, p)
        assert served == [home] * FOLLOW_UPS
        assert len(others) > 1  # the rest of the traffic spread over the pool
        status, first, _ = await respond(http, p, {"input": "Another one, to retrieve."})
        async with http.get(f"{p.url}/v1/responses/{first['id']}") as r:
            assert r.status == 200 and (await r.json())["id"] == first["id"]
        # a long background response, cancelled while it runs
        status, queued, bg_home = await respond(http, p, {"input": "Write a long essay.", "background": True,
                                                          "max_output_tokens": 20_000})  # fmt: skip
        assert status == 200 and queued["status"] == "queued"
        for _ in range(3):  # retrieval while it runs
            async with http.get(f"{p.url}/v1/responses/{queued['id']}") as r:
                assert r.status == 200 and r.headers[UPSTREAM_HOST_HEADER] == bg_home
        async with http.post(f"{p.url}/v1/responses/{queued['id']}/cancel") as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["status"] == "cancelled"
        assert await p.epps[0].metric("epp_response_affinity_requests_total", 'outcome="home"') == FOLLOW_UPS + 5


async def synced(p: Pool) -> None:
    """Until every response either replica learnt has reached the other: a follow-up sent
    before its id reached the replica that routes it finds no home yet (docs/sync.md), and
    on a loaded machine one message between the replicas can take longer than the test's
    other traffic between two turns."""
    name = "epp_response_affinity_learned_total"
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        own = [await e.metric(name, 'source="response"') for e in p.epps]
        peer = [await e.metric(name, 'source="peer"') for e in p.epps]
        if peer == own[::-1]:
            return
        assert asyncio.get_running_loop().time() < deadline, (own, peer)
        await asyncio.sleep(0.01)  # readiness poll


async def test_two_epp_replicas_syncing_send_each_follow_up_home(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=4, epps=2, sync=True) as p:
        await until_epp_routes(p, http)
        deadline = asyncio.get_running_loop().time() + 30
        for e in p.epps:  # readiness: both scrape the pool, and follow each other
            while (await e.ready_endpoints() < len(p.replicas)
                   or await e.metric("epp_sync_peers_connected") < 1):  # fmt: skip
                assert asyncio.get_running_loop().time() < deadline, "the replicas never synced"
                await asyncio.sleep(0.05)  # readiness poll
        home, served, _, last = await conversation(http, p, settle=functools.partial(synced, p))
        # Envoy spreads the ext_proc streams over both replicas: each must have routed
        # follow-ups home, from ids the other one learnt too (more turns until it has)
        routed = [0.0, 0.0]
        for _ in range(4):
            routed = [await e.metric("epp_response_affinity_requests_total", 'outcome="home"')
                      for e in p.epps]  # fmt: skip
            if min(routed) >= 2:
                break
            _, more, _, last = await conversation(http, p, 4, last, functools.partial(synced, p))
            served += more
        assert served == [home] * len(served) and min(routed) >= 2, (served, routed)
        assert sum(routed) == len(served)
        for e in p.epps:
            assert await e.metric("epp_response_affinity_requests_total", 'outcome="unknown"') == 0
            assert await e.metric("epp_response_affinity_learned_total", 'source="peer"') > 0
