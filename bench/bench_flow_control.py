"""Flow control under a noisy neighbour (issue 14), in the replay and, with ``--live``, on the
local stack.

Two tenants share 4 emulated replicas (x 65k KV tokens, 32 sequences each): ``quiet`` sends
~3 requests/s (512-token prompts, 64 output tokens); ``noisy`` sends bursts of 240 requests
within 2 s every 30 s (2,048-token prompts, 256 output tokens), far more than the pool can
take. epp runs its default profile with flow control off, then on (the shipped
``flowControl`` defaults: thresholds detector, round-robin between tenants, 30 s queue
limit), then on with a concurrency limit. Printed per tenant: requests, served, answered
with an error by epp (429/503, with the reason), lost without an answer (must be 0), TTFT
p50 / p99 / max (from the arrival at epp, so queueing in epp counts), and the tenant's share
of the first tokens produced during the bursts (from each burst's start to 10 s after it)
next to its share of the requests that arrived then.

``--live``: the same tenants, smaller (40 s; bursts of 150 at 10 s and 30 s; 32 and 128
output tokens), sent by ``epp-sim load`` through the local stack's gateway and epp to 2
emulated replicas at real time, each naming its tenant in ``x-llm-d-inference-fairness-id``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from epp.config.loader import default_config, parse_config
from simulator.replay.policies import EppPolicy
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.workload import TenantsParams, TenantsWorkload

TENANTS = ("quiet", "noisy")
VARIANTS: list[tuple[str, dict[str, Any] | None]] = [
    ("off", None),
    ("on (defaults)", {"enabled": True}),
    ("on (concurrency 16)", {"enabled": True, "saturation": "concurrency", "maxConcurrency": 16}),
]
LIVE = TenantsParams(duration_s=40.0, rate=4.0, burst_every_s=20.0, burst_requests=150, quiet_output_len=32,
                     noisy_output_len=128)  # fmt: skip
Row = tuple[str, float, float | None, str]
"""One request: tenant, arrival (s), first token (s; None without one), error ("" if served,
"lost" without an answer)."""


def raw_config(flow: dict[str, Any] | None) -> dict[str, Any]:
    return dict(default_config().raw) | ({"flowControl": flow} if flow is not None else {})


def replayed(flow: dict[str, Any] | None, workload: TenantsWorkload) -> list[Row]:
    cfg = parse_config(raw_config(flow), "<bench>")
    result = Replayer(ReplayConfig(replicas=4, kv_blocks=4096)).run(workload, lambda c: EppPolicy(c, cfg), "epp")
    return [(o.tenant, o.arrival_s, None if o.rejected else o.first_token_s,
             o.reason if o.rejected else "lost" if o.finished_count != 1 else "") for o in result.outcomes]  # fmt: skip


async def live(flow: dict[str, Any] | None, workload: TenantsWorkload) -> list[Row]:
    from simulator.load import LoadOptions, run_load
    from simulator.stack import StackOptions, start_stack

    folder = Path(tempfile.mkdtemp(prefix="epp-fc-"))
    (folder / "epp.yaml").write_text(yaml.safe_dump(raw_config(flow)), encoding="utf-8")
    stack = await start_stack(StackOptions(replicas=2, model="m", config=str(folder / "epp.yaml"), log_dir=folder))
    try:
        sent = await run_load(stack.gateway_url, workload, LoadOptions("m"))
    finally:
        await stack.stop()
    return [(s.request.tenant, s.request.arrival_s,
             s.record.start_s + s.record.ttft_s if s.record.ok and s.record.ttft_s is not None else None,
             "" if s.record.ok else f"{s.record.status} {reason(s.record.error)}" if s.record.status else "lost")
            for s in sent]  # fmt: skip


def reason(body: str) -> str:
    try:
        return str(json.loads(body)["error"].get("reason", "?"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


def table(label: str, rows: list[Row], bursts: list[float]) -> None:
    def in_bursts(t: float) -> bool:
        return any(s <= t < s + 10.0 for s in bursts)

    firsts = Counter(tenant for tenant, _, first, _ in rows if first is not None and in_bursts(first))
    arrived = Counter(tenant for tenant, at, _, _ in rows if in_bursts(at))
    for tenant in TENANTS:
        mine = [r for r in rows if r[0] == tenant]
        ttft = np.array([first - at for _, at, first, error in mine if first is not None and not error])
        errors = Counter(e for *_, e in mine if e and e != "lost")
        lost = sum(e == "lost" for *_, e in mine)
        share, demand = firsts[tenant] / max(1, firsts.total()), arrived[tenant] / max(1, arrived.total())
        print(f"{label:<20} {tenant:<6} {len(mine):>5} {len(ttft):>6} "
              f"{', '.join(f'{n} {r}' for r, n in errors.items()) or '0':>14} {lost:>4} "
              f"{np.percentile(ttft, 50):>7.2f}s {np.percentile(ttft, 99):>6.2f}s {ttft.max():>6.2f}s "
              f"{share:>12.0%} {demand:>9.0%}", flush=True)  # fmt: skip


def run(title: str, workload: TenantsWorkload, rows_of: Any) -> None:
    bursts = workload._bursts()
    print(f"{title}: {len(workload)} requests over {workload.p.duration_s:g} s; bursts at "
          f"{', '.join(f'{s:g}' for s in bursts)} s")  # fmt: skip
    print(f"{'flow control':<20} {'tenant':<6} {'reqs':>5} {'served':>6} {'errors':>14} {'lost':>4} "
          f"{'TTFT p50':>8} {'p99':>7} {'max':>7} {'burst share':>12} {'(arrived)':>9}")  # fmt: skip
    for label, flow in VARIANTS:
        table(label, rows_of(flow, workload), bursts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", action="store_true", help="also on the local stack (2 emulated replicas, ~3 minutes)")
    args = ap.parse_args()
    run("replay, 4 replicas", TenantsWorkload(TenantsParams()), replayed)
    if args.live:
        print()
        run("live, 2 replicas, the client's TTFT", TenantsWorkload(LIVE), lambda f, w: asyncio.run(live(f, w)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
