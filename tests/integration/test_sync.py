"""Index sync between real epp servers on loopback (docs/sync.md): a request routed by one
replica reaches the others' indexes, nothing echoes, and a peer that restarts is followed
again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable

import pytest

from epp.framework.endpoint import EndpointId
from epp.sync.load import SharedPrefill
from epp.sync.node import SyncNode, SyncOptions
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, pool, start_epp, stop_epp

PROMPT = "System: you answer questions about the shipping policy. " * 30


def sync_options(port: int = 0, share_prefill: bool = True) -> SyncOptions:
    return SyncOptions(port=port, flush_interval_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.3,
                       share_prefill=share_prefill)  # fmt: skip


async def start_replica(sync_port: int = 0, share_prefill: bool = True) -> Epp:
    return await start_epp(pool(4), sync=sync_options(sync_port, share_prefill))


def connect(replicas: list[Epp]) -> None:
    """Every replica follows every other one (what --peers / --peer-dns set up)."""
    for r in replicas:
        node = r.handle.sync
        assert node is not None
        node.peers.update(
            f"127.0.0.1:{o.handle.sync_port}" for o in replicas if o is not r
        )


def sync_of(r: Epp) -> SyncNode:
    assert r.handle.sync is not None
    return r.handle.sync


def applied(r: Epp) -> float:
    return r.handle.registry.get_sample_value("epp_sync_records_applied_total") or 0.0


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def connected(r: Epp, others: list[Epp]) -> bool:
    return sync_of(r).connected >= {f"127.0.0.1:{o.handle.sync_port}" for o in others}


async def route(r: Epp, prompt: str) -> EndpointId:
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    s = ec.Stream(r.channel)
    await s.send(ec.request_headers(), ec.request_body(body, True))
    headers, _ = await s.recv_n(2)
    s.call.cancel()
    dest = ec.destination(headers)
    assert dest is not None
    return EndpointId(dest)


def holds(r: Epp, dest: EndpointId, chunks: set[int]) -> bool:
    return bool(chunks) and chunks <= set(r.handle.index.chunks_of(dest))


@pytest.fixture
async def trio() -> AsyncIterator[list[Epp]]:
    replicas = [await start_replica() for _ in range(3)]
    connect(replicas)
    yield replicas
    for r in replicas:
        await stop_epp(r)


async def test_a_routing_decision_reaches_every_peer_once(trio: list[Epp]) -> None:
    a, b, c = trio
    await until(lambda: all(connected(r, [o for o in trio if o is not r]) for r in trio),
                "peers connected")

    dest = await route(a, PROMPT)
    chunks = set(a.handle.index.chunks_of(dest))
    assert len(chunks) == len(PROMPT) // 64
    await until(lambda: holds(b, dest, chunks) and holds(c, dest, chunks), "peers hold A's chunks")

    # B now routes the same prefix to where A sent it, from what A taught it
    assert await route(b, PROMPT + " Question: can I return a gift?") == dest
    await until(lambda: applied(c) == 2, "C applied A's and B's writes")
    dest_c = await route(c, "Unrelated: summarise this contract for me, please. " * 20)
    chunks_c = set(c.handle.index.chunks_of(dest_c))
    await until(lambda: holds(a, dest_c, chunks_c) and holds(b, dest_c, chunks_c), "C's write")
    # A peer's stream is in order, and C wrote after it had applied A's and B's writes, so
    # had anybody republished (echoed) a write it applied, the copy would have arrived by
    # now: each replica applied exactly the two other replicas' own writes.
    assert [sync_of(r).outbox.published for r in trio] == [1, 1, 1]
    assert [applied(r) for r in trio] == [2, 2, 2]


async def test_a_restarted_peer_is_followed_again() -> None:
    a, b = await start_replica(), await start_replica()
    try:
        connect([a, b])
        await until(lambda: connected(a, [b]) and connected(b, [a]), "peers connected")
        port = b.handle.sync_port
        await stop_epp(b)
        await until(lambda: not connected(a, [b]), "A notices B is gone")

        # A keeps serving while B is down (its follower retries in the background)
        dest = await route(a, PROMPT)
        assert dest

        b = await start_replica(port)
        connect([a, b])
        await until(lambda: connected(a, [b]) and connected(b, [a]), "A follows the new B")
        dest = await route(b, "A different system prompt about returns. " * 20)
        chunks = set(b.handle.index.chunks_of(dest))
        await until(lambda: holds(a, dest, chunks), "A holds the restarted B's chunks")
    finally:
        await stop_epp(a)
        await stop_epp(b)


async def test_a_replica_listed_as_its_own_peer_ignores_itself() -> None:
    a = await start_replica()
    try:
        sync = sync_of(a)
        sync.peers.update([f"127.0.0.1:{a.handle.sync_port}"])
        await until(lambda: all(t.done() for t in sync.peers._tasks.values()), "self detected")
        await route(a, PROMPT)
        assert applied(a) == 0
        assert not sync.connected
        sync.refresh_metrics()
        assert a.handle.registry.get_sample_value("epp_sync_peers") == 0
    finally:
        await stop_epp(a)


async def test_sync_metrics_are_exposed(trio: list[Epp]) -> None:
    a = trio[0]
    await until(lambda: connected(a, trio[1:]), "peers connected")
    sync_of(a).refresh_metrics()
    reg = a.handle.registry
    assert reg.get_sample_value("epp_sync_peers") == 2
    assert reg.get_sample_value("epp_sync_peers_connected") == 2
    await route(a, PROMPT)
    sync_of(a).refresh_metrics()
    assert reg.get_sample_value("epp_sync_records_published_total") == 1
    await until(lambda: reg.get_sample_value("epp_sync_records_sent_total") == 2, "sent to both")



async def test_a_replicas_prefill_in_flight_reaches_its_peers_until_it_ends() -> None:
    """Each replica counts the prefill it has in flight per endpoint (its prefill ledger);
    its peers add it to their own (docs/sync.md). It leaves them when the request's response
    starts or the request ends, and with the replica."""
    a, b = await start_replica(), await start_replica()
    try:
        connect([a, b])
        await until(lambda: connected(a, [b]) and connected(b, [a]), "peers connected")
        counter: SharedPrefill = a.handle.datastore.prefill
        body = json.dumps({"model": "m", "prompt": PROMPT}).encode()

        async def open_request() -> tuple[ec.Stream, EndpointId, float]:
            s = ec.Stream(a.channel)
            await s.send(ec.request_headers(), ec.request_body(body, True))
            headers, _ = await s.recv_n(2)
            dest = ec.destination(headers)
            assert dest is not None
            own = counter.prefill_in_flight().get(EndpointId(dest), 0.0)
            assert own > 0  # the prompt's tokens, none cached yet
            return s, EndpointId(dest), own

        s, dest, own = await open_request()
        peer = sync_of(b).peer_prefill
        await until(lambda: peer.tokens(dest) == own, "B sees A's prefill in flight")
        sync_of(b).refresh_metrics()  # housekeeping exports it
        assert b.handle.registry.get_sample_value("epp_sync_peer_prefill_tokens") == own
        s.call.cancel()  # the client went away: A no longer has it in flight
        await until(lambda: peer.tokens(dest) == 0, "A's prefill leaves B with its request")

        s, dest, own = await open_request()
        await until(lambda: peer.tokens(dest) == own, "B sees A's next request")
        await stop_epp(a)
        await until(lambda: peer.tokens(dest) == 0 and peer.peers == 0, "A's prefill leaves with A")
    finally:
        with contextlib.suppress(Exception):
            await stop_epp(a)
        await stop_epp(b)


async def test_without_prefill_sharing_only_the_index_travels() -> None:
    a, b = await start_replica(share_prefill=False), await start_replica(share_prefill=False)
    try:
        connect([a, b])
        await until(lambda: connected(a, [b]) and connected(b, [a]), "peers connected")
        s = ec.Stream(a.channel)
        body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
        await s.send(ec.request_headers(), ec.request_body(body, True))
        headers, _ = await s.recv_n(2)
        dest = EndpointId(ec.destination(headers) or "")
        chunks = set(a.handle.index.chunks_of(dest))
        # the index travels: the batch that brought these chunks is the one that would carry
        # the prefill the same pick queued (both are recorded in one step of the loop, and a
        # batch carries the prefill set whenever it changed), so no wait is needed after it
        await until(lambda: holds(b, dest, chunks), "B holds A's chunks")
        assert sync_of(b).peer_prefill.peers == 0 and sync_of(b).peer_prefill.tokens(dest) == 0
        s.call.cancel()
    finally:
        await stop_epp(a)
        await stop_epp(b)
