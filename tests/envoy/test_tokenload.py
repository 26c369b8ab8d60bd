"""token-load-scorer through real Envoy (the shipped ``agentic`` profile): a request's tokens
count on its endpoint from the pick, its prompt stops counting as prefill once the first
token streams back, and everything is released when the response ends or the client goes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import EppProcess, chat, pool, until_epp_routes


async def tokens(epp: EppProcess, phase: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epp_endpoint_tokens_in_flight{") and f'phase="{phase}"' in line:
            endpoint = line.split('endpoint="', 1)[1].split('"', 1)[0]
            out[endpoint] = float(line.rsplit(" ", 1)[1])
    return out


async def until_released(epp: EppProcess) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while any((await tokens(epp, "held")).values()) or any((await tokens(epp, "prefill")).values()):
        assert asyncio.get_running_loop().time() < deadline, await tokens(epp, "held")
        await asyncio.sleep(0.05)


async def test_tokens_in_flight_follow_the_request_behind_envoy(tmp_path: Path) -> None:
    async with pool(tmp_path, replicas=2, speedup=1.0, epp_args=("--config", "agentic")) as p, \
            aiohttp.ClientSession() as http:  # fmt: skip
        epp = p.epps[0]
        await until_epp_routes(p, http)
        await until_released(epp)
        prompt = "a question about parcels " * 40  # ~250 tokens at 4 characters a token
        async with http.post(p.url + "/v1/chat/completions",
                             json=chat(prompt, stream=True, max_tokens=200)) as r:  # fmt: skip
            assert r.status == 200
            upstream = r.headers[UPSTREAM_HOST_HEADER]
            await r.content.readline()  # the first token is out: the prefill is done
            await asyncio.sleep(0.2)
            held, prefill = await tokens(epp, "held"), await tokens(epp, "prefill")
            assert held.get(upstream, 0) >= 200 + 200  # the prompt and max_tokens
            assert prefill.get(upstream, 0) == 0
            await r.read()
        await until_released(epp)
        # a client that goes away mid-stream releases its tokens too
        async with http.post(p.url + "/v1/chat/completions",
                             json=chat(prompt, stream=True, max_tokens=400)) as r:  # fmt: skip
            await r.content.readline()
            assert any((await tokens(epp, "held")).values())
            r.close()
        await until_released(epp)
