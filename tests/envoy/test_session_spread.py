"""The default profile's session spread through real Envoy: once the sessions under way have
shown they are long, a new session sharing their system prompt starts on another server
(its later turns will follow it there), and its turns then stay where it started. With the
spread off, the same new session joins the server holding the prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import Pool, chat, pool

SYSTEM = "You are the parcel desk's agent. " * 16  # ~130 tokens every session starts with
"""Short enough that the charge for the long session (0.2 s) outweighs starting elsewhere (at
the cost model's prior, ~0.04 s with what the pick costs later requests)."""

NO_SPREAD = """
plugins:
- type: predicted-ttft-scorer
  parameters: {sessionSpreadSeconds: 0}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-home-scorer
- type: max-score-picker
schedulingProfiles:
- plugins:
  - {pluginRef: predicted-ttft-scorer, weight: 8}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-home-scorer, weight: 0.25}
  - {pluginRef: max-score-picker}
"""
"""The default profile with the spread off (its weights as in profiles/default.yaml)."""


async def turn(p: Pool, http: aiohttp.ClientSession, session: str, n: int) -> str:
    """Turn ``n`` of an agent session: the system prompt, then every earlier turn's tool
    output (~50 tokens each), so its context grows and is cached where it ran."""
    context = "".join(f"\n{session} tool output {i}: " + f"rows {i * 13} to {i * 17} " * 10
                      for i in range(n + 1))  # fmt: skip
    async with http.post(p.url + "/v1/chat/completions", json=chat(SYSTEM + context),
                         headers={"x-session-id": session}) as r:  # fmt: skip
        assert r.status == 200
        await r.read()
        return r.headers[UPSTREAM_HOST_HEADER]


async def where_a_new_session_starts(tmp_path: Path, epp_args: tuple[str, ...]) -> tuple[str, set[str]]:
    """A 20-turn session, then a new one with the same system prompt: where the long one ran,
    and where the new one's turns went."""
    tmp_path.mkdir()
    async with pool(tmp_path, replicas=3, epp_args=epp_args) as p, aiohttp.ClientSession() as http:
        deadline = asyncio.get_running_loop().time() + 20
        # Envoy fails open until epp is ready: wait until it has scraped every server and
        # routed one request
        while await p.epps[0].ready_endpoints() < 3 or await p.epps[0].routed() < 1:
            assert asyncio.get_running_loop().time() < deadline, "epp never routed"
            async with http.post(p.url + "/v1/chat/completions", json=chat("warm-up")) as r:
                await r.read()
            await asyncio.sleep(0.1)
        long = {await turn(p, http, "long", n) for n in range(20)}
        assert len(long) == 1, long  # its prefix keeps it on one server
        new = [await turn(p, http, "new", n) for n in range(4)]
        return long.pop(), set(new)


async def test_a_new_session_starts_away_from_a_long_one_behind_envoy(tmp_path: Path) -> None:
    home, new = await where_a_new_session_starts(tmp_path / "default", ())
    assert len(new) == 1 and home not in new, (home, new)  # spread, then it stays
    (tmp_path / "no-spread.yaml").write_text(NO_SPREAD)
    home, new = await where_a_new_session_starts(
        tmp_path / "off", ("--config", str(tmp_path / "no-spread.yaml")))
    assert new == {home}, (home, new)  # without the spread it joins the prompt's server
