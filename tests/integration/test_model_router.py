"""``epp model-router`` over gRPC with the messages Envoy sends (BUFFERED as the bootstrap
configures it, FULL_DUPLEX_STREAMED as a gateway may), emulated servers for its model list,
and the fake Kubernetes API for its ConfigMaps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.datastore.kubernetes import WatchTiming, api_client_for
from epp.extproc import convert
from epp.modelrouter.catalog import ModelCatalog
from epp.modelrouter.kubernetes import ConfigMapAdapters
from epp.modelrouter.listing import ListingOptions
from epp.modelrouter.pools import from_flags
from epp.modelrouter.server import RouterHandle, RouterOptions, start_router
from simulator.stack import child
from tests.fake_k8s import CONFIGMAPS, FakeKubeApi

CHAT, CODER = "chat-base", "coder-base"


def headers(pairs: dict[str, str], end: bool = False) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                     for k, v in pairs.items()])  # fmt: skip
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end))


def body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def post(path: str = "/v1/chat/completions", **extra: str) -> dict[str, str]:
    return {":method": "POST", ":path": path, "content-type": "application/json", **extra}


def chat(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def set_headers(reply: pb.ProcessingResponse) -> dict[str, str]:
    which = reply.WhichOneof("response")
    common = getattr(reply, which).response
    assert common.clear_route_cache  # Envoy picks the route again with the new headers
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, list[Any]]]:
    chat = await child.start_replicas(2, 50.0, CHAT, None, None, lora_adapters=("sql-lora",))
    coder = await child.start_replicas(1, 50.0, CODER, None, None)
    yield {"chat": chat, "coder": coder}
    for r in (*chat, *coder):
        await r.close()


def flags(servers: dict[str, list[Any]]) -> list[str]:
    return [f"{name}={CHAT if name == 'chat' else CODER}@"
            + ",".join(r.url.removeprefix("http://") for r in reps) for name, reps in servers.items()]  # fmt: skip


async def start(servers: dict[str, list[Any]], adapters: tuple[str, ...] = (), **kw: Any) -> RouterHandle:
    pools = from_flags(flags(servers), adapters)
    assert pools is not None
    kw.setdefault("listing", ListingOptions(refresh_s=0.2))
    return await start_router(pools, RouterOptions(host="127.0.0.1", grpc_port=0, metrics_port=-1, **kw))


async def exchange(handle: RouterHandle, *msgs: pb.ProcessingRequest, protocol: int = convert.BUFFERED,
                   replies: int) -> list[pb.ProcessingResponse]:  # fmt: skip
    first = pb.ProcessingRequest()
    first.CopyFrom(msgs[0])
    first.protocol_config.request_body_mode = protocol
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        out = []
        for m in (first, *msgs[1:]):
            await call.write(m)
        while len(out) < replies:
            out.append(await asyncio.wait_for(call.read(), 5))
        await call.done_writing()
        return out


async def test_buffered_the_body_names_the_pool_and_a_clients_own_headers_are_overwritten(
    servers: dict[str, list[Any]],
) -> None:
    handle = await start(servers)
    try:
        forged = post(**{"x-gateway-base-model-name": CODER, "x-gateway-model-name": CODER})
        first, second = await exchange(handle, headers(forged), body(chat(CHAT)), replies=2)
        assert first.WhichOneof("response") == "request_headers"  # continue, the body decides
        assert set_headers(second) == {"x-gateway-model-name": CHAT, "x-gateway-base-model-name": CHAT}
        assert not second.request_body.response.HasField("body_mutation")  # the body passes as sent
        _, adapter = await exchange(handle, headers(post()), body(chat("sql-lora")), replies=2)
        assert set_headers(adapter)["x-gateway-base-model-name"] == CHAT  # learned from the servers
    finally:
        await handle.stop(0)


async def test_full_duplex_the_headers_reply_carries_the_model_then_the_body_streams_back(
    servers: dict[str, list[Any]],
) -> None:
    handle = await start(servers)
    try:
        data = json.dumps({"model": CODER, "prompt": "def f():"}).encode()
        first, second = await exchange(handle, headers(post("/v1/completions")), body(data[:5], False),
                                       body(data[5:]), protocol=convert.FULL_DUPLEX_STREAMED,
                                       replies=2)  # fmt: skip
        assert set_headers(first)["x-gateway-base-model-name"] == CODER
        assert set_headers(first)["content-length"] == str(len(data))
        streamed = second.request_body.response.body_mutation.streamed_response
        assert streamed.body == data and streamed.end_of_stream
    finally:
        await handle.stop(0)


async def test_unknown_models_bad_bodies_and_the_model_list_are_answered_by_the_router(
    servers: dict[str, list[Any]],
) -> None:
    handle = await start(servers)
    try:
        _, unknown = await exchange(handle, headers(post()), body(chat("gpt-9")), replies=2)
        _, bad = await exchange(handle, headers(post()), body(b"{not json"), replies=2)
        (listed,) = await exchange(handle, headers({":method": "GET", ":path": "/v1/models"}, True), replies=1)
        (card,) = await exchange(handle, headers({":method": "GET", ":path": "/v1/models/sql-lora"}, True), replies=1)
        (other,) = await exchange(handle, headers({":method": "GET", ":path": "/health"}, True), replies=1)
    finally:
        await handle.stop(0)
    assert unknown.immediate_response.status.code == 404
    error = json.loads(unknown.immediate_response.body)["error"]
    assert error["param"] == "model" and "'gpt-9'" in error["message"] and error["code"] == 404
    assert bad.immediate_response.status.code == 400
    assert listed.immediate_response.status.code == 200
    ids = [m["id"] for m in json.loads(listed.immediate_response.body)["data"]]
    assert sorted(ids) == sorted([CHAT, CODER, "sql-lora"])
    assert json.loads(card.immediate_response.body)["parent"] == CHAT
    assert other.immediate_response.status.code == 404


async def test_the_rewrite_header_chooses_the_model_only_when_trusted(
    servers: dict[str, list[Any]],
) -> None:
    for trusted, want in ((False, CHAT), (True, CODER)):
        handle = await start(servers, trust_control_headers=trusted)
        try:
            request = post(**{"x-gateway-model-name-rewrite": CODER})
            _, reply = await exchange(handle, headers(request), body(chat(CHAT)), replies=2)
        finally:
            await handle.stop(0)
        assert set_headers(reply)["x-gateway-base-model-name"] == want


async def test_a_pool_whose_servers_fail_keeps_its_last_list_and_a_huge_answer_is_refused() -> None:
    state = {"status": 200, "body": json.dumps({"data": [{"id": CHAT}, {"id": "a", "parent": CHAT}]})}

    async def models(_: web.Request) -> web.Response:
        return web.Response(status=state["status"], text=state["body"])  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pools = from_flags([f"chat={CHAT}@127.0.0.1:{port}"])
    assert pools is not None
    handle = await start_router(pools, RouterOptions(
        host="127.0.0.1", grpc_port=0, metrics_port=-1,
        listing=ListingOptions(refresh_s=0.05, max_bytes=4096)))  # fmt: skip
    try:
        assert handle.router.catalog.lookup("a") is not None
        state["status"] = 500
        await asyncio.sleep(0.3)
        assert handle.router.catalog.lookup("a") is not None  # kept
        state.update(status=200, body=json.dumps({"data": [{"id": "x" * 100, "parent": CHAT}] * 100}))
        await asyncio.sleep(0.3)
        assert handle.router.catalog.lookup("a") is not None  # over 4096 bytes: refused, kept
        state["body"] = json.dumps({"data": [{"id": "b", "parent": CHAT}]})
        await asyncio.sleep(0.3)
        assert handle.router.catalog.lookup("b") is not None and handle.router.catalog.lookup("a") is None
    finally:
        await handle.stop(0)
        await runner.cleanup()


def config_map(name: str, config: str, managed: bool = True) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "ipp"} if managed else {}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels},
            "data": {"config": config}}  # fmt: skip


async def test_adapters_from_configmaps_in_the_payload_processors_format() -> None:
    api = FakeKubeApi()
    api.create_collection(CONFIGMAPS())
    api.put(CONFIGMAPS(), config_map("chat-adapters", f"baseModel: {CHAT}\nadapters: [sql-lora, support]\n"))
    api.put(CONFIGMAPS(), config_map("broken", "baseModel: [not, a, name]\n"))
    api.put(CONFIGMAPS(), config_map("unmanaged", f"baseModel: {CHAT}\nadapters: [secret]\n", managed=False))
    api.start()
    pools = from_flags([f"chat={CHAT}@10.0.0.1:8000", f"coder={CODER}@10.0.0.2:8000"])
    assert pools is not None
    catalog = ModelCatalog(pools.pools)
    source = ConfigMapAdapters(catalog, "default", api_client=api_client_for(api.host),
                               timing=WatchTiming(backoff_initial_s=0.05, sync_timeout_s=5.0))  # fmt: skip
    try:
        await source.start()
        assert catalog.lookup("sql-lora").pool == "chat"  # type: ignore[union-attr]
        assert catalog.lookup("support") is not None and catalog.lookup("secret") is None
        api.put(CONFIGMAPS(), config_map("coder-adapters", f"baseModel: {CODER}\nadapters: [py-lora]\n"))
        api.delete(CONFIGMAPS(), "chat-adapters")
        for _ in range(100):
            if catalog.lookup("py-lora") is not None and catalog.lookup("sql-lora") is None:
                break
            await asyncio.sleep(0.05)  # the watch delivers
        assert catalog.lookup("py-lora").pool == "coder"  # type: ignore[union-attr]
        assert catalog.lookup("sql-lora") is None
    finally:
        await source.stop()
        api.close()
