"""``token-load-scorer`` and ``token-load-filter``: load counted in tokens, from epp's own
accounting between scrapes.

A request count treats a 100k-token agent turn and a 200-token question alike; the tokens a
request holds on its server do not. Each plugin counts, per endpoint, the tokens of the
requests epp sent there and that have not ended: what each keeps in the KV cache (its prompt,
``ceil(chars / 4)``, and its output, ``max_tokens`` or ``decodeTokens`` when the request sets
none), and apart from it the prompt still to prefill, until the first token comes back. A request ends at its response's end or cancellation; one never heard of
again is dropped after ``ttlSeconds``.

* the scorer: ``1 - load / max load`` over the candidates (all 1 when none carries load), or
  over ``scaleTokens`` when that is more;
  prefill tokens weigh ``prefillWeight`` times more than tokens merely held (they are the
  work that delays the next request's first token).
* the filter: keeps endpoints whose load is at most ``maxTokens``, or, when the server
  reports its KV capacity, at most ``maxShare`` of it; all of them when none qualifies
  (llm-d's utilization filter, in tokens).

The scorer exports what it counts: ``epp_endpoint_tokens_in_flight{endpoint,phase}`` (phase
``held``: tokens the requests keep in KV; ``prefill``: prompt tokens before their first token).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.interfaces import PluginContext
from epp.framework.types import CycleState, PickResult, ResponseInfo

_CHARS_PER_TOKEN = 4
_MAX_TRACKED = 100_000
"""Requests tracked at most (the oldest dropped first): bounded whatever the traffic."""


@dataclass(slots=True, frozen=True)
class TokenLoadParams:
    decode_tokens: int = 256
    """Output tokens assumed for a request that sets no ``max_tokens``."""
    max_decode_tokens: int = 4096
    """A request's ``max_tokens`` counts at most this much (clients often send the context size)."""
    prefill_weight: float = 4.0
    """Scorer: a token still to prefill weighs this many tokens held."""
    scale_tokens: float = 0.0
    """Scorer: loads are read against the busiest candidate's or this many (weighted) tokens,
    whichever is more. 0: against the busiest alone, so a few hundred tokens in flight push as
    hard as a hundred thousand; a scale leaves short prompts to the other scores."""
    max_tokens: int = 0
    """Filter: keep endpoints with at most this many tokens in flight (0: no absolute cap)."""
    max_share: float = 0.9
    """Filter: keep endpoints whose tokens in flight are at most this share of the KV
    capacity they report (ignored for servers that report none)."""
    ttl_seconds: float = 600.0
    """A request not heard of this long after its pick is no longer counted."""
    __config_min__: ClassVar[dict[str, float]] = {"decode_tokens": 0, "prefill_weight": 0,
                                                  "scale_tokens": 0}  # fmt: skip


@dataclass(slots=True)
class _Held:
    endpoint: EndpointId
    prefill: int
    """Prompt tokens still to prefill (0 after the first token)."""
    held: int
    """Tokens the request keeps in the KV cache."""
    picked_s: float


def _output_tokens(body: Mapping[str, Any] | None, params: TokenLoadParams) -> int:
    if body is not None:
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return min(value, params.max_decode_tokens)
    return params.decode_tokens


class _InFlightTokens:
    """Per-endpoint tokens of the requests in flight, fed by the post-pick, first-token and
    post-response hooks."""

    def __init__(self, params: TokenLoadParams) -> None:
        self.params = params
        self.prefill: dict[EndpointId, int] = {}
        self.held: dict[EndpointId, int] = {}
        self._requests: dict[int, _Held] = {}

    def load(self, endpoint_id: EndpointId, prefill_weight: float = 1.0) -> float:
        return self.held.get(endpoint_id, 0) + (prefill_weight - 1.0) * self.prefill.get(endpoint_id, 0)

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        request = state.request
        prompt = -(-len(request.prompt) // _CHARS_PER_TOKEN)
        held = prompt + _output_tokens(request.body, self.params)
        target = result.target.id
        self._expire(state.now_s)
        entry = _Held(target, prompt, held, state.now_s)
        old = self._requests.pop(id(state), None)
        if old is not None:  # a cycle never heard of again, its identity reused
            self._add(old, -1)
        self._requests[id(state)] = entry
        self._add(entry, 1)
        while len(self._requests) > _MAX_TRACKED:
            self._add(self._requests.pop(next(iter(self._requests))), -1)

    def post_first_token(self, state: CycleState, result: PickResult, ttft_s: float) -> None:
        entry = self._requests.get(id(state))
        if entry is not None and entry.prefill:
            self.prefill[entry.endpoint] = self.prefill.get(entry.endpoint, 0) - entry.prefill
            entry.prefill = 0

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None:
        entry = self._requests.pop(id(state), None)
        if entry is not None:
            self._add(entry, -1)

    def _add(self, entry: _Held, sign: int) -> None:
        eid = entry.endpoint
        self.prefill[eid] = self.prefill.get(eid, 0) + sign * entry.prefill
        self.held[eid] = self.held.get(eid, 0) + sign * entry.held

    def _expire(self, now_s: float) -> None:
        requests = self._requests
        ttl = self.params.ttl_seconds
        while requests:
            key = next(iter(requests))  # picked in time order
            entry = requests[key]
            if now_s - entry.picked_s <= ttl:
                return
            del requests[key]
            self._add(entry, -1)


class TokenLoadScorer(_InFlightTokens):
    def __init__(self, name: str, params: TokenLoadParams) -> None:
        super().__init__(params)
        self.name = name

    async def start(self, ctx: PluginContext) -> None:
        ctx.register(_TokensCollector(self))

    async def stop(self) -> None:
        pass

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        w = self.params.prefill_weight
        loads = [self.load(e.id, w) for e in endpoints]
        top = max(max(loads, default=0.0), self.params.scale_tokens)
        if top <= 0:
            return [1.0] * len(endpoints)
        return [1.0 - load / top for load in loads]


class TokenLoadFilter(_InFlightTokens):
    def __init__(self, name: str, params: TokenLoadParams) -> None:
        super().__init__(params)
        self.name = name

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        p = self.params
        kept = []
        for e in endpoints:
            load = self.load(e.id)
            if p.max_tokens and load > p.max_tokens:
                continue
            capacity = e.metrics.kv_capacity_tokens()
            if capacity and load > p.max_share * capacity:
                continue
            kept.append(e)
        return kept or endpoints


class _TokensCollector(Collector):
    def __init__(self, tokens: _InFlightTokens) -> None:
        self.tokens = tokens

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(
            "epp_endpoint_tokens_in_flight",
            "Tokens of the requests epp has in flight on the endpoint (token-load-scorer): "
            "held in KV, or still to prefill.", labels=["endpoint", "phase"],
        )  # fmt: skip
        for phase, counts in (("held", self.tokens.held), ("prefill", self.tokens.prefill)):
            for eid, n in sorted(list(counts.items())):
                fam.add_metric([eid, phase], n)
        yield fam
