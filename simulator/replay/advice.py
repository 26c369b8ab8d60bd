"""What the replay's table means and what to do next, printed under it.

* ``prefix_reuse``: the share of the trace's prompt tokens that repeat a prefix an earlier
  request of the trace sent (whole blocks, chained as the servers key them): the hit rate a
  pool with unbounded KV caches and perfect routing would reach. 0 means no request shares a
  prefix with another (a public trace converted from lengths only): every policy then hits
  0% whatever it does, and the replay says nothing about prefix-aware routing.
* ``kv_fit``: how many of the trace's requests are larger than a replica's whole KV cache
  (prompt and output: the replay rejects them, as vLLM refuses them) and the size that fits
  the largest; ``too_large_warning`` says so, before any figure, with that size.
* ``advice``: a legend for the columns that need one, the policy that did best and how to
  run it, and, when the best hit rate is far below what the trace could give, that the KV
  caches are too small to show the routing's effect (``--kv-blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from simulator.model.cache import text_block_hashes
from simulator.replay.bound import TtftBound
from simulator.replay.report import PolicyStats
from simulator.replay.workload import MOONCAKE_BLOCK_TOKENS, Workload

NOT_DEPLOYABLE = ("oracle", "ttft-oracle")
"""Policies that read what no router can know (the replicas' true caches, what-if runs)."""
EPP_POLICIES = ("epp", "precise")
LEGEND = {
    "hit rate": "prompt tokens served from the replicas' prefix caches",
    "queue share": "share of the time to first token spent waiting in a replica's queue",
    "imbalance": "most requests one replica got / the mean (1.00 = even)",
    "rejected": "requests larger than a replica's whole KV cache (never served, as vLLM "
    "refuses a prompt over its context)",
    "sim req/s": "the replayer's own speed",
    "TTFT pred. error": "the predicted-TTFT scorer's error: median relative / mean absolute",
}


def prefix_reuse(workload: Workload, block_tokens: int) -> float:
    """The share of prompt tokens in blocks whose whole prefix an earlier request sent
    (module docstring); 0.0 for an empty workload."""
    seen: set[tuple[int, int]] = set()
    total = reused = 0
    for r in workload.requests():
        total += r.prompt_tokens
        seed = xxhash.xxh3_64_intdigest(r.adapter.encode()) if r.adapter else 0
        if r.hash_ids:
            blocks, size = list(r.hash_ids), MOONCAKE_BLOCK_TOKENS
        else:
            blocks, size = text_block_hashes(r.prompt, block_tokens, seed), block_tokens
        matched = 0
        for h in blocks:
            if (seed, h) not in seen:
                break
            matched += 1
        reused += min(matched * size, r.prompt_tokens)
        seen.update((seed, h) for h in blocks)
    return reused / total if total else 0.0


def no_reuse_warning(name: str) -> str:
    return (f"warning: no two requests of {name} share a prefix (a trace converted from "
            "prompt lengths carries no prompts): every policy's hit rate will be 0%, which "
            "says nothing about prefix-aware routing. Replay a trace with prompts or shared "
            "block ids (docs/replay.md), or a generated workload (--workload)")  # fmt: skip


@dataclass(slots=True, frozen=True)
class KvFit:
    requests: int
    too_large: int
    """Requests needing more KV blocks (prompt and output) than a replica has: rejected."""
    largest_blocks: int
    """KV blocks the largest request needs: the least ``--kv-blocks`` that serves them all."""


def kv_fit(bounds: Sequence[TtftBound], kv_blocks: int) -> KvFit:
    """From the requests' ``blocks_needed`` (``ttft_lower_bounds``)."""
    needed = [b.blocks_needed for b in bounds]
    return KvFit(len(needed), sum(n > kv_blocks for n in needed), max(needed, default=0))


def too_large_warning(fit: KvFit, kv_blocks: int, block_tokens: int) -> str:
    """'' when every request fits; else what was rejected and the size that fits them all."""
    if not fit.too_large:
        return ""
    every = fit.too_large == fit.requests
    which = ("every request of the trace needs" if every
             else f"{fit.too_large:,} of the trace's {fit.requests:,} requests need")  # fmt: skip
    served = "nothing was served, so the table has no figures" if every else "the table's figures are of the others"
    return (f"warning: {which} more KV than a replica holds "
            f"({kv_blocks * block_tokens:,} tokens: --kv-blocks {kv_blocks} of {block_tokens} "
            f"tokens) and were rejected, as vLLM refuses a request over its KV cache; {served}. "
            f"The largest needs {fit.largest_blocks:,} blocks (prompt and output): replay with "
            f"--kv-blocks {fit.largest_blocks} or more")  # fmt: skip


def advice(stats: Sequence[PolicyStats], reuse: float, kv_blocks: int, block_tokens: int,
           config: str = "", fit: KvFit | None = None) -> list[str]:  # fmt: skip
    """Lines to print under the table (module docstring); ``config`` is the epp config the
    epp policies ran (``--config``; '' = the shipped default); ``fit``: the requests against
    the KV cache (``kv_fit``), so a suggested size serves the largest."""
    columns = ["hit rate", "queue share", "imbalance", "rejected", "sim req/s"]
    if any(s.ttft_pred_count for s in stats):
        columns.append("TTFT pred. error")
    lines = [f"{c}: {LEGEND[c]}" for c in columns]
    lines.append(f"what this trace could hit (unbounded caches, perfect routing): {reuse:.1%}")
    best = _best(stats)
    if best is not None:
        lines.append(_verdict(best, stats, config))
    served = [s for s in stats if s.served]
    top = max((s.hit_rate for s in served), default=0.0)
    if served and reuse >= 0.2 and top < reuse / 2:
        kv_tokens = kv_blocks * block_tokens
        more = max(kv_blocks * 4, fit.largest_blocks if fit is not None else 0)
        lines.append(
            f"the best hit rate ({top:.1%}) is far below the {reuse:.1%} this trace could hit: "
            f"each replica's KV cache ({kv_tokens:,} tokens, --kv-blocks {kv_blocks}) holds "
            f"little of what it sees, so every policy recomputes; replay with more KV "
            f"(--kv-blocks {more}) to see what routing gains on your servers' caches"
        )
    return lines


def _best(stats: Sequence[PolicyStats]) -> PolicyStats | None:
    ranked = [s for s in stats if s.policy.partition(":")[0] not in NOT_DEPLOYABLE
              and not math.isnan(s.ttft_p90_s)]  # fmt: skip
    return min(ranked, key=lambda s: s.ttft_p90_s, default=None)


def _verdict(best: PolicyStats, stats: Sequence[PolicyStats], config: str) -> str:
    name, _, arg = best.policy.partition(":")
    against = next((s for s in stats if s.policy == "random"), None)
    versus = ""
    if against is not None and against is not best and best.ttft_p90_s > 0:
        versus = f", random {against.ttft_p90_s:.2f} s: {against.ttft_p90_s / best.ttft_p90_s:.2f}x"
    line = (f"best here: {best.policy}, the lowest TTFT p90 of the deployable policies "
            f"({best.ttft_p90_s:.2f} s{versus}; hit rate {best.hit_rate:.1%})")  # fmt: skip
    cfg = arg or config or "default"
    if name == "epp":
        return line + f"; run it: epp serve --config {cfg}"
    if name == "precise":
        return line + f"; run it: epp serve --config {cfg} with the precise producer (docs/precise-prefix.md)"
    return line + "; a baseline of another router, not an epp config (docs/replay.md)"
