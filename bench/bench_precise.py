"""Precise (KV events) vs approximate vs oracle prefix routing, in the replay, where the
approximate index is wrong.

``epp`` (approximate index), ``precise`` (the precise-prefix-cache-producer fed by the
emulated replicas' KV events, 50 ms late) and ``oracle`` (the replicas' true caches read at
the pick) on the Mooncake trace (8 replicas x 262k tokens, arrivals at 4/3 pace) and on a
multi-turn chat workload, in six scenarios:

``baseline`` (the router sees all traffic); ``bypass 30%`` (30% of requests reach the servers
directly); ``restarts`` (a replica's cache emptied every 60 s, in turn); ``4 routers`` (four
epp replicas without index sync); ``KV 1/4`` (the servers report 4x the KV cache they have:
the approximate LRUs are sized from the report); ``1% lost`` (1% of the event batches lost:
the producer resyncs with the approximate index's help). What keying a request costs:
``./run bench long_prompts``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import pool_map, replay  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402
from simulator.replay.workload import DEFAULT_TRACE, MooncakeTrace, Workload, build_generator  # noqa: E402

POLICIES = ("epp", "precise", "oracle")


def scenarios(base: ReplayConfig, duration_s: float) -> list[tuple[str, ReplayConfig]]:
    restarts = [(float(t), (t // 60 - 1) % base.replicas) for t in range(60, int(duration_s), 60)]
    return [
        ("baseline", base),
        ("bypass 30%", replace(base, bypass_share=0.3)),
        ("restarts", replace(base, restarts=tuple(restarts))),
        ("4 routers", replace(base, routers=4)),
        ("KV 1/4", replace(base, reported_kv_blocks=base.kv_blocks * 4)),
        ("1% lost", replace(base, event_loss=0.01)),
    ]


def workloads(quick: bool) -> Iterator[tuple[str, Workload, ReplayConfig]]:
    trace = ROOT / DEFAULT_TRACE
    if trace.exists():
        yield "mooncake", MooncakeTrace.load(trace, 0.75, 1000 if quick else 0), ReplayConfig(kv_blocks=16384)
    else:
        print(f"(trace {trace} not found: the Mooncake rows are skipped)")
    chat = build_generator("chat", {"num_sessions": 48 if quick else 160, "rate": 5})
    yield "chat", chat, ReplayConfig(replicas=4, kv_blocks=1024)


def run_one(job: tuple[ReplayConfig, Workload, str]) -> dict[str, float]:
    s = replay(*job)
    return {"hit": s.hit_rate, "p90": s.ttft_p90_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 trace requests, a small chat")
    rows, jobs = [], []
    for wname, workload, base in workloads(ap.parse_args().quick):
        for sname, cfg in scenarios(base, max(r.arrival_s for r in workload.requests())):
            rows.append((wname, sname))
            jobs += [(cfg, workload, p) for p in POLICIES]
    results = iter(pool_map(run_one, jobs))
    print("hit rate / TTFT p90 per policy; 'gap' = precise minus oracle hit rate, in points")
    print(f"{'workload':<9} {'scenario':<11}{''.join(f' {p:>16}' for p in POLICIES)} {'gap':>6}")
    for w, sc in rows:
        by = {p: next(results) for p in POLICIES}
        cells = "".join(f" {by[p]['hit']:>7.1%} {by[p]['p90']:>6.2f}s" for p in POLICIES)
        gap = 100 * (by["precise"]["hit"] - by["oracle"]["hit"])
        print(f"{w:<9} {sc:<11}{cells} {gap:>+6.1f}", flush=True)


if __name__ == "__main__":
    main()
