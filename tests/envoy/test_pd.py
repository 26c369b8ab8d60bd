"""Prefill/decode disaggregation through real Envoy: epp (the shipped ``pd`` profile) picks a
decoder and a prefiller, Envoy routes to the decoder's ``epp pd-sidecar``, which prefills on
the prefiller (``max_tokens: 1``) and decodes locally. Emulated servers here (no KV moves);
tests/vllm/test_pd.py runs the same with real vLLM sharing KV."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from epp.envoyconfig import UPSTREAM_HOST_HEADER, EnvoyOptions
from epp.sidecar.proxy import SidecarConfig, run
from simulator.emulator import RunningEmulator
from simulator.envoy import start_envoy, with_ports
from simulator.stack import child
from simulator.vllm import free_port
from tests.envoy.conftest import MODEL, chat

LONG = "Summarise the history of bread making across the ancient world, in detail. " * 30


async def counter(http: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    async with http.get(url) as r:
        text = await r.text()
    prefix = name + ("{" + labels + "}" if labels else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix + " ") or (not labels and line.startswith(name + "{")))  # fmt: skip


@dataclass
class PdPool:
    urls: dict[str, str]
    prefiller: RunningEmulator

    def __getitem__(self, key: str) -> str:
        return self.urls[key]

    async def kill_prefiller(self) -> None:
        await self.prefiller.close()


@contextlib.asynccontextmanager
async def pd_pool(tmp_path: Path) -> AsyncIterator[PdPool]:
    prefiller, decoder = await child.start_replicas(2, 20.0, MODEL, None, None)
    side_port = free_port()
    stop = asyncio.Event()
    sidecar = asyncio.create_task(run(SidecarConfig(decoder=decoder.url, prefill_timeout_s=5.0),
                                      "127.0.0.1", side_port, stop))  # fmt: skip
    side = f"127.0.0.1:{side_port}"
    pre = prefiller.url.removeprefix("http://")
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "epp/config/profiles/pd.yaml").read_text())
    config["staticEndpoints"] = [
        {"address": "127.0.0.1", "port": prefiller.port, "role": "prefill"},
        {"address": "127.0.0.1", "port": side_port, "role": "decode", "metricsPort": decoder.port},
    ]
    (tmp_path / "pd.yaml").write_text(yaml.safe_dump(config))
    grpc_port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "epp.log", "ab")  # noqa: SIM115, ASYNC230 - handed to the child
    epp = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1", "--grpc-port",
        str(grpc_port), "--health-port", "-1", "--metrics-port", str(metrics_port),
        "--log-format", "text", "--config", str(tmp_path / "pd.yaml"),
        stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    log.close()
    envoy = None
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                        if r.status == 200:
                            break
                assert epp.returncode is None, (tmp_path / "epp.log").read_text()[-2000:]
                await asyncio.sleep(0.1)
        envoy = await start_envoy(with_ports(EnvoyOptions(
            epp=(f"127.0.0.1:{grpc_port}",), pool=(pre, side), upstream_host_header=True,
        )), tmp_path)  # fmt: skip
        await asyncio.sleep(0.5)  # a scrape of both servers
        yield PdPool({"envoy": envoy.url, "epp_metrics": f"http://127.0.0.1:{metrics_port}/metrics",
                      "sidecar": side, "sidecar_metrics": f"http://{side}/sidecar/metrics",
                      "prefiller_metrics": prefiller.url + "/metrics"}, prefiller)  # fmt: skip
    finally:
        if envoy is not None:
            await envoy.stop()
        epp.terminate()
        await epp.wait()
        stop.set()
        await sidecar
        await decoder.close()
        with contextlib.suppress(Exception):
            await prefiller.close()


async def test_split_requests_prefill_on_the_prefiller_and_decode_behind_the_sidecar(
    tmp_path: Path,
) -> None:
    async with pd_pool(tmp_path) as p, aiohttp.ClientSession() as http:
        async with http.post(p["envoy"] + "/v1/chat/completions", json=chat(LONG, max_tokens=8)) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
            assert r.headers[UPSTREAM_HOST_HEADER] == p["sidecar"]
        assert body["usage"]["completion_tokens"] == 8  # the decode, not the 1-token prefill
        assert await counter(http, p["epp_metrics"], "epp_pd_decisions_total", 'decision="split"') == 1
        assert await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total", 'outcome="ok"') == 1
        assert await counter(http, p["prefiller_metrics"], "vllm:request_success_total") == 1

        # streamed, the decoder's chunks come back through the sidecar
        second = LONG.replace("bread", "cheese")
        async with http.post(p["envoy"] + "/v1/chat/completions",
                             json=chat(second, stream=True, max_tokens=6)) as r:  # fmt: skip
            assert r.status == 200
            text = (await r.read()).decode()
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert len(events) >= 3 and events[-1] == "data: [DONE]"
        assert await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total", 'outcome="ok"') == 2

        # token-id prompts are split too, and pass to both servers unchanged
        ids = {"model": MODEL, "prompt": list(range(1000, 1600)), "max_tokens": 4}
        async with http.post(p["envoy"] + "/v1/completions", json=ids) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["prompt_tokens"] == 600
        assert await counter(http, p["epp_metrics"], "epp_pd_decisions_total", 'decision="split"') == 3
        assert await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total", 'outcome="ok"') == 3

        # a short prompt is decoded where it lands; a client's own prefiller header is dropped
        async with http.post(p["envoy"] + "/v1/chat/completions", json=chat("hi"),
                             headers={"x-prefiller-host-port": "10.9.9.9:80"}) as r:  # fmt: skip
            assert r.status == 200
        assert await counter(http, p["epp_metrics"], "epp_pd_decisions_total", 'decision="local"') == 1
        assert await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total",
                             'outcome="not-allowed"') == 0  # fmt: skip


async def test_a_dead_prefiller_never_fails_a_request(tmp_path: Path) -> None:
    """The prefiller goes away mid-run: requests are decoded locally (counted) until epp's
    scrape marks it gone, then not split at all."""
    async with pd_pool(tmp_path) as p, aiohttp.ClientSession() as http:
        statuses = []
        for i in range(12):
            async with http.post(p["envoy"] + "/v1/chat/completions",
                                 json=chat(f"request {i}: " + LONG)) as r:  # fmt: skip
                statuses.append(r.status)
                assert r.headers.get(UPSTREAM_HOST_HEADER) == p["sidecar"]
            if i == 2:
                await p.kill_prefiller()
        assert statuses == [200] * 12
        failed = await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total", 'outcome="failed"')
        no_prefiller = await counter(http, p["epp_metrics"], "epp_pd_decisions_total",
                                     'decision="no-prefiller"')  # fmt: skip
        ok = await counter(http, p["sidecar_metrics"], "epp_sidecar_prefill_total", 'outcome="ok"')
        assert ok == 3 and failed + no_prefiller == 9

