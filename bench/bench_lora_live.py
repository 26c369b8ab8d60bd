"""LoRA adapters queueing for batch slots (issue 40): the support desk's traffic through real
Envoy and epp to emulated servers that run one adapter a batch, per policy, beside its replay.

docs/examples/support-desk.jsonl (six adapters) sent by ``epp-sim load`` at 2.5x its logged
rate (253 requests in ~50 s) to 4 replicas of 1,024 KV blocks, one adapter a batch: the
sweep's hardest LoRA point. Figures: the client's TTFT p50 / p90 / p99 and the hit rate from
the replies' ``usage``, medians over ``--rounds`` with the p90's range. Policies: the default;
the default with ``adapterWeight: 0``; the cache-aware profile; epp's random picker;
``--router``: the real SGLang router.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import count  # noqa: E402
from bench.results import table  # noqa: E402
from simulator.load import LoadOptions, run_load, summarize  # noqa: E402
from simulator.replay.policies import policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer  # noqa: E402
from simulator.replay.report import summarize as replay_summary  # noqa: E402
from simulator.replay.requestlog import RequestLog  # noqa: E402
from simulator.stack.stack import StackOptions, start_stack  # noqa: E402

TRACE = ROOT / "docs" / "examples" / "support-desk.jsonl"
BASE_MODEL = "support-base"
ADAPTERS = tuple(f"desk-{i}" for i in range(6))
REPLICAS, KV_BLOCKS, MAX_LORAS, RATE = 4, 1024, 1, 2.5
POLICIES = {  # label: (stack policy, epp config, replay policy)
    "default": ("epp", "", "epp"),
    "adapterWeight 0": ("epp", str(ROOT / "bench/configs/default-adapter-weight-0.yaml"), "epp"),
    "cache-aware profile": ("epp", "cache-aware", "epp"),
    "random": ("random", "", "random"),
}
ROUTER = ("SGLang router", ("sglang", "", "cache-aware"))
"""With ``--router``."""


async def live(policy: str, config: str) -> dict[str, float]:
    stack = await start_stack(StackOptions(replicas=REPLICAS, policy=policy, config=config,
                                           kv_blocks=KV_BLOCKS, model=BASE_MODEL, lora_adapters=ADAPTERS,
                                           max_loras=MAX_LORAS, fair=True, ready_timeout_s=120))  # fmt: skip
    try:
        trace = RequestLog.load(TRACE, time_scale=1 / RATE)
        s = summarize(await run_load(stack.gateway_url, trace, LoadOptions(BASE_MODEL)))
    finally:
        await stack.stop()
    return {"requests": s.requests, "ok": s.ok, "hit": s.hit_rate, "p50": s.ttft_p50_s, "p90": s.ttft_p90_s,
            "p99": s.ttft_p99_s}  # fmt: skip


def replay(spec: str, config: str) -> dict[str, float]:
    name, factory = policy_factory(f"epp:{config}" if spec == "epp" and config else spec)
    cfg = ReplayConfig(replicas=REPLICAS, kv_blocks=KV_BLOCKS, max_loras=MAX_LORAS, model=BASE_MODEL)  # fmt: skip
    s = replay_summary(Replayer(cfg).run(RequestLog.load(TRACE, time_scale=1 / RATE), factory, name))  # fmt: skip
    return {"hit": s.hit_rate, "p50": s.ttft_p50_s, "p90": s.ttft_p90_s, "p99": s.ttft_p99_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", action="store_true", help="also the real SGLang router behind Envoy")  # fmt: skip
    ap.add_argument("--rounds", type=count, default=1, help="live runs of every policy, in turn")
    args = ap.parse_args()
    policies = {**POLICIES, **(dict([ROUTER]) if args.router else {})}
    print(f"# support desk at {RATE:g}x, {REPLICAS} replicas x {KV_BLOCKS} KV blocks, {MAX_LORAS} adapter a "
          f"batch; live: real Envoy + epp + emulated servers at speedup 1 (figures in modelled "
          "seconds); replay: the same trace offline\n")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in policies}
    for r in range(args.rounds):
        for label, (policy, config, _) in policies.items():
            g = asyncio.run(live(policy, config))
            runs[label].append(g)
            print(f"round {r + 1} {label}: {g['ok']:.0f} of {g['requests']:.0f} ok, hit {g['hit']:.1%}, "
                  f"TTFT p50 / p90 / p99 {g['p50']:.2f} / {g['p90']:.2f} / {g['p99']:.2f} s", flush=True)  # fmt: skip
    rows = []
    for label, (_, config, spec) in policies.items():
        med = {k: statistics.median(g[k] for g in runs[label]) for k in ("hit", "p50", "p90", "p99")}  # fmt: skip
        p90s, off = [g["p90"] for g in runs[label]], replay(spec, config)
        rows.append([label, len(p90s), f"{med['hit']:.1%}", f"{med['p50']:.2f}",
                     f"{med['p90']:.2f} ({min(p90s):.2f}-{max(p90s):.2f})", f"{med['p99']:.2f}", f"{off['hit']:.1%}",
                     f"{off['p50']:.2f}", f"{off['p90']:.2f}", f"{off['p99']:.2f}"])  # fmt: skip
    print("\n" + table(["policy", "live rounds", "live hit", "live TTFT p50", "p90 (range)", "p99", "replay hit",
                        "replay TTFT p50", "p90", "p99"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
