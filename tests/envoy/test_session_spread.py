"""The default profile's session spread through real Envoy: once the sessions under way have
shown they are long, a new session sharing their system prompt starts on another server
(its later turns will follow it there), and its turns then stay where it started. With the
spread off, the same new session joins the server holding the prompt.

What the picks depend on is pinned, so that a busy host cannot flip them (it once did: the new
session's four turns went to two servers): the cost model keeps its priors (``learn: false``:
a slow host's observed times would reweigh every term), and epp reads load from its own
in-flight counts alone (``--no-scrape``: a scrape taken while the previous turn was still
running made its server look busy to the next one). The turns are sequential, so what is left
is the prefix index and the sessions: the property under test."""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path

import aiohttp
import yaml

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import Pool, chat, pool

SYSTEM = "You are the parcel desk's agent. " * 16  # ~130 tokens every session starts with
"""Short enough that the charge for the long session (0.2 s) outweighs starting elsewhere (at
the cost model's prior, ~0.04 s with what the pick costs later requests)."""


def pinned(spread: bool) -> str:
    """The shipped default with its cost model at its priors; the spread off unless
    ``spread``."""
    doc = yaml.safe_load(resources.files("epp.config").joinpath("profiles/default.yaml").read_text("utf-8"))
    (ttft,) = [p for p in doc["plugins"] if p["type"] == "predicted-ttft-scorer"]
    ttft["parameters"]["learn"] = False
    if not spread:
        ttft["parameters"]["sessionSpreadSeconds"] = 0
    return yaml.safe_dump(doc)


async def until_routed(p: Pool, http: aiohttp.ClientSession) -> None:
    """Until epp routes (Envoy fails open before): warm-up requests meanwhile."""
    deadline = asyncio.get_running_loop().time() + 20
    while await p.epps[0].routed() < 1:
        assert asyncio.get_running_loop().time() < deadline, "epp never routed"
        async with http.post(p.url + "/v1/chat/completions", json=chat("warm-up")) as r:
            await r.read()


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


async def where_a_new_session_starts(tmp_path: Path, spread: bool) -> tuple[str, set[str]]:
    """A 20-turn session, then a new one with the same system prompt: where the long one ran,
    and where the new one's turns went."""
    tmp_path.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(pinned(spread))
    epp_args = ("--config", str(config), "--no-scrape")
    async with pool(tmp_path, replicas=3, epp_args=epp_args) as p, aiohttp.ClientSession() as http:
        await until_routed(p, http)
        long = {await turn(p, http, "long", n) for n in range(20)}
        assert len(long) == 1, long  # its prefix keeps it on one server
        new = [await turn(p, http, "new", n) for n in range(4)]
        return long.pop(), set(new)


async def test_a_new_session_starts_away_from_a_long_one_behind_envoy(tmp_path: Path) -> None:
    home, new = await where_a_new_session_starts(tmp_path / "default", spread=True)
    assert len(new) == 1 and home not in new, (home, new)  # spread, then it stays
    home, new = await where_a_new_session_starts(tmp_path / "off", spread=False)
    assert new == {home}, (home, new)  # without the spread it joins the prompt's server
