"""The prefix producer: hashes a request, reads the index before scheduling, records after.

It is the only component that writes to the index. Scorers and filters only read the
``PrefixMatch`` it attaches to the cycle state.

Index sync (``epp/sync``, docs/sync.md) plugs in through two seams that keep this module
free of grpc: a ``subscribe``d sink sees every write this replica makes itself, and
``apply_remote`` stores a peer's write without telling the sinks (so nothing is echoed back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from epp.errors import ConfigError
from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import Pool
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.prefix.hasher import ChunkHasher, chain_seed
from epp.prefix.index import PrefixIndex

# A server reporting fewer than this share of the cached tokens the index predicted (and at
# least two chunks fewer) holds less than we think (requests in flight pin KV blocks, so its
# free cache is smaller than its size): its LRU shrinks by ``_SHRINK``, down to a quarter of
# its KV size, and grows back by ``_GROW`` with each accurate prediction. Gentle on purpose:
# a 0.8 / 1.02 pair crushed the LRUs on the Mooncake replay (hit rate 22% -> 16%).
_DISTRUST_RATIO = 0.5
_SHRINK = 0.97
_GROW = 1.03
_CPT_DECAY = 0.98
"""Weight kept by the past per response in the learnt characters per token (~50 responses)."""
_CPT_MIN_TOKENS = 32
_CPT_RANGE = (1.0, 16.0)
APPROX_PREFIX_PRODUCER = "approx-prefix-cache-producer"


@dataclass(slots=True, frozen=True)
class PrefixIndexConfig:
    """The approximate producer's parameters: the ``prefixIndex:`` config section, or the
    ``parameters`` of an ``approx-prefix-cache-producer`` plugin."""

    block_chars: int = 64
    """Characters per hashed chunk (about 16 tokens at 4 characters a token)."""
    max_chunks: int = 0
    """Hash at most this many leading chunks of a prompt; 0 hashes the whole prompt."""
    capacity_per_endpoint_chunks: int = 31_250
    """LRU size per endpoint when its KV-cache size is unknown."""
    max_entries: int = 4_000_000
    """Global cap on (chunk, endpoint) entries."""
    ttl_seconds: float = 600.0
    """Entries unused for this long are treated as gone."""
    sweep_interval_seconds: float = 5.0
    """How often the background sweeper removes expired entries."""
    chars_per_token: float = 4.0
    """Used to size an endpoint's LRU from its KV cache and to read ``cached_tokens``: the
    starting value, replaced by the prompt characters per ``prompt_tokens`` the responses
    report (``learn_from_responses``; a tokenizer's ratio varies from ~3 to ~7)."""
    learn_from_responses: bool = True
    """Record the reply's chunks after the prompt's, learn the characters per token from the
    responses' usage, and shrink an endpoint's LRU when the server reports far fewer cached
    tokens than the index predicted."""

    def check(self, where: str) -> None:
        """Rules the field types cannot say (the config loader calls it)."""
        if self.block_chars < 1:
            raise ConfigError(f"{where}.blockChars", "must be at least 1")
        for fname, camel in (("capacity_per_endpoint_chunks", "capacityPerEndpointChunks"),
                             ("max_entries", "maxEntries"), ("ttl_seconds", "ttlSeconds"),
                             ("chars_per_token", "charsPerToken")):  # fmt: skip
            if getattr(self, fname) <= 0:
                raise ConfigError(f"{where}.{camel}", "must be positive")


RecordSink = Callable[[EndpointId, Sequence[int], float], None]
"""Told of each index write this replica makes itself: endpoint, chain hashes, stamp (the
monotonic ``now_s`` written into the index). Must be cheap: it runs on the request path.
The hashes are shared with the index, so the sink must not modify them."""


@dataclass(slots=True)
class PrefixProducer:
    """The ``approx-prefix-cache-producer`` plugin: a data producer (the match), a post-pick
    and post-response hook (recording), an endpoint listener (LRU sizing, removal) and a
    sweeper (expiry)."""

    hasher: ChunkHasher
    index: PrefixIndex
    chars_per_token: float = 4.0
    learn_from_responses: bool = True
    name: str = "approx-prefix-cache-producer"
    sweep_interval_s: float = 5.0
    """How often expired entries are swept (``sweepIntervalSeconds``)."""
    _listeners: list[RecordSink] = field(default_factory=list)
    _base_capacity: dict[EndpointId, int] = field(default_factory=dict)
    _cpt_chars: float = 0.0
    _cpt_tokens: float = 0.0

    @classmethod
    def from_params(cls, name: str, params: PrefixIndexConfig) -> PrefixProducer:
        index = PrefixIndex(
            capacity_chunks=params.capacity_per_endpoint_chunks,
            max_entries=params.max_entries,
            ttl_s=params.ttl_seconds,
        )
        return cls(
            ChunkHasher(params.block_chars, params.max_chunks), index,
            chars_per_token=params.chars_per_token,
            learn_from_responses=params.learn_from_responses, name=name,
            sweep_interval_s=params.sweep_interval_seconds,
        )  # fmt: skip

    def subscribe(self, sink: RecordSink) -> Callable[[], None]:
        """Hear of every index write this replica makes itself (index sync's publisher);
        returns the call that unsubscribes."""
        self._listeners.append(sink)
        return lambda: self._listeners.remove(sink)

    def sweep_steps(self, now_s: float) -> Iterator[int]:
        return self.index.sweep_steps(now_s)

    def prepare(self, state: CycleState, endpoints: Sequence[Endpoint]) -> None:
        request = state.request
        if not request.prompt:
            return
        seed = chain_seed(request.model, request.adapter, request.cache_salt)
        hashes = self.hasher.hashes(request.prompt, seed)
        if not hashes:
            return
        ids = endpoints.ids if isinstance(endpoints, Pool) else {e.id for e in endpoints}
        matched = self.index.match(hashes, ids, state.now_s)
        match = PrefixMatch(hashes, matched, self.hasher.block_chars, self.index.fill,
                            self.index.least_filled)
        state.matches[self.name] = match
        state.prefix = match

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        own = state.matches.get(self.name)
        if own is not None and own.hashes:
            hashes = own.hashes
            self._record(result.target.id, hashes, state.now_s)
            for prefiller in result.prefill:  # disaggregated: the prefiller computed it too
                self._record(prefiller.id, hashes, state.now_s)

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None:
        if not self.learn_from_responses or info.status >= 400:
            return
        target = result.target.id
        prefix = state.matches.get(self.name)
        if prefix is None or not prefix.hashes:
            return
        if info.prompt_tokens >= _CPT_MIN_TOKENS:
            self._learn_chars_per_token(len(state.request.prompt), info.prompt_tokens)
        if info.cached_tokens is not None:
            self._adjust_trust(target, prefix.matched.get(target, 0), info.cached_tokens)
        if info.generated_text:
            self._record_reply(state.request, prefix.hashes, target, info.generated_text, state.now_s)
        else:
            # A server frees a request's blocks when it ends, the freshest of its LRU: the
            # prompt's chain goes back to the front here too, as the reply's recording does
            # (a streamed answer's text is not read with the response summary). Recorded at
            # the pick only, a conversation with an answer under way aged behind the picks
            # made meanwhile, and its next turn moved servers: on real vLLM behind Envoy, 78
            # of 1,152 turns against 14 (docs/research/2026-11-29-streamed-answers-through-envoy.md).
            self._record(target, prefix.hashes, state.now_s)

    def _learn_chars_per_token(self, chars: int, tokens: int) -> None:
        """Prompt characters per token, weighted by length over the last ~50 responses. The
        LRU sizes follow at the endpoints' next scrape (``observe_endpoint``)."""
        self._cpt_chars = _CPT_DECAY * self._cpt_chars + chars
        self._cpt_tokens = _CPT_DECAY * self._cpt_tokens + tokens
        low, high = _CPT_RANGE
        self.chars_per_token = min(high, max(low, self._cpt_chars / self._cpt_tokens))

    def _adjust_trust(self, target: EndpointId, predicted_chunks: int, cached_tokens: int) -> None:
        if predicted_chunks == 0:
            return
        chunk_tokens = self.hasher.block_chars / self.chars_per_token
        predicted_tokens = predicted_chunks * chunk_tokens
        base = self._base_capacity.get(target, self.index.default_capacity)
        current = self.index.capacity(target)
        if (
            cached_tokens < _DISTRUST_RATIO * predicted_tokens
            and predicted_tokens - cached_tokens >= 2 * chunk_tokens
        ):
            self.index.set_capacity(target, max(64, base // 4, int(current * _SHRINK)))
        elif current < base:
            self.index.set_capacity(target, min(base, int(current * _GROW) + 1))

    def _record_reply(
        self, request: InferenceRequest, hashes: Sequence[int], target: EndpointId, reply: str,
        now_s: float,
    ) -> None:  # fmt: skip
        marker = "<|assistant|>" if request.api.conversational else ""
        start = len(hashes) * self.hasher.block_chars
        # only the prompt's unhashed tail and the reply: the prompt's chunks are hashed already
        cap = self.hasher.max_chunks
        if cap and len(hashes) >= cap:
            return
        tail = request.prompt[start:] + marker + reply
        more = self.hasher.extend(tail, hashes[-1], 0)
        if cap:
            more = more[: cap - len(hashes)]
        if more:
            # Re-record the whole chain so the prompt's chunks stay younger than the reply's.
            self._record(target, list(hashes) + more, now_s)

    def _record(self, endpoint_id: EndpointId, hashes: Sequence[int], now_s: float) -> None:
        self.index.record(endpoint_id, hashes, now_s)
        for sink in self._listeners:
            sink(endpoint_id, hashes, now_s)

    def apply_remote(self, endpoint_id: EndpointId, hashes: Sequence[int], stamp_s: float) -> None:
        """Store a write a peer replica made (``stamp_s`` on this process's clock). Unlike
        the producer's own writes it is not passed to the subscribers: peers publish only
        what they decided themselves, so a write never loops between replicas."""
        self.index.record(endpoint_id, hashes, stamp_s)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        """Size the endpoint's LRU from its KV cache (``vllm:cache_config_info``)."""
        tokens = endpoint.metrics.kv_capacity_tokens()
        if tokens <= 0:
            return
        chunks = int(tokens * self.chars_per_token / self.hasher.block_chars)
        base = self._base_capacity.get(endpoint.id)
        if base is None or abs(chunks - base) > 0.02 * base:  # no resizing for a 2% wobble
            self._base_capacity[endpoint.id] = chunks
            self.index.set_capacity(endpoint.id, chunks)

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        self._base_capacity.pop(endpoint_id, None)
        self.index.remove_endpoint(endpoint_id)
