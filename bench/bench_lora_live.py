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

from bench.bench_profiles import replay  # noqa: E402
from bench.harness import count  # noqa: E402
from bench.results import table  # noqa: E402
from simulator.load import LoadOptions, LoadSummary, run_load, summarize  # noqa: E402
from simulator.replay.replayer import ReplayConfig  # noqa: E402
from simulator.replay.requestlog import RequestLog  # noqa: E402
from simulator.stack.stack import StackOptions, start_stack  # noqa: E402

TRACE = ROOT / "docs" / "examples" / "support-desk.jsonl"
BASE_MODEL = "support-base"
ADAPTERS = tuple(f"desk-{i}" for i in range(6))
REPLICAS, KV_BLOCKS, MAX_LORAS, RATE = 4, 1024, 1, 2.5
ADAPTER_WEIGHT_0 = str(ROOT / "bench/configs/default-adapter-weight-0.yaml")
POLICIES = {  # label: (stack policy, epp config, replay policy)
    "default": ("epp", "", "epp"),
    "adapterWeight 0": ("epp", ADAPTER_WEIGHT_0, f"epp:{ADAPTER_WEIGHT_0}"),
    "cache-aware profile": ("epp", "cache-aware", "epp:cache-aware"),
    "random": ("random", "", "random"),
}
ROUTER = ("SGLang router", ("sglang", "", "cache-aware"))  # with --router


async def live(policy: str, config: str) -> LoadSummary:
    stack = await start_stack(StackOptions(replicas=REPLICAS, policy=policy, config=config,
                                           kv_blocks=KV_BLOCKS, model=BASE_MODEL, lora_adapters=ADAPTERS,
                                           max_loras=MAX_LORAS, fair=True, ready_timeout_s=120))  # fmt: skip
    try:
        return summarize(await run_load(stack.gateway_url, RequestLog.load(TRACE, time_scale=1 / RATE),
                                        LoadOptions(BASE_MODEL)))  # fmt: skip
    finally:
        await stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", action="store_true", help="also the real SGLang router behind Envoy")  # fmt: skip
    ap.add_argument("--rounds", type=count, default=1, help="live runs of every policy, in turn")
    args = ap.parse_args()
    policies = {**POLICIES, **(dict([ROUTER]) if args.router else {})}
    print(f"# support desk at {RATE:g}x, {REPLICAS} replicas x {KV_BLOCKS} KV blocks, {MAX_LORAS} adapter a "
          f"batch; live: real Envoy + epp + emulated servers at speedup 1 (figures in modelled "
          "seconds); replay: the same trace offline\n")  # fmt: skip
    runs: dict[str, list[LoadSummary]] = {label: [] for label in policies}
    for r in range(args.rounds):
        for label, (policy, config, _) in policies.items():
            g = asyncio.run(live(policy, config))
            runs[label].append(g)
            print(f"round {r + 1} {label}: {g.ok} of {g.requests} ok, hit {g.hit_rate:.1%}, TTFT p50 / p90 / p99 "
                  f"{g.ttft_p50_s:.2f} / {g.ttft_p90_s:.2f} / {g.ttft_p99_s:.2f} s", flush=True)  # fmt: skip
    rows, cfg = [], ReplayConfig(replicas=REPLICAS, kv_blocks=KV_BLOCKS, max_loras=MAX_LORAS, model=BASE_MODEL)
    for label, got in runs.items():
        med = {k: statistics.median(getattr(g, k) for g in got) for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s")}
        p90s = [g.ttft_p90_s for g in got]
        off = replay(cfg, RequestLog.load(TRACE, time_scale=1 / RATE), policies[label][2])
        rows.append([label, len(p90s), f"{med['hit_rate']:.1%}", f"{med['ttft_p50_s']:.2f}",
                     f"{statistics.median(p90s):.2f} ({min(p90s):.2f}-{max(p90s):.2f})", f"{med['ttft_p99_s']:.2f}",
                     f"{off.hit_rate:.1%}", f"{off.ttft_p50_s:.2f}", f"{off.ttft_p90_s:.2f}",
                     f"{off.ttft_p99_s:.2f}"])  # fmt: skip
    print("\n" + table(["policy", "live rounds", "live hit", "live TTFT p50", "p90 (range)", "p99", "replay hit",
                        "replay TTFT p50", "p90", "p99"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
