"""KV-cache events end to end over real ZMQ sockets: the emulator publishes vLLM's wire
format with vLLM's block hashes (tokenizer + sha256_cbor), epp's subscriber applies them to
the precise producer, whose keys for the same request body match; a late subscriber is
repaired through the replay socket; a hostile publisher is counted, never fatal."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.request import ApiKind, InferenceRequest
from epp.plugins.preciseprefix import PreciseIndexConfig, PrecisePrefixProducer
from epp.plugins.preciseprefix.events import Kind, KvEvent, encode
from epp.plugins.preciseprefix.subscriber import KvEventSubscriber
from simulator.emulator import EmulatorConfig, RunningEmulator, start_emulator
from tests.wordlevel import write_tokenizer

pytestmark = pytest.mark.asyncio
MODEL = "m"
WORDS = ["hello", "world", "how", "are", "you", "the", "parcel", "order", "shipping", "desk", "is", "late"]


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    return write_tokenizer(tmp_path / "tok")


def chat_body(seed: int, n: int = 120, system: str = "the shipping desk " * 20) -> dict[str, object]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": text}]}  # fmt: skip


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.01)  # polling a condition another task makes true
    except TimeoutError:
        raise AssertionError(f"not {what} within {timeout_s} s") from None


async def post(http: aiohttp.ClientSession, emu: RunningEmulator, body: dict[str, object]) -> None:
    async with http.post(f"{emu.url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()


def keys_of(p: PrecisePrefixProducer, body: dict[str, object]) -> list[int]:
    keyed = p.keyer.keys(InferenceRequest("r", MODEL, "", api=ApiKind.CHAT, body=body))
    assert not isinstance(keyed, str), keyed
    return list(keyed.keys)


async def test_epp_keys_equal_the_emulators_published_blocks(
    tokenizer: Path, http: aiohttp.ClientSession
) -> None:
    params = PreciseIndexConfig(block_size=16, tokenizers={MODEL: str(tokenizer)},
                                events_mode="bind", events_endpoint="tcp://127.0.0.1:0")  # fmt: skip
    producer = PrecisePrefixProducer.from_params("precise", params)
    sub = KvEventSubscriber(producer)
    task = asyncio.create_task(sub.run())
    await until(lambda: bool(sub.bound_endpoint), "bound")
    emu = await start_emulator(EmulatorConfig(model=MODEL, block_size=16, tokenizer=str(tokenizer),
                                              kv_events=sub.bound_endpoint))  # fmt: skip
    eid = EndpointId(f"127.0.0.1:{emu.port}")
    producer.observe_endpoint(Endpoint(eid, "127.0.0.1", emu.port))
    try:
        # the first batches may be lost while the connection forms (PUB/SUB): warm up with
        # new prompts (new blocks, new events) until one arrives
        for i in range(200):
            await post(http, emu, chat_body(200 + i))
            if producer.mode(eid, 0.0) != "approximate":
                break
        assert producer.mode(eid, 0.0) != "approximate"
        # a system prompt of its own: blocks stored before the subscription formed are never
        # announced again (vLLM announces a block once), so the keys must all be new
        body = chat_body(1, system="how are you " * 20)
        keys = keys_of(producer, body)
        assert len(keys) >= 10
        assert producer.index.match(keys, [eid], 0.0) == {}
        await post(http, emu, body)
        await until(lambda: producer.index.match(keys, [eid], 0.0) == {eid: len(keys)}, "stored")
        assert sum(n for (e, _), n in producer.stats.events.items() if e == eid) >= 2
    finally:
        await emu.close()
        task.cancel()
        await sub.close()


async def test_a_late_subscriber_catches_up_through_the_replay_socket(
    tokenizer: Path, http: aiohttp.ClientSession
) -> None:
    emu = await start_emulator(EmulatorConfig(
        model=MODEL, block_size=16, tokenizer=str(tokenizer),
        kv_events="tcp://*:0", kv_events_replay="tcp://127.0.0.1:0"))  # fmt: skip
    pub = emu.emulator.publisher
    assert pub is not None
    events_port = int(pub.endpoint.rsplit(":", 1)[1])
    replay_port = int(pub.replay_endpoint.rsplit(":", 1)[1])
    params = PreciseIndexConfig(block_size=16, tokenizers={MODEL: str(tokenizer)},
                                events_port=events_port, replay_port=replay_port)  # fmt: skip
    producer = PrecisePrefixProducer.from_params("precise", params)
    sub = KvEventSubscriber(producer)
    eid = EndpointId(f"127.0.0.1:{emu.port}")
    try:
        early = chat_body(2)
        await post(http, emu, early)  # published before anyone listens: lost to PUB/SUB
        await until(lambda: pub.seq >= 1, "published")
        producer.on_endpoints(sub.endpoint_changed)
        producer.observe_endpoint(Endpoint(eid, "127.0.0.1", emu.port))  # connect mode
        keys = keys_of(producer, early)
        for i in range(200):  # until the reader's subscription is in place and a batch lands
            await post(http, emu, chat_body(100 + i))  # new blocks each time: new events
            if producer.stats.replays:
                break
        stats = producer.stats
        await until(lambda: stats.replays["complete"] == 1,
                    f"replayed ({stats.replays}, gaps {stats.gaps}, events {stats.events}, "
                    f"dropped {stats.dropped}, readers {list(sub._readers)})")
        assert producer.mode(eid, 0.0) == "live" and producer.stats.gaps[eid] == 1
        assert producer.index.match(keys, [eid], 0.0) == {eid: len(keys)}  # learnt by replay
    finally:
        await sub.close()
        await emu.close()


async def test_garbage_on_the_event_socket_is_counted_and_reading_goes_on(tokenizer: Path) -> None:
    params = PreciseIndexConfig(block_size=16, events_mode="bind",
                                events_endpoint="tcp://127.0.0.1:0")  # fmt: skip
    producer = PrecisePrefixProducer("precise", params)
    eid = EndpointId("10.0.0.1:8000")
    producer.observe_endpoint(Endpoint(eid, "10.0.0.1", 8000))
    sub = KvEventSubscriber(producer)
    task = asyncio.create_task(sub.run())
    await until(lambda: bool(sub.bound_endpoint), "bound")
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(sub.bound_endpoint)
    from epp.plugins.preciseprefix.events import Kind, KvEvent, encode

    good = encode(f"kv@{eid}@m", 0, 1.0, [KvEvent(Kind.STORED, [1, 2], "GPU", None, 16)])
    try:
        for _ in range(500):  # until the connection is up and a good batch lands
            await pub.send_multipart([b"kv@10.0.0.1:8000@m", b"\x00" * 8, b"\xc1garbage"])
            await pub.send_multipart([b"kv@10.9.9.9:1@m", *good[1:]])
            await pub.send_multipart([b"just one frame"])
            await pub.send_multipart(good)
            await asyncio.sleep(0.01)
            if producer.index.blocks(eid):
                break
        reasons = {r for (_, r) in producer.stats.dropped}
        assert {"bad-message", "unknown-topic"} <= reasons
        assert producer.index.match([1, 2], [eid], 0.0) == {eid: 2}
        assert not task.done()
    finally:
        task.cancel()
        await sub.close()
        ctx.destroy(linger=0)


async def test_epp_serve_keys_off_the_event_loop_and_routes_by_events(tokenizer: Path) -> None:
    """Through ext_proc: the precise producer tokenizes in a worker thread before the pick,
    the pick follows the blocks an endpoint's events announced, and a fresh prompt's pick is
    held speculatively for the next one (before any event)."""
    from epp.config.loader import default_config
    from epp.plugins.preciseprefix.events import EventBatch, Kind, KvEvent
    from tests.integration import envoy_client as ec
    from tests.integration.extproc_fixtures import config_with, start_epp, stop_epp

    raw = dict(default_config().raw)
    raw["plugins"] = [*raw["plugins"], {
        "type": "precise-prefix-cache-producer",
        "parameters": {"blockSize": 4, "tokenizers": {MODEL: str(tokenizer)},
                       "eventsMode": "bind", "eventsEndpoint": "tcp://127.0.0.1:0"},
    }]  # fmt: skip
    epp = await start_epp(config=config_with(raw))
    try:
        producer = epp.handle.scheduler.plugin(PrecisePrefixProducer)
        assert producer is not None and epp.handle.director.prepares
        ids = [e.id for e in epp.handle.datastore.snapshot()]
        for e in epp.handle.datastore.snapshot():
            producer.observe_endpoint(e)

        async def route(body: dict[str, object]) -> str:
            s = ec.Stream(epp.channel)
            await s.send(ec.request_headers(path="/v1/chat/completions"),
                         ec.request_body(json.dumps(body).encode(), True))  # fmt: skip
            headers, _ = await s.recv_n(2)
            s.call.cancel()
            return str(ec.destination(headers))

        body = chat_body(5, n=60)
        keys = keys_of(producer, body)
        target = ids[2]
        producer.apply(target, EventBatch("t", 0, 0.0, [KvEvent(Kind.STORED, keys, "GPU", None, 4)]), 0.0)
        for e in ids:  # every endpoint has spoken, so the index is trusted for all
            if e != target:
                producer.apply(e, EventBatch("t", 0, 0.0, [KvEvent(Kind.STORED, [7], "GPU", None, 4)]), 0.0)
        before = producer.keyer.count  # type: ignore[attr-defined]
        assert await route(body) == target
        # keyed once, in the worker: the request carried its keys to the pick
        assert producer.keyer.count == before + 1  # type: ignore[attr-defined]
        fresh = chat_body(6, n=60)
        first = await route(fresh)
        assert await route(fresh) == first  # the speculative entries hold it
        assert not producer.stats.unkeyed
    finally:
        await stop_epp(epp)


async def test_a_reader_that_fails_is_counted_and_restarted(
    tokenizer: Path, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = await start_emulator(EmulatorConfig(model=MODEL, block_size=16, tokenizer=str(tokenizer),
                                              kv_events="tcp://*:0"))  # fmt: skip
    pub = emu.emulator.publisher
    assert pub is not None
    params = PreciseIndexConfig(block_size=16, tokenizers={MODEL: str(tokenizer)},
                                events_port=int(pub.endpoint.rsplit(":", 1)[1]))  # fmt: skip
    producer = PrecisePrefixProducer.from_params("precise", params)
    failures: list[str] = []
    sub = KvEventSubscriber(producer, on_failure=failures.append)
    original = KvEventSubscriber._handle
    calls = [0]

    async def flaky(self: KvEventSubscriber, endpoint_id: EndpointId, frames: list[bytes]) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a bug in the first batch")
        await original(self, endpoint_id, frames)

    monkeypatch.setattr(KvEventSubscriber, "_handle", flaky)
    eid = EndpointId(f"127.0.0.1:{emu.port}")
    try:
        producer.on_endpoints(sub.endpoint_changed)
        producer.observe_endpoint(Endpoint(eid, "127.0.0.1", emu.port))
        for i in range(300):
            await post(http, emu, chat_body(400 + i))
            if sum(producer.stats.events.values()):
                break
        assert failures == ["kv-events-reader"]
        assert producer.stats.dropped[(eid, "reader-error")] == 1
        assert sum(producer.stats.events.values()) > 0  # the restarted reader applies events
    finally:
        await sub.close()
        await emu.close()


def _two_free_ports(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, int]:
    """Two PUB sockets bound on consecutive ports (a rank's events port is offset by its rank)."""
    for _ in range(50):
        first = ctx.socket(zmq.PUB)
        port = first.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
        second = ctx.socket(zmq.PUB)
        try:
            second.bind(f"tcp://127.0.0.1:{port + 1}")
        except zmq.ZMQError:
            first.close(linger=0)
            second.close(linger=0)
            continue
        return first, second, port
    raise AssertionError("no two consecutive free ports")


async def test_data_parallel_ranks_are_endpoints_with_their_own_event_sockets() -> None:
    """Two ranks on one host (one address, two serving ports): each rank's events come from
    eventsPort + rank and land on that rank's endpoint only; one rank's publisher dying leaves
    the other's events flowing."""
    ctx = zmq.asyncio.Context.instance()
    pub0, pub1, port = _two_free_ports(ctx)
    params = PreciseIndexConfig(block_size=16, events_port=port)
    producer = PrecisePrefixProducer("precise", params)
    sub = KvEventSubscriber(producer)
    producer.on_endpoints(sub.endpoint_changed)
    rank0, rank1 = EndpointId("127.0.0.1:9001"), EndpointId("127.0.0.1:9002")
    producer.observe_endpoint(Endpoint(rank0, "127.0.0.1", 9001))
    producer.observe_endpoint(Endpoint(rank1, "127.0.0.1", 9002, rank=1))
    seq = [0, 0]

    async def publish(sock: zmq.asyncio.Socket, rank: int, keys: list[int]) -> None:
        await sock.send_multipart(encode("kv", seq[rank], 0.0, [KvEvent(Kind.STORED, keys, "GPU", None, 16)],
                                         dp_rank=rank))  # fmt: skip
        seq[rank] += 1

    def holds(eid: EndpointId, keys: list[int]) -> bool:
        return producer.index.match(keys, [eid], 0.0) == {eid: len(keys)}

    try:
        for i in range(400):  # PUB/SUB: batches before the subscriptions form are lost
            await publish(pub0, 0, [1000 + i])
            await publish(pub1, 1, [2000 + i])
            await asyncio.sleep(0.01)
            if holds(rank0, [1000 + i]) and holds(rank1, [2000 + i]):
                break
        await publish(pub0, 0, [11, 12])
        await publish(pub1, 1, [21, 22])
        await until(lambda: holds(rank0, [11, 12]) and holds(rank1, [21, 22]), "each rank's blocks")
        assert producer.index.match([21, 22], [rank0], 0.0) == {}  # nothing crossed over
        assert producer.index.match([11, 12], [rank1], 0.0) == {}
        pub1.close(linger=0)  # rank 1's server dies
        await publish(pub0, 0, [31])
        await until(lambda: holds(rank0, [31]), "rank 0 still live")
    finally:
        pub0.close(linger=0)
        pub1.close(linger=0)
        await sub.close()
