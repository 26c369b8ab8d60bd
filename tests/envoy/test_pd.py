"""Prefill/decode disaggregation through real Envoy: epp (the shipped ``pd`` profile) picks a
decoder and a prefiller, Envoy routes to the decoder's ``epp pd-sidecar``, which prefills on
the prefiller (``max_tokens: 1``) and decodes locally: the local stack's ``--pd 1:1``, with
emulated servers sharing KV through a directory as vLLM's ExampleConnector does
(``epp-sim emulate --kv-store``); tests/vllm/test_pd.py runs it with real vLLM."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from simulator.stack.stack import Stack, StackOptions, start_stack
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
    stack: Stack

    def __getitem__(self, key: str) -> str:
        return self.urls[key]

    async def kill_prefiller(self) -> None:
        await self.stack.kill_server(0)


@contextlib.asynccontextmanager
async def pd_pool(tmp_path: Path) -> AsyncIterator[PdPool]:
    """``epp-sim stack --pd 1:1``: a prefiller and a decoder sharing KV, the decoder's
    sidecar, epp with the shipped pd profile, real Envoy."""
    stack = await start_stack(StackOptions(pd="1:1", speedup=20.0, model=MODEL, isolation="inline",
                                           log_dir=tmp_path))  # fmt: skip
    try:
        await asyncio.sleep(0.5)  # a scrape of both servers
        prefiller, decoder = stack.replica_urls
        side = stack.sidecars[0]
        assert stack.epp_metrics is not None
        yield PdPool({"envoy": stack.gateway_url, "epp_metrics": stack.epp_metrics,
                      "sidecar": side, "sidecar_metrics": f"http://{side}/sidecar/metrics",
                      "prefiller_metrics": prefiller + "/metrics",
                      "decoder_metrics": decoder + "/metrics"}, stack)  # fmt: skip
    finally:
        await stack.stop()


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
        # the decoder loaded the prompt the prefiller computed (all but its last partial block)
        prompt_tokens = body["usage"]["prompt_tokens"]
        loaded = await counter(http, p["decoder_metrics"], "vllm:external_prefix_cache_hits_total")
        assert prompt_tokens - 16 <= loaded < prompt_tokens
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
        assert await counter(http, p["prefiller_metrics"], "vllm:external_prefix_cache_hits_total") == 0

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
        local = await counter(http, p["epp_metrics"], "epp_pd_decisions_total", 'decision="local"')
        async with http.post(p["envoy"] + "/v1/chat/completions", json=chat("hi"),
                             headers={"x-prefiller-host-port": "10.9.9.9:80"}) as r:  # fmt: skip
            assert r.status == 200
        assert await counter(http, p["epp_metrics"], "epp_pd_decisions_total", 'decision="local"') == local + 1
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
        # what happened to each: split, decoded here after a failed prefill, not split
        for split, want in (("yes", 3), ("fallback", failed), ("no", no_prefiller)):
            assert await counter(http, p["sidecar_metrics"], "epp_sidecar_requests_total",
                                 f'split="{split}"') == want  # fmt: skip

