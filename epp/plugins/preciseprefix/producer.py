"""The ``precise-prefix-cache-producer`` plugin: the prefix match from what the model servers
say they hold (their KV-cache events), combined with the approximate index where the events
cannot be trusted.

Per request (``prepare``): the request is tokenized with the model's tokenizer and chat
template (``epp.prefix.tokenize``), its full blocks keyed exactly as vLLM keys them
(``epp.prefix.blockhash``), and the keys matched against the index the events built
(``epp.prefix.kvindex``). The match replaces the approximate one in ``state.prefix`` (in
blocks), endpoint by endpoint:

* an endpoint whose events are complete (``live``) gets the precise count;
* one whose event stream had a gap that could not be replayed, or that joined mid-stream,
  is ``resyncing`` for ``resyncSeconds``: its stale entries were dropped, and it gets the
  larger of the precise count and the approximate one (scaled to blocks) until then;
* one that never sent an event (a server without ``--kv-events-config``) keeps the
  approximate count.

At the pick (``post_pick``) the request's blocks are entered for the target as speculative
entries with a short deadline, so that the next request of the same prefix sticks before
the server's events arrive; the events confirm them, or they lapse. When the response ends
(``post_response``), the blocks the server reports as cached (``cached_tokens``) are
confirmed: vLLM announces a block when it stores it, never when it is hit, so this is how
blocks stored before epp subscribed (or lost in a gap) come back into the index.

Events arrive through :meth:`apply` (``epp.plugins.preciseprefix.subscriber`` reads the sockets and calls
it; the replay calls it with the simulated engines' events). Sequence numbers are checked
per publisher: a gap returns the first missing number so that the caller can fetch it from
the server's replay socket (:meth:`apply_replayed`); without one the endpoint resyncs. A
publisher whose numbers restart from 0 is a restarted server: its entries are cleared.

Requests that cannot be keyed (no tokenizer for the model, images, the Responses API, a
LoRA adapter whose path on the server is not configured) keep the approximate match.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.interfaces import PluginContext
from epp.framework.request import ApiKind, InferenceRequest
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.plugins.preciseprefix.events import EventBatch, Kind
from epp.plugins.preciseprefix.keyer import BlockKeyer, TokenizingKeyer
from epp.plugins.preciseprefix.metrics import PreciseCollector, PreciseStats
from epp.plugins.preciseprefix.params import PreciseIndexConfig
from epp.plugins.preciseprefix.subscriber import KvEventSubscriber
from epp.prefix.blockhash import BlockKeys
from epp.prefix.kvindex import KvBlockIndex

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Publisher:
    last_seq: int
    replayed_to: int = -1
    """Highest sequence number applied from a replay: live copies up to it are duplicates."""


@dataclass(slots=True)
class _EndpointEvents:
    publishers: dict[int, _Publisher] = field(default_factory=dict)
    resync_until_s: float = 0.0


class PrecisePrefixProducer:
    """A data producer, request preparer, post-pick and post-response hook, endpoint
    listener and sweeper (see the module doc)."""

    def __init__(
        self,
        name: str,
        params: PreciseIndexConfig,
        keyer: BlockKeyer | None = None,
        index: KvBlockIndex | None = None,
    ) -> None:
        self.name = name
        self.params = params
        self.keyer: BlockKeyer = keyer if keyer is not None else TokenizingKeyer(params)
        self.index = index if index is not None else KvBlockIndex(params.max_entries)
        self.replay_enabled = params.replay_port > 0
        self.mediums = frozenset(params.mediums)
        self.stats = PreciseStats()
        self._index_key = f"{name}/events"
        """Where ``prepare`` leaves the events-only match for ``post_pick``."""
        self._events: dict[EndpointId, _EndpointEvents] = {}
        self._known: set[EndpointId] = set()
        self._ranks: dict[EndpointId, int] = {}
        self._endpoint_listeners: list[Callable[[EndpointId, bool], None]] = []
        self.subscriber: KvEventSubscriber | None = None
        """The KV-event subscriber, while the server runs this plugin (``start``)."""
        self.sweep_interval_s = 5.0

    @classmethod
    def from_params(cls, name: str, params: PreciseIndexConfig) -> PrecisePrefixProducer:
        producer = cls(name, params)
        if isinstance(producer.keyer, TokenizingKeyer):
            producer.keyer.pool.check()
        return producer

    # --- the lifecycle: the KV-event subscription and the metrics ---------------------

    async def start(self, ctx: PluginContext) -> None:
        """Subscribe to the servers' KV-cache events (a supervised ``kv-events`` task and one
        reader per endpoint in connect mode) and export the ``epp_kv_events_*`` /
        ``epp_precise_*`` metrics."""
        self.subscriber = KvEventSubscriber(self, on_failure=ctx.on_failure)
        self.on_endpoints(self.subscriber.endpoint_changed)
        ctx.register(PreciseCollector(self))
        ctx.spawn("kv-events", self.subscriber.run)

    async def stop(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.close()

    # --- the request path ------------------------------------------------------------

    def prepare_request(self, request: InferenceRequest) -> BlockKeys | str | None:
        """Tokenize and key the request (a worker thread, before scheduling: see
        ``RequestPreparer``); the request carries the result to its cycle, however long it
        waits in flow control's queue, and ``prepare`` finds it there. Auxiliary APIs
        (routed by load) are not keyed: None."""
        if request.api is ApiKind.AUXILIARY:
            return None
        return self.keyer.keys(request)

    def prepare(self, state: CycleState, endpoints: Sequence[Endpoint]) -> None:
        request = state.request
        if request.api is ApiKind.AUXILIARY:
            return
        keyed = state.data.get(self.name)
        if not isinstance(keyed, BlockKeys | str):  # not prepared ahead (the replay)
            keyed = self.keyer.keys(request)
        if isinstance(keyed, str):
            self.stats.unkeyed[keyed] += 1
            return
        keys = keyed.keys
        if not keys:
            state.matches[self.name] = PrefixMatch(keys)
            return
        now = state.now_s
        approx = state.prefix
        precise = self.index.match(keys, [e.id for e in endpoints], now)
        total = len(keys)
        matched: dict[EndpointId, int] = {}
        events = self._events
        for e in endpoints:
            eid = e.id
            ev = events.get(eid)
            if ev is not None and ev.resync_until_s <= now:
                n = precise.get(eid, 0)
            else:
                guess = int(approx.ratio(eid) * total) if approx.total else 0
                n = guess if ev is None else max(guess, precise.get(eid, 0))
            if n:
                matched[eid] = n
        # cache room as the approximate index sees it (it runs alongside, fed by every pick)
        match = PrefixMatch(keys, matched, keyed.block_size * 4, approx.fill, approx.least_filled)
        state.matches[self._index_key] = PrefixMatch(keys, precise)
        state.matches[self.name] = match
        state.prefix = match

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        match = state.matches.get(self.name)
        if match is None or not match.hashes:
            return
        target = result.target.id
        if target in self._events:
            # the blocks the target already holds (by events, or a recent pick) are left as
            # they are: only the rest is new
            own = state.matches.get(self._index_key)
            held = own.matched.get(target, 0) if own is not None else 0
            self.index.speculate(target, match.hashes[held:],
                                 state.now_s + self.params.speculative_ttl_seconds)  # fmt: skip

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None:
        """The server just said it held the request's first ``cached_tokens``: confirm
        those blocks. vLLM announces a block once, when it is stored, never when it is hit,
        so blocks stored before epp joined (or in a gap) are learnt this way; their eviction
        is announced later like any other."""
        match = state.matches.get(self.name)
        cached = info.cached_tokens
        if match is None or not cached or info.status >= 400 or not match.hashes:
            return
        target = result.target.id
        if target not in self._events:
            return
        n = min(len(match.hashes), cached // self.params.block_size)
        if n:
            self.index.store(target, match.hashes[:n])

    # --- events ----------------------------------------------------------------------

    def endpoint_for_topic(self, topic: str) -> EndpointId | None:
        """Bind mode: the endpoint a topic ``<prefix><ip>:<port>@<model>`` names."""
        prefix = self.params.topic_prefix
        if not topic.startswith(prefix):
            return None
        eid = EndpointId(topic[len(prefix) :].split("@", 1)[0])
        return eid if eid in self._known else None

    def apply(self, endpoint_id: EndpointId, batch: EventBatch, now_s: float) -> int | None:
        """Apply one batch. Returns the first missing sequence number when the batch
        follows a gap and replay is enabled: the caller fetches the missing batches and
        calls :meth:`apply_replayed` (this batch is held until then). Returns None when the
        batch was applied (or dropped as a duplicate)."""
        if endpoint_id not in self._known:
            self.stats.dropped[(endpoint_id, "unknown-endpoint")] += 1
            return None
        ev = self._events.get(endpoint_id)
        if ev is None:
            ev = self._events[endpoint_id] = _EndpointEvents()
        pub = ev.publishers.get(batch.dp_rank)
        seq = batch.seq
        if pub is None:
            pub = ev.publishers[batch.dp_rank] = _Publisher(last_seq=-1)
            if seq != 0:  # joined mid-stream: what was stored before is unknown
                return self._gap(endpoint_id, ev, pub, batch, now_s)
        elif seq == pub.last_seq + 1:
            pass
        elif seq <= pub.replayed_to:
            self.stats.dropped[(endpoint_id, "duplicate")] += 1
            return None
        elif seq <= pub.last_seq:  # numbering restarted: a new server process
            self.stats.restarts[endpoint_id] += 1
            self.index.clear(endpoint_id)
            ev.publishers = {batch.dp_rank: pub}
            pub.last_seq, pub.replayed_to = -1, -1
            if seq != 0:
                return self._gap(endpoint_id, ev, pub, batch, now_s)
        else:
            return self._gap(endpoint_id, ev, pub, batch, now_s)
        self._apply_events(endpoint_id, batch)
        pub.last_seq = seq
        return None

    def _gap(
        self, endpoint_id: EndpointId, ev: _EndpointEvents, pub: _Publisher,
        batch: EventBatch, now_s: float,
    ) -> int | None:  # fmt: skip
        self.stats.gaps[endpoint_id] += 1
        if self.replay_enabled:
            return pub.last_seq + 1
        self._resync(endpoint_id, ev, now_s)
        self._apply_events(endpoint_id, batch)
        pub.last_seq = batch.seq
        return None

    def apply_replayed(
        self, endpoint_id: EndpointId, held: EventBatch, replayed: Sequence[EventBatch] | None,
        now_s: float,
    ) -> None:  # fmt: skip
        """Finish a gap: ``replayed`` are the batches the server's replay socket returned
        from the first missing number on (None: the replay failed). Complete -> applied in
        order, the endpoint stays live; otherwise it resyncs."""
        ev = self._events.get(endpoint_id)
        if ev is None:
            return
        pub = ev.publishers.setdefault(held.dp_rank, _Publisher(last_seq=-1))
        expected = pub.last_seq + 1
        ordered = sorted((b for b in replayed or () if b.seq >= expected), key=lambda b: b.seq)
        if ordered and ordered[0].seq == expected:
            for b in ordered:
                if b.seq != pub.last_seq + 1:
                    break
                self._apply_events(endpoint_id, b)
                pub.last_seq = pub.replayed_to = b.seq
            if pub.last_seq >= held.seq - 1:
                self.stats.replays["complete"] += 1
                if held.seq == pub.last_seq + 1:
                    self._apply_events(endpoint_id, held)
                    pub.last_seq = held.seq
                return
        self.stats.replays["failed" if replayed is None else "incomplete"] += 1
        self._resync(endpoint_id, ev, now_s)
        self._apply_events(endpoint_id, held)
        pub.last_seq = held.seq

    def _resync(self, endpoint_id: EndpointId, ev: _EndpointEvents, now_s: float) -> None:
        self.stats.resyncs[endpoint_id] += 1
        self.index.clear(endpoint_id)
        ev.resync_until_s = now_s + self.params.resync_seconds
        log.info("precise prefix: %s's KV events have a gap; its index is rebuilt from new "
                 "events, with the approximate index's help for %.0f s",
                 endpoint_id, self.params.resync_seconds)  # fmt: skip

    def _apply_events(self, endpoint_id: EndpointId, batch: EventBatch) -> None:
        stats = self.stats.events
        mediums = self.mediums
        index = self.index
        for e in batch.events:
            if e.kind is Kind.CLEARED:
                index.clear(endpoint_id)
            elif e.medium is not None and e.medium not in mediums:
                self.stats.dropped[(endpoint_id, "medium")] += 1
                continue
            elif e.kind is Kind.STORED:
                if e.block_size and e.block_size != self.params.block_size:
                    self.stats.dropped[(endpoint_id, "block-size")] += 1
                    continue
                if index.store(endpoint_id, e.keys):
                    self.stats.dropped[(endpoint_id, "index-full")] += 1
            else:
                index.remove(endpoint_id, e.keys)
            stats[(endpoint_id, e.kind.value)] += 1
        if batch.unknown:
            self.stats.dropped[(endpoint_id, "unknown-type")] += batch.unknown

    def drop(self, endpoint_id: EndpointId, reason: str, count: int = 1) -> None:
        """Count batches lost before they reached :meth:`apply` (queue full, undecodable)."""
        self.stats.dropped[(endpoint_id, reason)] += count

    def mode(self, endpoint_id: EndpointId, now_s: float) -> str:
        """``live``, ``resyncing`` or ``approximate`` (no events yet)."""
        ev = self._events.get(endpoint_id)
        if ev is None:
            return "approximate"
        return "live" if ev.resync_until_s <= now_s else "resyncing"

    # --- endpoints and housekeeping --------------------------------------------------

    def on_endpoints(self, listener: Callable[[EndpointId, bool], None]) -> None:
        """Hear of endpoints joining (True) and leaving (False) the pool (the event
        subscriber connects and disconnects with them)."""
        self._endpoint_listeners.append(listener)

    def rank_of(self, endpoint_id: EndpointId) -> int:
        """The endpoint's data-parallel rank (its event and replay ports are offset by it)."""
        return self._ranks.get(endpoint_id, 0)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        if endpoint.id not in self._known:
            self._known.add(endpoint.id)
            if endpoint.rank:
                self._ranks[endpoint.id] = endpoint.rank
            for listener in self._endpoint_listeners:
                listener(endpoint.id, True)

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        if endpoint_id in self._known:
            self._known.discard(endpoint_id)
            self._ranks.pop(endpoint_id, None)
            self._events.pop(endpoint_id, None)
            self.index.clear(endpoint_id)
            for listener in self._endpoint_listeners:
                listener(endpoint_id, False)

    def sweep_steps(self, now_s: float) -> Iterator[int]:
        return self.index.sweep_steps(now_s)
