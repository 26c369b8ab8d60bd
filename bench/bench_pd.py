"""Prefill/decode disaggregation in the replay (issue 41): aggregated serving against P/D
pools at equal GPU count, for several P:D splits and deciders, on the shared Mooncake-format
trace and a generated long-prompt workload.

Every run has 8 replicas (the A100 / Llama-3-8B cost preset, KV moved at ~5 us a token plus
2 ms). ``aggregated``: the default profile; the P/D rows: the shipped ``pd`` profile on P
prefill and D decode replicas with its decider (``load-aware >256``) or another:
``always`` (``always-disagg-pd-decider``), ``>N`` (``prefix-based-pd-decider``: the decoder
lacks more than N prompt tokens), ``cache-aware >N`` and ``slack 4k`` (``slackTokens`` 4,096
instead of 32k); epp/plugins/disagg/README.md gives each decider's rule. SLO attainment is
DistServe's measure of P/D.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_profiles import pool_map  # noqa: E402
from epp.config.loader import default_config  # noqa: E402
from simulator.replay.policies import pd_config, policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer, pd_roles  # noqa: E402
from simulator.replay.report import summarize  # noqa: E402
from simulator.replay.workload import MooncakeTrace, Workload, build_generator  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
GPUS = 8
LONG_PROMPTS = {"num_requests": 600, "num_docs": 4000, "doc_len": 4096, "docs_per_query": 2,
                "zipf_s": 0.6, "preamble_len": 512, "question_len": 128, "output_len": 384,
                "rate": 4.0, "seed": 0}  # fmt: skip
"""RAG-shaped requests of ~8.8k tokens, two documents drawn from 4,000 (little reuse), 384
output tokens, 4 a second."""
SLO_TTFT_S, SLO_TPOT_S = 3.0, 0.025
"""A request meets the SLO when its first token comes within 3 s and its tokens then stream
at 25 ms or less apart on average (40 tokens a second, faster than anyone reads)."""

DECIDERS = {
    "always": ("always-disagg-pd-decider", {}),
    ">256": ("prefix-based-pd-decider", {"nonCachedTokens": 256}),
    ">4096": ("prefix-based-pd-decider", {"nonCachedTokens": 4096}),
    ">16384": ("prefix-based-pd-decider", {"nonCachedTokens": 16384}),
    "cache-aware >256": ("cache-aware-pd-decider", {"nonCachedTokens": 256}),
    "load-aware >256 (pd)": ("load-aware-pd-decider", {"nonCachedTokens": 256}),
    "load-aware >256 slack 4k": ("load-aware-pd-decider", {"nonCachedTokens": 256, "slackTokens": 4096}),
}  # fmt: skip
SPLITS = ("2:6", "3:5", "4:4", "5:3")
KV_BLOCKS = {"mooncake": 16384, "long-prompts": 16384}
FIGURES = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "throughput_tok_s", "split_share")  # fmt: skip


def run_one(job: tuple[str, str, str, bool]) -> tuple[str, str, str, dict[str, Any]]:
    """(workload, split, decider, quick) -> its figures; split ``aggregated``: no P/D."""
    wname, split, decider, quick = job
    if wname == "mooncake":
        work: Workload = MooncakeTrace.load(TRACE, 1.0, 800 if quick else 0)
    else:
        params = dict(LONG_PROMPTS, num_requests=200) if quick else LONG_PROMPTS
        work = build_generator("rag", params)
    roles = () if split == "aggregated" else pd_roles(split)
    config = default_config() if split == "aggregated" else pd_config(*DECIDERS[decider])
    name, factory = policy_factory("epp", config)
    result = Replayer(ReplayConfig(replicas=GPUS, kv_blocks=KV_BLOCKS[wname], roles=roles)).run(work, factory, name)  # fmt: skip
    met = sum(
        o.first_token_s - o.arrival_s <= SLO_TTFT_S
        and (o.output_tokens < 2 or (o.finish_s - o.first_token_s) / (o.output_tokens - 1) <= SLO_TPOT_S)
        for o in result.outcomes if not o.rejected
    )  # fmt: skip
    s = summarize(result)
    return wname, split, decider, {"slo": met / len(result.outcomes), **{k: getattr(s, k) for k in FIGURES}}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="800 trace rows, 200 generated requests, two splits")  # fmt: skip
    quick = ap.parse_args().quick
    jobs = [(w, "aggregated", "-", quick) for w in KV_BLOCKS]
    jobs += [(w, sp, d, quick) for w in KV_BLOCKS for sp in (SPLITS[1:3] if quick else SPLITS) for d in DECIDERS]  # fmt: skip
    results = pool_map(run_one, jobs)
    print(f"{GPUS} replicas in every row; TTFT and TPOT in seconds and milliseconds; "
          f"SLO met: TTFT <= {SLO_TTFT_S:g} s and TPOT <= {SLO_TPOT_S * 1e3:g} ms; "
          "`split`: requests prefilled apart; hit rate: prefix-cache hits (the prefiller's for a split request)\n\n"
          f"mooncake: {TRACE.name} ({'first 800 rows' if quick else 'all rows'}), "
          f"KV {KV_BLOCKS['mooncake']} blocks of 16 tokens per replica; long-prompts: the rag "
          f"generator with {LONG_PROMPTS if not quick else dict(LONG_PROMPTS, num_requests=200)}, "
          f"KV {KV_BLOCKS['long-prompts']} blocks; cost preset a100-llama3-8b\n")  # fmt: skip
    for wname in KV_BLOCKS:
        rows = [r for r in results if r[0] == wname]
        print(f"### {wname}\n\n| P:D | decider | SLO met | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | output tok/s "
              "| split | hit rate |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
        for _, split, decider, f in rows:
            print(f"| {split} | {decider} | {f['slo']:.1%} | {f['ttft_p50_s']:.2f} | {f['ttft_p90_s']:.2f} "
                  f"| {f['tpot_p50_s'] * 1e3:.0f} | {f['tpot_p90_s'] * 1e3:.0f} | {f['throughput_tok_s']:,.0f} "
                  f"| {f['split_share']:.0%} | {f['hit_rate']:.1%} |")  # fmt: skip
        base, slo = rows[0][3], max(rows[1:], key=lambda r: r[3]["slo"])
        best, tpot = (min(rows[1:], key=lambda r: r[3][k]) for k in ("ttft_p90_s", "tpot_p90_s"))
        print(f"\nAggregated: TTFT p90 {base['ttft_p90_s']:.2f} s, TPOT p90 {base['tpot_p90_s'] * 1e3:.0f} ms. "
              f"Best P/D on TTFT p90: {best[1]} {best[2]} ({best[3]['ttft_p90_s']:.2f} s, TPOT p90 "
              f"{best[3]['tpot_p90_s'] * 1e3:.0f} ms); best P/D on TPOT p90: {tpot[1]} {tpot[2]} "
              f"({tpot[3]['tpot_p90_s'] * 1e3:.0f} ms, TTFT p90 {tpot[3]['ttft_p90_s']:.2f} s). SLO met: "
              f"aggregated {base['slo']:.1%}, best P/D {slo[1]} {slo[2]} {slo[3]['slo']:.1%}.\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
