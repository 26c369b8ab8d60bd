"""Flow control under a noisy neighbour, in the replay (issue 14).

Two tenants share 4 emulated replicas (x 65k KV tokens, 32 sequences each): ``quiet`` sends
~3 requests/s (512-token prompts, 64 output tokens); ``noisy`` sends bursts of 240 requests
within 2 s every 30 s (2,048-token prompts, 256 output tokens), far more than the pool can
take. epp runs its default profile with flow control off, then on (the shipped
``flowControl`` defaults: thresholds detector, round-robin between tenants, 30 s queue
limit), then on with a concurrency limit. Printed per tenant: requests, served, answered
with an error by epp (429/503, with the reason), lost without an answer (must be 0), TTFT
p50 / p99 / max, and the tenant's share of the first tokens produced during the bursts
(from each burst's start to 10 s after it) next to its share of the requests that arrived
then.

Run: ./run python bench/bench_flow_control.py
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np

from epp.config.loader import default_config, parse_config
from simulator.replay.policies import EppPolicy
from simulator.replay.replayer import Outcome, ReplayConfig, Replayer
from simulator.replay.workload import TenantsParams, TenantsWorkload

TENANTS = ("quiet", "noisy")
VARIANTS: list[tuple[str, dict[str, Any] | None]] = [
    ("off", None),
    ("on (defaults)", {"enabled": True}),
    ("on (concurrency 16)", {"enabled": True, "saturation": "concurrency", "maxConcurrency": 16}),
]


def in_bursts(t: float, p: TenantsParams, starts: list[float]) -> bool:
    return any(s <= t < s + 10.0 for s in starts)


def main() -> int:
    params = TenantsParams()
    workload = TenantsWorkload(params)
    starts = workload._bursts()
    config = ReplayConfig(replicas=4, kv_blocks=4096)
    base = dict(default_config().raw)
    print(f"{len(workload)} requests over {params.duration_s:g} s; bursts at "
          f"{', '.join(f'{s:g}' for s in starts)} s")  # fmt: skip
    print(f"{'flow control':<20} {'tenant':<6} {'reqs':>5} {'served':>6} {'errors':>14} {'lost':>4} "
          f"{'TTFT p50':>8} {'p99':>7} {'max':>7} {'burst share':>12} {'(arrived)':>9}")  # fmt: skip
    for label, flow in VARIANTS:
        raw = dict(base)
        if flow is not None:
            raw["flowControl"] = flow
        cfg = parse_config(raw, "<bench>")
        result = Replayer(config).run(workload, lambda c, cfg=cfg: EppPolicy(c, cfg), label)
        outs: list[Outcome] = result.outcomes
        firsts = Counter(o.tenant for o in outs
                         if not o.rejected and in_bursts(o.first_token_s, params, starts))  # fmt: skip
        arrived = Counter(o.tenant for o in outs if in_bursts(o.arrival_s, params, starts))
        for tenant in TENANTS:
            mine = [o for o in outs if o.tenant == tenant]
            served = [o for o in mine if not o.rejected]
            reasons = Counter(o.reason for o in mine if o.rejected)
            lost = sum(1 for o in mine if o.finished_count != 1)
            ttft = np.array([o.first_token_s - o.arrival_s for o in served])
            errors = ", ".join(f"{n} {r}" for r, n in reasons.items()) or "0"
            share = firsts[tenant] / max(1, sum(firsts.values()))
            demand = arrived[tenant] / max(1, sum(arrived.values()))
            print(f"{label:<20} {tenant:<6} {len(mine):>5} {len(served):>6} {errors:>14} {lost:>4} "
                  f"{np.percentile(ttft, 50):>7.2f}s {np.percentile(ttft, 99):>6.2f}s "
                  f"{ttft.max():>6.2f}s {share:>12.0%} {demand:>9.0%}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
