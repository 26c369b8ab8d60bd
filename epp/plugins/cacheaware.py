"""``cache-aware-scorer``: the SGLang router's ``cache_aware`` rule as an epp scorer, so that
the rule and epp's own scorers can be compared through the same request path (the local
stack's ``--fair`` runs, where every policy pays the same gateway and ext_proc CPU).

The rule, per request: if the requests in flight are imbalanced (``max - min >
balance_abs_threshold`` and ``max > balance_rel_threshold x min``), the least loaded
endpoint; else, if the longest prefix match covers more than ``cache_threshold`` of the
prompt, the endpoint holding it; else the endpoint that has been sent the least prompt
text not already cached (the router's "smallest tree"). The chosen endpoint scores 1, the
others 0 (ties keep 1 each; the picker breaks them).

Where it differs from the router: the prefix match is epp's (the approximate index's
chunk match, or KV events, whichever producer runs) instead of the router's character
radix tree; load is the requests epp has in flight there (``CycleState.in_flight``, the
Director's count, as the router counts its own);
"tree size" is the unmatched characters sent to the endpoint, never shrunk (the router's
tree is capped at 2^26 characters a worker, which a run here never reaches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.types import CycleState, PickResult


@dataclass(slots=True, frozen=True)
class CacheAwareParams:
    cache_threshold: float = 0.3
    """A prefix match above this fraction of the prompt routes to the endpoint holding it
    (the router's ``--cache-threshold``; 0.3 in sglang-router 0.3)."""
    balance_abs_threshold: int = 64
    """With ``balance_rel_threshold``: the load gap at which load alone decides."""
    balance_rel_threshold: float = 1.5
    """With ``balance_abs_threshold``: the ratio of the busiest to the idlest endpoint's load at which load alone decides."""


class CacheAwareScorer:
    def __init__(self, name: str, params: CacheAwareParams) -> None:
        self.name = name
        self.params = params
        self.sent_chars: dict[EndpointId, float] = {}
        """Per endpoint, the prompt characters sent there beyond their prefix match."""

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        p = self.params
        in_flight = state.in_flight
        loads = [in_flight.get(e.id, 0) for e in endpoints]
        hi, lo = max(loads, default=0), min(loads, default=0)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            return [1.0 if n == lo else 0.0 for n in loads]
        prefix = state.prefix
        ratios = [prefix.ratio(e.id) for e in endpoints]
        best = max(ratios, default=0.0)
        if best > p.cache_threshold:
            return [1.0 if r == best else 0.0 for r in ratios]
        sizes = [self.sent_chars.get(e.id, 0.0) for e in endpoints]
        least = min(sizes, default=0.0)
        return [1.0 if s == least else 0.0 for s in sizes]

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        target = result.target.id
        prefix = state.prefix
        unmatched = len(state.request.prompt) - prefix.matched.get(target, 0) * prefix.block_chars
        self.sent_chars[target] = self.sent_chars.get(target, 0.0) + max(0, unmatched)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        pass

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        self.sent_chars.pop(endpoint_id, None)
