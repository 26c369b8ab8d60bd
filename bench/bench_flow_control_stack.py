"""Flow control on the live local stack (emulated replicas, epp, the development gateway):
a quiet tenant and a bursty neighbour, flow control off and on (issue 14).

Two emulated replicas (32 sequences each, GPU time at 1x). ``quiet`` sends 4 requests/s
(Poisson, ~1,500-character prompts, 32 output tokens) for 40 s; ``noisy`` sends 150
requests at once at 10 s and at 25 s (~8,000-character prompts, 128 output tokens). Each
request names its tenant in ``x-gateway-inference-fairness-id`` and streams, so TTFT is the
client's, from the moment it sent the request (epp's queue included). Printed per tenant:
requests, served, answered with an error (status and reason), TTFT p50 / p99 / max.

Run: ./run python bench/bench_flow_control_stack.py
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from epp.config.loader import default_config
from simulator.stack import StackOptions, start_stack

DURATION_S = 40.0
QUIET_RATE = 4.0
BURSTS = (10.0, 25.0)
BURST_SIZE = 150


@dataclass(slots=True)
class Result:
    tenant: str
    ttft_s: float | None = None
    status: int = 0
    reason: str = ""


async def one(session: aiohttp.ClientSession, url: str, tenant: str, prompt: str,
              max_tokens: int, out: list[Result]) -> None:  # fmt: skip
    res = Result(tenant)
    t0 = time.perf_counter()
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"x-gateway-inference-fairness-id": tenant}) as r:  # fmt: skip
            res.status = r.status
            if r.status != 200:
                try:
                    res.reason = json.loads(await r.read())["error"].get("reason", "")
                except (ValueError, KeyError, TypeError):
                    res.reason = "?"
            else:
                async for line in r.content:
                    if line.startswith(b"data: {") and res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - t0
    except aiohttp.ClientError as exc:
        res.reason = type(exc).__name__
    out.append(res)


async def run(flow: bool) -> list[Result]:
    raw = dict(default_config().raw)
    if flow:
        raw["flowControl"] = {"enabled": True}
    folder = Path(tempfile.mkdtemp(prefix="epp-fc-"))
    (folder / "epp.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    stack = await start_stack(StackOptions(replicas=2, model="m", config=str(folder / "epp.yaml"),
                                           log_dir=folder))  # fmt: skip
    rng = random.Random(7)
    out: list[Result] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:  # fmt: skip
            quiet_system = "You are the quiet tenant's assistant. " * 30
            noisy_system = "Summarise the following report in detail. " * 40
            arrivals: list[tuple[float, str]] = []
            t = 0.0
            while (t := t + rng.expovariate(QUIET_RATE)) < DURATION_S:
                arrivals.append((t, "quiet"))
            arrivals += [(b + rng.random() * 0.5, "noisy") for b in BURSTS for _ in range(BURST_SIZE)]
            arrivals.sort()
            start = time.perf_counter()
            tasks = []
            for i, (at, tenant) in enumerate(arrivals):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the arrival schedule
                if tenant == "quiet":
                    prompt, n = quiet_system + f"question {i}: " + "why? " * 20, 32
                else:
                    prompt, n = noisy_system + f"report {i}: " + "numbers and tables. " * 200, 128
                tasks.append(asyncio.create_task(one(session, stack.gateway_url, tenant, prompt, n, out)))
            await asyncio.gather(*tasks)
    finally:
        await stack.stop()
    return out


def main() -> int:
    print(f"{'flow control':<13} {'tenant':<6} {'reqs':>5} {'served':>6} {'errors':>22} "
          f"{'TTFT p50':>8} {'p99':>7} {'max':>7}")  # fmt: skip
    for flow in (False, True):
        results = asyncio.run(run(flow))
        for tenant in ("quiet", "noisy"):
            mine = [r for r in results if r.tenant == tenant]
            served = [r for r in mine if r.status == 200 and r.ttft_s is not None]
            errors = Counter(f"{r.status} {r.reason}".strip() for r in mine if r.status != 200)
            ttft = np.array([r.ttft_s for r in served])
            err = ", ".join(f"{n}x {k}" for k, n in errors.items()) or "0"
            print(f"{'on' if flow else 'off':<13} {tenant:<6} {len(mine):>5} {len(served):>6} "
                  f"{err:>22} {np.percentile(ttft, 50):>7.2f}s {np.percentile(ttft, 99):>6.2f}s "
                  f"{ttft.max():>6.2f}s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
