"""session-affinity-scorer through real Envoy: the session header reaches epp, and every
request of a session lands on one server even when its prompts share nothing, however many
turns it makes between two scrapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import chat, pool, until_epp_routes

CONFIG = """
plugins:
- type: session-affinity-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- plugins:
  - {pluginRef: session-affinity-scorer, weight: 10}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


TURNS = 9
"""More than the scorer's queueThreshold (5): a turn that finished is no longer queued, so a
session's quick turns between two scrapes do not make its own server look saturated."""


async def test_a_session_stays_on_one_server_behind_envoy(tmp_path: Path) -> None:
    (tmp_path / "session.yaml").write_text(CONFIG)
    # one scrape at start: the whole test runs between two scrapes (a slow server's /metrics,
    # real vLLM on a CPU: every 0.6-1 s)
    args = ("--config", str(tmp_path / "session.yaml"), "--scrape-interval-s", "30")
    async with pool(tmp_path, replicas=3, epp_args=args) as p, \
            aiohttp.ClientSession() as http:  # fmt: skip
        await until_epp_routes(p, http)
        before = await p.epps[0].routed()
        served: dict[str, set[str]] = {"alpha": set(), "beta": set()}
        for turn in range(TURNS):
            for session in served:
                async with http.post(p.url + "/v1/chat/completions",
                                     json=chat(f"{session} turn {turn}: a question of its own {turn * 7}"),
                                     headers={"x-session-id": session}) as r:  # fmt: skip
                    assert r.status == 200
                    served[session].add(r.headers[UPSTREAM_HOST_HEADER])
        # all of them through epp (it counts a request when its response stream ends)
        deadline = asyncio.get_running_loop().time() + 10
        while await p.epps[0].routed() - before < 2 * TURNS:
            assert asyncio.get_running_loop().time() < deadline, "epp did not route them all"
            await asyncio.sleep(0.05)
        assert all(len(servers) == 1 for servers in served.values()), served
