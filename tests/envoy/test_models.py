"""Many models behind one real Envoy: ``epp model-router`` in front of two pools, each with
its own ``epp serve``, with the bootstrap ``epp envoy-config --pool NAME=MODEL@SERVERS ...``
prints. The servers' own counters say where every request went."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import FAIL_OPEN_HEADER, UPSTREAM_HOST_HEADER, EnvoyOptions, PoolRoute
from simulator.emulator import RunningEmulator
from simulator.envoy import RunningEnvoy, start_envoy, with_ports
from simulator.eppproc import EppProcess, RouterProcess
from simulator.stack import child
from simulator.stack.report import scrape_replicas

pytestmark = pytest.mark.e2e

CHAT, CODER, ADAPTER = "chat-base", "coder-base", "sql-lora"


@dataclass
class Gateway:
    chat: list[RunningEmulator]
    coder: list[RunningEmulator]
    epps: dict[str, EppProcess]
    router: RouterProcess
    envoy: RunningEnvoy

    @property
    def url(self) -> str:
        return self.envoy.url

    def servers(self, pool: str) -> set[str]:
        reps = self.chat if pool == "chat" else self.coder
        return {r.url.removeprefix("http://") for r in reps}


def _addrs(reps: list[RunningEmulator]) -> tuple[str, ...]:
    return tuple(r.url.removeprefix("http://") for r in reps)


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """Pool chat: 3 servers of chat-base serving the adapter sql-lora; pool coder: 2 servers
    of coder-base; an epp per pool; the model router learns the adapter from the servers."""
    chat = await child.start_replicas(3, 20.0, CHAT, 256, None, lora_adapters=(ADAPTER,))
    coder = await child.start_replicas(2, 20.0, CODER, 256, None)
    epps = {"chat": EppProcess(list(_addrs(chat)), tmp_path / "epp-chat.log"),
            "coder": EppProcess(list(_addrs(coder)), tmp_path / "epp-coder.log")}  # fmt: skip
    router = RouterProcess([f"chat={CHAT}@{','.join(_addrs(chat))}",
                            f"coder={CODER}@{','.join(_addrs(coder))}"], tmp_path / "router.log")  # fmt: skip
    started: list[EppProcess | RouterProcess] = []
    envoy: RunningEnvoy | None = None
    try:
        for p in (*epps.values(), router):
            await p.start()
            started.append(p)
        options = EnvoyOptions(
            pools=(PoolRoute("chat", (CHAT,), _addrs(chat), (epps["chat"].address,)),
                   PoolRoute("coder", (CODER,), _addrs(coder), (epps["coder"].address,))),
            model_router=(router.address,), upstream_host_header=True,
        )  # fmt: skip
        envoy = await start_envoy(with_ports(options), tmp_path)
        yield Gateway(chat, coder, epps, router, envoy)
    finally:
        if envoy is not None:
            await envoy.stop()
        for p in started:
            await p.stop()
        for r in (*chat, *coder):
            await r.close()


SYSTEMS = [f"You are assistant number {k}. " + f"Rule {k}: answer briefly and politely. " * 40
           for k in range(4)]  # fmt: skip


def request_for(model: str, i: int) -> dict[str, object]:
    """A chat turn sharing one of four system prompts (cacheable prefixes), or a completion."""
    system = SYSTEMS[i % len(SYSTEMS)]
    if model == CODER:
        return {"model": model, "prompt": system + f"def f{i}():", "max_tokens": 4}
    return {"model": model, "max_tokens": 4, "stream": i % 2 == 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question {i}"}]}  # fmt: skip


PATHS = {CHAT: "/v1/chat/completions", ADAPTER: "/v1/chat/completions", CODER: "/v1/completions"}


async def send(http: aiohttp.ClientSession, url: str, model: str, i: int) -> tuple[int, str]:
    """The status and the server that answered ("fail-open:" before it when the response
    carries Envoy's fail-open marker: no epp saw it)."""
    async with http.post(url + PATHS[model], json=request_for(model, i)) as r:
        await r.read()
        opened = "fail-open:" if FAIL_OPEN_HEADER in r.headers else ""
        return r.status, opened + r.headers.get(UPSTREAM_HOST_HEADER, "")


async def test_every_request_reaches_its_models_pool_through_its_epp(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with gateway(tmp_path) as g:
        plan = [CHAT] * 48 + [ADAPTER] * 16 + [CODER] * 32
        sent = {m: 0 for m in PATHS}
        outcomes = []
        for batch in range(0, len(plan), 8):  # 8 in flight
            chunk = plan[batch:batch + 8]
            results = await asyncio.gather(*(send(http, g.url, m, batch + k) for k, m in enumerate(chunk)))
            outcomes += list(zip(chunk, results, strict=True))
            for m in chunk:
                sent[m] += 1
        chat_counters = await scrape_replicas([r.url for r in g.chat])
        coder_counters = await scrape_replicas([r.url for r in g.coder])
        routed = {name: await e.routed() for name, e in g.epps.items()}
    assert all(status == 200 for _, (status, _) in outcomes), outcomes
    for model, (_, upstream) in outcomes:
        assert upstream in g.servers("coder" if model == CODER else "chat"), (model, upstream)
    # the servers' own counters: every request served where its model lives, none elsewhere
    assert sum(c.requests for c in chat_counters) == sent[CHAT] + sent[ADAPTER]
    assert sum(c.requests for c in coder_counters) == sent[CODER]
    # each pool's epp routed its pool's requests, and only those
    assert routed == {"chat": sent[CHAT] + sent[ADAPTER], "coder": sent[CODER]}
    # and kept the prefixes where they are cached: 4 system prompts over 3 (2) servers
    for counters in (chat_counters, coder_counters):
        hits = sum(c.prefix_hits for c in counters) / sum(c.prefix_queries for c in counters)
        assert hits > 0.8, hits


async def test_unknown_models_the_model_list_and_a_client_picking_its_pool(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with gateway(tmp_path) as g:
        async with http.post(g.url + "/v1/chat/completions",
                             json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}) as r:  # fmt: skip
            status, error = r.status, await r.json()
            assert FAIL_OPEN_HEADER not in r.headers  # the router answered
        async with http.get(g.url + "/v1/models") as r:
            listed = await r.json()
        async with http.get(g.url + f"/v1/models/{ADAPTER}") as r:
            card = await r.json()
        # a client naming another pool in the routing header is routed by its body
        async with http.post(g.url + "/v1/completions",
                             headers={"x-gateway-base-model-name": CODER, "x-gateway-model-name": CODER},
                             json={"model": CHAT, "prompt": "hello", "max_tokens": 2}) as r:  # fmt: skip
            forged = (r.status, r.headers.get(UPSTREAM_HOST_HEADER, ""))
        # the model router down: nothing says which pool, whatever the client claims
        assert g.router.proc is not None
        g.router.proc.send_signal(signal.SIGKILL)
        await g.router.proc.wait()
        async with http.post(g.url + "/v1/completions", headers={"x-gateway-base-model-name": CHAT},
                             json={"model": CHAT, "prompt": "hello", "max_tokens": 2}) as r:  # fmt: skip
            down = (r.status, await r.json())
    assert status == 404
    assert error["error"]["type"] == "not_found_error" and error["error"]["param"] == "model"
    assert "gpt-9" in error["error"]["message"] and CHAT in error["error"]["message"]
    ids = [m["id"] for m in listed["data"]]
    assert listed["object"] == "list" and sorted(ids) == sorted([CHAT, ADAPTER, CODER])
    assert card["id"] == ADAPTER and card["parent"] == CHAT
    assert forged[0] == 200 and forged[1] in g.servers("chat")
    assert down[0] == 503 and down[1]["error"]["type"] == "service_unavailable"


async def test_one_pools_epp_killed_that_pool_fails_open_the_other_keeps_its_epp(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with gateway(tmp_path) as g:
        for i in range(4):  # both epps route
            assert (await send(http, g.url, CHAT, i))[0] == 200
            assert (await send(http, g.url, CODER, i))[0] == 200
        victim, survivor = g.epps["chat"], g.epps["coder"]
        victim.kill()
        await victim.proc.wait()  # type: ignore[union-attr]
        before = await survivor.routed()
        outcomes = []
        for i in range(24):
            outcomes.append((CHAT, await send(http, g.url, CHAT, 100 + i)))
            outcomes.append((CODER, await send(http, g.url, CODER, 100 + i)))
        after = await survivor.routed()
        open_chat = await g.envoy.counters("http.inference.ext_proc.failure_mode_allowed")
    assert all(status == 200 for _, (status, _) in outcomes), outcomes
    chat_upstreams = {up for m, (_, up) in outcomes if m == CHAT}
    # served without an epp (the marker), balanced by Envoy over the chat pool's servers
    assert all(up.startswith("fail-open:") for up in chat_upstreams), chat_upstreams
    assert {up.removeprefix("fail-open:") for up in chat_upstreams} <= g.servers("chat")
    assert len(chat_upstreams) > 1
    assert {up for m, (_, up) in outcomes if m == CODER} <= g.servers("coder")  # through its epp
    assert after - before == 24  # every coder request still through the coder pool's epp
    assert sum(open_chat.values()) >= 24  # the chat requests failed open
