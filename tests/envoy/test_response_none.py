"""``epp envoy-config --response none``: Envoy shows epp no response. The requests it routed
end as ``routed`` (their outcome unknown to epp), not as cancelled (issue 70, item 4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.envoy.conftest import EppProcess, chat, pool, until_epp_routes


async def by_status(epp: EppProcess) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(
        f"http://127.0.0.1:{epp.metrics_port}/metrics"
    ) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epp_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_requests_through_response_none_end_as_routed(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    async with pool(tmp_path, replicas=2, response="none") as p:
        await until_epp_routes(p, http)
        before = await by_status(p.epps[0])
        for i in range(5):
            async with http.post(p.url + "/v1/chat/completions", json=chat(f"hello {i}")) as r:
                assert r.status == 200
        deadline = asyncio.get_running_loop().time() + 10
        while (await by_status(p.epps[0])).get("routed", 0) - before.get("routed", 0) < 5:
            assert asyncio.get_running_loop().time() < deadline, await by_status(p.epps[0])
            await asyncio.sleep(0.05)  # the metrics page is polled, not awaited
        after = await by_status(p.epps[0])
        assert after.get("cancelled", 0) == before.get("cancelled", 0)
