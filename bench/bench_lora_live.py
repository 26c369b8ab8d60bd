"""LoRA adapters queueing for batch slots (issue 40): the support desk's traffic through real
Envoy and epp to emulated servers that run one adapter a batch, per policy, beside its replay.

docs/examples/support-desk.jsonl (six adapters) sent by ``epp-sim load`` at 2.5x its logged
rate (253 requests in ~50 s) to 4 replicas of 1,024 KV blocks, ``--max-loras 1``: the sweep's
hardest LoRA point (bench_profiles.py ``--workloads lora``), where a request for an adapter
the server is not running waits while another holds the slot. ``--speedup``: the emulated
GPUs and the trace that many times faster (figures scaled back to modelled seconds). Figures:
the client's TTFT p50 / p90 / p99 (to the first text chunk), the prefix-cache hit rate from
the replies' ``usage``; ``--rounds N``: every policy N times (in turn, a fresh stack each),
medians with the p90's range. Policies: the default; the default with ``adapterWeight: 0``
(the slot wait predicted, adapters not kept where they are held); the cache-aware profile;
random (epp's random picker, the same path); ``--router``: the real SGLang router.

Run: ./run bench lora_live [--speedup 1] [--router] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    "adapterWeight 0": ("epp", "bench/configs/default-adapter-weight-0.yaml", "epp"),
    "cache-aware profile": ("epp", "cache-aware", "epp"),
    "random": ("random", "", "random"),
}
ROUTER = ("SGLang router", ("sglang", "", "cache-aware"))
"""With ``--router``."""


async def live(policy: str, config: str, speedup: float) -> dict[str, float]:
    options = StackOptions(replicas=REPLICAS, policy=policy, config=str(ROOT / config) if config.endswith(".yaml")
                           else config, speedup=speedup, kv_blocks=KV_BLOCKS, model=BASE_MODEL,
                           lora_adapters=ADAPTERS, max_loras=MAX_LORAS, fair=True, ready_timeout_s=120)  # fmt: skip
    stack = await start_stack(options)
    try:
        trace = RequestLog.load(TRACE, time_scale=1 / (RATE * speedup))
        sent = await run_load(stack.gateway_url, trace, LoadOptions(BASE_MODEL))
    finally:
        await stack.stop()
    s = summarize(sent)
    return {"requests": s.requests, "ok": s.ok, "hit": s.hit_rate, "p50": s.ttft_p50_s * speedup,
            "p90": s.ttft_p90_s * speedup, "p99": s.ttft_p99_s * speedup}  # fmt: skip


def replay(spec: str, config: str) -> dict[str, float]:
    if spec == "epp" and config:
        spec = f"epp:{ROOT / config if config.endswith('.yaml') else config}"
    name, factory = policy_factory(spec)
    cfg = ReplayConfig(replicas=REPLICAS, kv_blocks=KV_BLOCKS, max_loras=MAX_LORAS, model=BASE_MODEL)
    s = replay_summary(Replayer(cfg).run(RequestLog.load(TRACE, time_scale=1 / RATE), factory, name))
    return {"hit": s.hit_rate, "p50": s.ttft_p50_s, "p90": s.ttft_p90_s, "p99": s.ttft_p99_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speedup", type=float, default=1.0, help="emulated GPUs this many times real time")
    ap.add_argument("--router", action="store_true", help="also the real SGLang router behind Envoy")
    ap.add_argument("--rounds", type=int, default=1, help="live runs of every policy, in turn")
    args = ap.parse_args()
    if args.speedup <= 0 or args.rounds < 1:
        ap.error("--speedup must be > 0, --rounds at least 1")
    policies = {**POLICIES, **(dict([ROUTER]) if args.router else {})}
    print(f"# support desk at {RATE:g}x, {REPLICAS} replicas x {KV_BLOCKS} KV blocks, {MAX_LORAS} adapter a "
          f"batch; live: real Envoy + epp + emulated servers at speedup {args.speedup:g} (figures in modelled "
          "seconds); replay: the same trace offline\n")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in policies}
    for r in range(args.rounds):
        for label, (policy, config, _) in policies.items():
            g = asyncio.run(live(policy, config, args.speedup))
            runs[label].append(g)
            print(f"round {r + 1} {label}: {g['ok']:.0f} of {g['requests']:.0f} ok, hit {g['hit']:.1%}, "
                  f"TTFT p50 / p90 / p99 {g['p50']:.2f} / {g['p90']:.2f} / {g['p99']:.2f} s", flush=True)  # fmt: skip
    rows = []
    for label, (_, config, spec) in policies.items():
        med = {k: statistics.median(g[k] for g in runs[label]) for k in ("hit", "p50", "p90", "p99")}
        p90s = [g["p90"] for g in runs[label]]
        off = replay(spec, config)
        rows.append([label, len(p90s), f"{med['hit']:.1%}", f"{med['p50']:.2f}",
                     f"{med['p90']:.2f} ({min(p90s):.2f}-{max(p90s):.2f})", f"{med['p99']:.2f}", f"{off['hit']:.1%}",
                     f"{off['p50']:.2f}", f"{off['p90']:.2f}", f"{off['p99']:.2f}"])  # fmt: skip
    print("\n" + table(["policy", "live rounds", "live hit", "live TTFT p50", "p90 (range)", "p99", "replay hit",
                        "replay TTFT p50", "p90", "p99"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
