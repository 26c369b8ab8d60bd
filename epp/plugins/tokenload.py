"""``token-load-scorer`` and ``token-load-filter``: load counted in tokens, from epp's own
accounting between scrapes.

A request count treats a 100k-token agent turn and a 200-token question alike; the tokens a
request holds on its server do not. Each plugin counts, per endpoint, the tokens of the
requests epp sent there and that have not ended: what each keeps in the KV cache (its prompt,
``ceil(chars / 4)``, and its output, ``max_tokens`` or ``decodeTokens`` when the request sets
none); what it counts for a request lives on the request (``CycleState``) and is taken back
when the request ends (its response's end or cancellation). Apart from it, the prompt still
to prefill: epp's one accounting of the prefill it sent and has not seen done
(``CycleState.prefill``, the uncached part, until the first token), read at 4 characters
a token.

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
    __config_min__: ClassVar[dict[str, float]] = {"decode_tokens": 0, "prefill_weight": 0,
                                                  "scale_tokens": 0}  # fmt: skip


@dataclass(slots=True)
class _Held:
    """What one request counts in ``held`` (kept on its cycle state)."""

    endpoint: EndpointId
    tokens: int
    """Tokens the request keeps in the KV cache."""


def _output_tokens(body: Mapping[str, Any] | None, params: TokenLoadParams) -> int:
    if body is not None:
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return min(value, params.max_decode_tokens)
    return params.decode_tokens


_NO_PREFILL: Mapping[EndpointId, float] = {}


class _InFlightTokens:
    """Per-endpoint tokens held by the requests in flight, fed by the post-pick and
    post-response hooks; the prefill part is read from ``CycleState.prefill``."""

    def __init__(self, name: str, params: TokenLoadParams) -> None:
        self.name = name
        self.params = params
        self.held: dict[EndpointId, int] = {}
        """Per endpoint with requests in flight (no entry for one without: an endpoint
        seen once is not exported for ever)."""
        self.prefill_view: Mapping[EndpointId, float] = _NO_PREFILL
        """The prefill ledger the cycles read (characters), for the exported gauge."""

    def load(self, state: CycleState, endpoint_id: EndpointId, prefill_weight: float = 1.0) -> float:
        held = self.held.get(endpoint_id, 0)
        if prefill_weight == 1.0:
            return float(held)
        prefill = state.prefill.get(endpoint_id, 0.0) / _CHARS_PER_TOKEN
        return held + (prefill_weight - 1.0) * prefill

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        request = state.request
        prompt = -(-len(request.prompt) // _CHARS_PER_TOKEN)
        entry = _Held(result.target.id, prompt + _output_tokens(request.body, self.params))
        if state.read(self.name, _Held) is not None:  # picked again: one count per request
            self._take(state)
        state.write(self.name, entry)
        self.held[entry.endpoint] = self.held.get(entry.endpoint, 0) + entry.tokens
        self.prefill_view = state.prefill

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None:
        self._take(state)

    def _take(self, state: CycleState) -> None:
        entry = state.read(self.name, _Held)
        if entry is None:
            return
        state.data.pop(self.name, None)
        held = self.held
        left = held.get(entry.endpoint, 0) - entry.tokens
        if left > 0:
            held[entry.endpoint] = left
        else:
            held.pop(entry.endpoint, None)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        pass

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        self.held.pop(endpoint_id, None)


class TokenLoadScorer(_InFlightTokens):

    async def start(self, ctx: PluginContext) -> None:
        ctx.register(_TokensCollector(self))

    async def stop(self) -> None:
        pass

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        w = self.params.prefill_weight
        loads = [self.load(state, e.id, w) for e in endpoints]
        top = max(max(loads, default=0.0), self.params.scale_tokens)
        if top <= 0:
            return [1.0] * len(endpoints)
        return [1.0 - load / top for load in loads]


class TokenLoadFilter(_InFlightTokens):
    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        p = self.params
        kept = []
        for e in endpoints:
            load = self.load(state, e.id)
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
        tokens = self.tokens
        for eid, n in sorted(list(tokens.held.items())):
            fam.add_metric([eid, "held"], n)
        prefill = tokens.prefill_view
        for eid in sorted(list(prefill)):
            fam.add_metric([eid, "prefill"], prefill.get(eid, 0.0) / _CHARS_PER_TOKEN)
        yield fam
