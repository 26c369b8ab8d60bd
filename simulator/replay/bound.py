"""A lower bound on the time to first token that any routing policy can give in the replay.

Which policy routes, with what knowledge, does not change the engine's physics
(``simulator.model``): a request is admitted at an engine step boundary no earlier than its
arrival, and its first token comes at the end of that step, which lasts at least its own
prefill (``CostModel.prefill_s`` of its uncached and cached tokens) plus one decode step of
a batch of one. Its cached tokens are a leading run of its KV blocks, each cached only if
some other request brought it first: its prompt's blocks (no earlier than its arrival) or,
for a chat turn, the blocks of its prompt and reply that the replica keeps once the reply
ends (no earlier than its arrival plus the least prefill and one decode step of a batch of
one per output token).

So for request ``r`` arriving at ``a`` with a prompt of ``P`` tokens and blocks ``b_0 ..
b_k`` (the last prompt token is always recomputed, as the cache does), let ``A_j`` be the
earliest time every block up to ``b_j`` was brought by another request (its arrival). Then

    TTFT(r) >= decode_step_s(1) + min over j in {-1, 0, .., k} of
               max(0, A_j - a) + prefill_s(P - h_j, h_j),   h_j = (j + 1) * block size

(waiting for a later request that brings more of its prefix is allowed: the bound takes the
best wait). The bound ignores KV capacity, the other replicas and every queue: a policy that
routed every request to a replica holding everything any other request ever brought, and
never queued, would reach it. Because it holds request by request, every percentile of the
bounds is at most the same percentile of any policy's TTFTs over the same requests.

``bench_profiles.py`` prints its p90 per point (``bound p90``): where 90% of it is above the default
policy's p90, no policy can bring the p90 10% below the default's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from simulator.model.cache import model_seed
from simulator.model.cost import CostModel
from simulator.replay.workload import (
    TraceRequest,
    engine_block_hashes,
    final_block_hashes,
    reply_text,
)


@dataclass(slots=True, frozen=True)
class TtftBound:
    request_id: str
    bound_s: float
    """No policy gives this request its first token sooner (seconds after arrival)."""
    blocks_needed: int
    """KV blocks the request needs (prompt and output), for the replicas' size limit."""


def ttft_lower_bounds(
    requests: Iterable[TraceRequest],
    cost: CostModel,
    block_size_tokens: int,
    model: str = "sim-model",
    replies_cached: bool = True,
) -> list[TtftBound]:
    """One bound per request, in the order given (arrival order, as workloads yield them);
    ``replies_cached`` as the replay's (``ReplayConfig.replies_cached``)."""
    reqs = list(requests)
    seed = model_seed(model)
    bs = block_size_tokens
    prompts: list[list[int]] = []
    # earliest two (arrival, request index) that bring each block: a request's own blocks
    # count only when another request brings them too
    first: dict[int, tuple[float, int]] = {}
    second: dict[int, float] = {}
    for i, req in enumerate(reqs):
        blocks = engine_block_hashes(req, bs, seed)
        prompts.append(blocks)
        final = final_block_hashes(req, reply_text(req), bs, seed) if replies_cached else None
        # the prompt's blocks come with the request; the reply's when it ends, after at
        # least the least prefill and one decode step per output token
        brought = dict.fromkeys(blocks, req.arrival_s)
        if final is not None:
            ends = req.arrival_s + cost.prefill_s(0) + req.output_tokens * cost.decode_step_s(1)
            for h in final:
                brought.setdefault(h, ends)
        for h, t in brought.items():
            seen = first.get(h)
            if seen is None:
                first[h] = (t, i)
            elif t < seen[0]:
                second[h] = seen[0]
                first[h] = (t, i)
            elif t < second.get(h, math.inf):
                second[h] = t
    decode_s = cost.decode_step_s(1)
    out: list[TtftBound] = []
    for i, (req, blocks) in enumerate(zip(reqs, prompts, strict=True)):
        out.append(TtftBound(
            req.request_id,
            decode_s + _best_prefill_s(req, blocks, i, first, second, cost, bs),
            -(-(req.prompt_tokens + req.output_tokens) // bs),
        ))  # fmt: skip
    return out


def _best_prefill_s(
    req: TraceRequest,
    blocks: Sequence[int],
    index: int,
    first: dict[int, tuple[float, int]],
    second: dict[int, float],
    cost: CostModel,
    bs: int,
) -> float:
    """The least wait plus prefill over every leading run of blocks the request could hit."""
    a = req.arrival_s
    p = req.prompt_tokens
    best = cost.prefill_s(p, 0)
    ready = a
    for j in range(min(len(blocks), max(0, (p - 1) // bs))):
        t, who = first[blocks[j]]
        if who == index:
            t = second.get(blocks[j], math.inf)
        ready = max(ready, t)
        wait = ready - a
        if wait >= best:  # longer waits only cost more
            break
        hit = (j + 1) * bs
        best = min(best, wait + cost.prefill_s(p - hit, hit))
    return best


def bound_percentile(bounds: Sequence[TtftBound], kv_blocks: int, q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation, as the replay's report) of the
    bounds of the requests a replica of ``kv_blocks`` blocks can serve (the replay rejects the
    rest, and its TTFT figures leave them out)."""
    import numpy as np

    values = np.array([b.bound_s for b in bounds if b.blocks_needed <= kv_blocks])
    return float(np.percentile(values, q)) if values.size else math.nan
