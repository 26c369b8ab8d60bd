"""Precise (KV events) vs approximate vs oracle prefix routing, in the replay, where the
approximate index is wrong; and what keying a request costs.

Part 1, routing (issue 12): ``epp`` (approximate index), ``precise`` (the
precise-prefix-cache-producer fed by the emulated replicas' KV events, 50 ms late) and
``oracle`` (the replicas' true caches read at the pick) on the Mooncake trace (8 replicas x
262k tokens, arrivals at 4/3 pace) and on a multi-turn chat workload, in six scenarios:

``baseline`` (the router sees all traffic); ``bypass 30%`` (30% of requests reach the servers
directly); ``restarts`` (a replica's cache emptied every 60 s, in turn); ``4 routers`` (four
epp replicas without index sync); ``KV 1/4`` (the servers report 4x the KV cache they have:
the approximate LRUs are sized from the report); ``1% lost`` (1% of the event batches lost:
the producer resyncs with the approximate index's help).

Part 2, cost: tokenizing (DeepSeek-V3's tokenizer and chat template, from the tiny model the
real-vLLM tier builds; skipped without it) and keying a 16 KB prompt, against a whole
scheduling decision with the precise producer on (8 endpoints).

Run: ./run bench precise [--record] [--quick] [--skip-routing]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import pool_map, replay  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402
from simulator.replay.workload import DEFAULT_TRACE, MooncakeTrace, Workload, build_generator  # noqa: E402

POLICIES = ("epp", "precise", "oracle")


def scenarios(base: ReplayConfig, duration_s: float) -> list[tuple[str, ReplayConfig]]:
    restarts = tuple((float(t), (t // 60 - 1) % base.replicas) for t in range(60, int(duration_s), 60))
    return [
        ("baseline", base),
        ("bypass 30%", replace(base, bypass_share=0.3)),
        ("restarts", replace(base, restarts=restarts)),
        ("4 routers", replace(base, routers=4)),
        ("KV 1/4", replace(base, reported_kv_blocks=base.kv_blocks * 4)),
        ("1% lost", replace(base, event_loss=0.01)),
    ]


def workloads(quick: bool) -> list[tuple[str, Workload, ReplayConfig]]:
    out: list[tuple[str, Workload, ReplayConfig]] = []
    trace = ROOT / DEFAULT_TRACE
    if trace.exists():
        out.append(("mooncake", MooncakeTrace.load(trace, 0.75, 1000 if quick else 0),
                    ReplayConfig(kv_blocks=16384)))  # fmt: skip
    else:
        print(f"(trace {trace} not found: the Mooncake rows are skipped)")
    chat = build_generator("chat", {"num_sessions": 48 if quick else 160, "rate": 5})
    out.append(("chat", chat, ReplayConfig(replicas=4, kv_blocks=1024)))
    return out


def run_one(job: tuple[str, str, Workload, ReplayConfig, str]) -> dict[str, Any]:
    wname, sname, workload, cfg, policy = job
    s = replay(cfg, workload, policy)
    return {"workload": wname, "scenario": sname, "policy": policy,
            "hit": s.hit_rate, "p90": s.ttft_p90_s}  # fmt: skip


def routing(quick: bool) -> None:
    jobs = []
    for wname, workload, base in workloads(quick):
        duration = max(r.arrival_s for r in workload.requests())
        for sname, cfg in scenarios(base, duration):
            jobs += [(wname, sname, workload, cfg, p) for p in POLICIES]
    rows = pool_map(run_one, jobs)
    table: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for r in rows:
        table.setdefault((r["workload"], r["scenario"]), {})[r["policy"]] = r
    print("hit rate / TTFT p90 per policy; 'gap' = precise minus oracle hit rate, in points")
    print(f"{'workload':<9} {'scenario':<11}" + "".join(f" {p:>16}" for p in POLICIES) + f" {'gap':>6}")
    for (w, sc), by in table.items():
        cells = "".join(f" {by[p]['hit']:>7.1%} {by[p]['p90']:>6.2f}s" for p in POLICIES)
        gap = 100 * (by["precise"]["hit"] - by["oracle"]["hit"])
        print(f"{w:<9} {sc:<11}{cells} {gap:>+6.1f}", flush=True)


def cost() -> None:
    from epp.config.loader import parse_config
    from epp.framework.endpoint import Endpoint, EndpointId, Metrics
    from epp.framework.request import ApiKind, InferenceRequest
    from epp.plugins.preciseprefix import PrecisePrefixProducer, TokenizingKeyer
    from epp.wiring import build_scheduler
    from simulator import vllm

    model = vllm.vllm_home() / "tiny-model"
    if not (model / "tokenizer.json").is_file():
        print(f"\ncost: skipped ({model} not built; ./run vllm-setup builds it)")
        return
    rng = random.Random(1)
    words = ["the", "of", "and", "to", "in", "is", "that", "for", "on", "with", "as", "by", "at", "from", "shipping", "parcel", "order"]
    text = " ".join(rng.choice(words) for _ in range(16_384 // 5))[:16_384]
    chat = {"model": "tiny", "messages": [{"role": "system", "content": text[:12_000]},
                                          {"role": "user", "content": text[12_000:]}]}  # fmt: skip
    comp = {"model": "tiny", "prompt": text}
    cfg = parse_config({
        "plugins": [
            {"type": "precise-prefix-cache-producer",
             "parameters": {"blockSize": 16, "tokenizers": {"tiny": str(model)}}},
            {"type": "prefix-cache-scorer"}, {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"}, {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [{"plugins": [
            {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "queue-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2}, {"pluginRef": "max-score-picker"}]}],
    })  # fmt: skip
    sched = build_scheduler(cfg, random.Random(0))
    producer = sched.plugin(PrecisePrefixProducer)
    assert producer is not None and isinstance(producer.keyer, TokenizingKeyer)
    eps = [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000,
                    metrics=Metrics(waiting=i % 3, running=2, kv_usage=0.3, scraped_at_s=1.0))
           for i in range(1, 9)]  # fmt: skip
    for e in eps:
        sched.observe_endpoint(e)
    print("\ncost of keying a 16 KB prompt (tokenizer + template + vLLM sha256_cbor keys, block 16),")
    print("and of a whole decision with the precise producer on (8 endpoints), median of 200:")
    for label, api, body in (("completion", ApiKind.COMPLETIONS, comp), ("chat", ApiKind.CHAT, chat)):
        req = InferenceRequest("r", "tiny", text, api=api, body=body)
        keyed = producer.keyer.keys(req)
        assert not isinstance(keyed, str), keyed
        producer.index.store(eps[0].id, keyed.keys[: len(keyed.keys) // 2])
        key_t, dec_t = [], []
        for i in range(200):
            t0 = time.perf_counter()
            producer.keyer.keys(req)
            key_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sched.schedule(req, eps, 2.0 + i * 1e-3)
            dec_t.append(time.perf_counter() - t0)
        k, d = statistics.median(key_t), statistics.median(dec_t)
        print(f"  {label:<10} {keyed.num_tokens:>5} tokens {len(keyed.keys):>4} blocks: keying "
              f"{k * 1e3:.2f} ms, decision {d * 1e3:.2f} ms (keying {k / d:.0%} of it)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 trace requests, a small chat")
    ap.add_argument("--skip-routing", action="store_true", help="only the cost of keying a request")
    args = ap.parse_args()
    if not args.skip_routing:
        routing(args.quick)
    cost()
    return 0


if __name__ == "__main__":
    sys.exit(main())
