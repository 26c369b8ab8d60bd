"""Routing policies the replayer compares. Each picks a replica index for one arrival.

* ``epp``: epp's request-control layer as ``epp serve`` runs it: the real
  :class:`~epp.requestcontrol.director.Director` over a scheduler built from a config file
  (the shipped default unless one is named), fed as production feeds it: endpoint metrics
  through a :class:`~epp.datastore.store.Datastore` at every scrape, ``route`` / ``settle``
  at the pick and ``finish`` with the server's ``cached_tokens`` and the generated text
  (when the workload has text) when the response ends.
* ``precise``: the same config with the ``precise-prefix-cache-producer`` added, fed by
  the replicas' KV-cache events (``ReplayConfig.event_delay_s`` late, ``event_loss`` of the
  batches lost) and keeping the approximate index as its fallback, as ``epp serve`` runs it.
* ``oracle``: the same profile and request-control layer, but the prefix match comes from an
  oracle producer that reads the replicas' true caches (``contains_prefix``) at the instant
  of the pick: the bound any index reaches. Load is balanced exactly as epp balances it, so
  the gap between ``epp`` and ``oracle`` is the cost of approximation, and between
  ``precise`` and ``oracle`` the cost of events arriving late or lost.
* ``random``, ``round-robin``.
* ``least-load``: fewest requests in flight (as counted by the router), ties at random.
* ``session-affinity``: a session's first request goes to the least-loaded replica, later
  ones stick to it (cookie-style stickiness); requests without a session are least-load.
* ``chwbl``: KubeAI's PrefixHash: consistent hashing with bounded loads on the first
  ``prefix_chars`` (100) characters; 256 ring points per replica (xxh64 of name + index);
  walk the ring clockwise from the key's hash to the first replica whose in-flight count
  satisfies ``load + 1 <= (total + 1) / n * load_factor`` (1.25); if none does, the first.
* ``cache-aware``: the SGLang router's rule. Load is requests in flight. If
  ``max - min > 64`` and ``max > 1.5 * min`` the system is imbalanced: route to the
  least-loaded replica. Otherwise match the prompt in an approximate character radix tree of
  what was sent where: a match ratio above 0.3 routes to the replica holding the match, else
  to the replica with the smallest tree. The prompt is then inserted for the chosen replica.
  (SGLang's size-capped tree eviction, 2^26 characters per worker, is not modelled.)
* ``ttft-oracle`` (not in the default set: it costs a what-if run per replica per request):
  the replica that would give this request its first token soonest, read from a what-if run
  of each replica's engine (``Engine.first_token_if``: its true cache and queue, nothing else
  arriving); ties to the fewest requests in flight. Greedy: the best each request can get,
  not the best schedule (it does not spare what later requests would reuse); a reference for
  what routing on true TTFTs gains.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from prometheus_client import CollectorRegistry

from epp.config.loader import EppConfig, default_config, load_config, parse_config
from epp.datastore.store import Datastore
from epp.framework.endpoint import ROLE_LABEL, Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PrefixMatch, ResponseInfo
from epp.observability.metrics import EppMetrics
from epp.plugins.approxprefix import PrefixProducer
from epp.plugins.preciseprefix import (
    PRECISE_PREFIX_PRODUCER,
    PreciseIndexConfig,
    PrecisePrefixProducer,
)
from epp.plugins.preciseprefix.events import EventBatch
from epp.plugins.ttft import PredictedTtftScorer
from epp.prefix.blockhash import BlockKeys
from epp.requestcontrol.director import Director, Routing
from epp.scheduling.scheduler import Scheduler
from epp.sync.load import SharedPrefill
from epp.wiring import build_producers, build_scheduler
from simulator.model.engine import Engine, EngineRequest, RequestTooLarge
from simulator.model.tokens import CHARS_PER_TOKEN
from simulator.replay.radix import ApproxRadixTree
from simulator.replay.workload import TraceRequest

SESSION_HEADER = "x-session-id"
"""The header a replayed request carries its session in (the workload's ``session_id``: a
conversation, an agent), as a client would send it; ``session-affinity-scorer`` reads it."""


@dataclass(slots=True, frozen=True)
class Arrival:
    """A request as the router sees it, with the engine-side block names precomputed."""

    request: TraceRequest
    block_hashes: list[int]


@dataclass(slots=True)
class Cluster:
    """What policies may read: replica ids, engines (``precise`` only) and in-flight counts
    kept by the router (incremented at the pick, decremented when the response ends)."""

    engines: Sequence[Engine]
    endpoint_ids: Sequence[EndpointId]
    in_flight: list[int]
    block_size_tokens: int
    model: str
    seed: int
    roles: Sequence[str] = ()
    """Per replica, its ``llm-d.ai/role`` label ("" or empty: none)."""


class Policy:
    """Base: override ``pick``; ``observe`` (scrapes) and ``finished`` are optional."""

    name = "policy"
    needs_metrics = False
    scrape_interval_s: float | None = None
    """The scrape period the policy asks for (None: the replay's default)."""
    wants_events = False
    """Reads the replicas' KV-cache events (``kv_events``)."""
    knows_roles = False
    """Reads the replicas' P/D roles and may split a request (``prefiller``)."""

    def pick(self, arrival: Arrival, now_s: float) -> int | None:
        """The replica, or None when the router holds the request (flow control's queue) or
        rejects it: ``poll`` reports what became of it."""
        raise NotImplementedError

    def poll(self, now_s: float) -> list[tuple[Arrival, int | None, str]]:
        """Requests the router released (replica) or rejected (None, reason) since."""
        return []

    def prefiller(self, request_id: str) -> int | None:
        """The replica to prefill the request just routed apart (disaggregated), if any."""
        return None

    @property
    def holding(self) -> int:
        """Requests the router holds (queued)."""
        return 0

    def observe(self, metrics: Sequence[Metrics], now_s: float) -> None:
        pass

    def first_token(self, arrival: Arrival, ttft_s: float, now_s: float) -> None:
        """The request's first token came out (its prefill is done)."""

    def ttft_predictions(self) -> list[tuple[float, float]]:
        """(predicted, observed) TTFTs of the policy's cost model, if it has one."""
        return []

    def finished(self, arrival: Arrival, replica: int, info: ResponseInfo, now_s: float) -> None:
        pass

    def kv_events(self, replica: int, batch: EventBatch, now_s: float) -> None:
        pass

    def index_producer(self) -> PrefixProducer | None:
        """The approximate prefix index's producer, whose writes index sync shares between
        routers (None: the policy has no index to share)."""
        return None

    def prefill_counter(self) -> SharedPrefill | None:
        """What counts the policy's prefill in flight (epp's prefill ledger), which index
        sync shares between routers (None: the policy has none)."""
        return None


def _least_loaded(in_flight: Sequence[int], rng: random.Random) -> int:
    lo = min(in_flight)
    best = [i for i, v in enumerate(in_flight) if v == lo]
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, cluster: Cluster) -> None:
        self.n = len(cluster.endpoint_ids)
        self.rng = random.Random(cluster.seed)

    def pick(self, arrival: Arrival, now_s: float) -> int:
        return self.rng.randrange(self.n)


class RoundRobinPolicy(Policy):
    name = "round-robin"

    def __init__(self, cluster: Cluster) -> None:
        self.n = len(cluster.endpoint_ids)
        self.next = 0

    def pick(self, arrival: Arrival, now_s: float) -> int:
        i = self.next
        self.next = (i + 1) % self.n
        return i


class LeastLoadPolicy(Policy):
    name = "least-load"

    def __init__(self, cluster: Cluster) -> None:
        self.in_flight = cluster.in_flight
        self.rng = random.Random(cluster.seed)

    def pick(self, arrival: Arrival, now_s: float) -> int:
        return _least_loaded(self.in_flight, self.rng)


class SessionAffinityPolicy(Policy):
    name = "session-affinity"

    def __init__(self, cluster: Cluster) -> None:
        self.in_flight = cluster.in_flight
        self.rng = random.Random(cluster.seed)
        self.sticky: dict[str, int] = {}

    def pick(self, arrival: Arrival, now_s: float) -> int:
        session = arrival.request.session_id
        if not session:
            return _least_loaded(self.in_flight, self.rng)
        replica = self.sticky.get(session)
        if replica is None:
            replica = self.sticky[session] = _least_loaded(self.in_flight, self.rng)
        return replica


@dataclass(slots=True, frozen=True)
class ChwblParams:
    replication: int = 256
    load_factor: float = 1.25
    prefix_chars: int = 100


class ChwblPolicy(Policy):
    name = "chwbl"

    def __init__(self, cluster: Cluster, params: ChwblParams = ChwblParams()) -> None:
        self.params = params
        self.in_flight = cluster.in_flight
        points: list[tuple[int, int]] = []
        for i, eid in enumerate(cluster.endpoint_ids):
            for r in range(params.replication):
                points.append((xxhash.xxh64_intdigest(f"{eid}{r}".encode()), i))
        points.sort()
        self.ring_hashes = [h for h, _ in points]
        self.ring_owner = [i for _, i in points]

    def pick(self, arrival: Arrival, now_s: float) -> int:
        key = arrival.request.prompt[: self.params.prefix_chars]
        h = xxhash.xxh64_intdigest(key.encode("utf-8", "surrogatepass"))
        start = bisect.bisect_left(self.ring_hashes, h)
        owners = self.ring_owner
        size = len(owners)
        loads = self.in_flight
        total = sum(loads)
        n = len(loads)
        if total == 0:
            return owners[start % size]
        threshold = (total + 1) / n * self.params.load_factor
        for k in range(size):
            i = owners[(start + k) % size]
            if loads[i] + 1 <= threshold:
                return i
        return owners[start % size]


@dataclass(slots=True, frozen=True)
class CacheAwareParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class CacheAwarePolicy(Policy):
    name = "cache-aware"

    def __init__(self, cluster: Cluster, params: CacheAwareParams = CacheAwareParams()) -> None:
        self.params = params
        self.in_flight = cluster.in_flight
        self.tree = ApproxRadixTree(len(cluster.endpoint_ids))

    def pick(self, arrival: Arrival, now_s: float) -> int:
        p = self.params
        loads = self.in_flight
        text = arrival.request.prompt
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            replica = loads.index(lo)
        else:
            m = self.tree.match(text)
            ratio = m.matched_chars / len(text) if text else 0.0
            replica = m.tenant if ratio > p.cache_threshold else self.tree.smallest_tenant()
        self.tree.insert(text, replica, now_s)
        return replica


class _EppBase(Policy):
    """epp's request-control layer as ``epp serve`` runs it: a :class:`Director` over a real
    Datastore (refreshed by scrapes as the production scraper refreshes it) and a Scheduler,
    with the replay's simulated clock and a metrics registry of its own. Routing, shedding,
    in-flight accounting, recording the pick and learning from the response all happen in
    the Director, exactly as for a live request."""

    needs_metrics = True
    knows_roles = True

    def __init__(self, cluster: Cluster, cfg: EppConfig, scheduler: Scheduler) -> None:
        self.cfg = cfg
        self.scrape_interval_s = cfg.scraping.interval_seconds
        self.model = cluster.model
        self.ids = list(cluster.endpoint_ids)
        self.index_of = {eid: i for i, eid in enumerate(self.ids)}
        self.store = Datastore(stale_after_s=cfg.saturation.metrics_staleness_seconds)
        roles = list(cluster.roles) or [""] * len(self.ids)
        for eid, role in zip(self.ids, roles, strict=True):
            host, _, port = eid.rpartition(":")
            self.store.upsert(
                Endpoint(eid, host, int(port), labels={ROLE_LABEL: role} if role else {})
            )
        self.scheduler = scheduler
        self.store.on_removed(scheduler.remove_endpoint)
        self.store.on_metrics(scheduler.observe_endpoint)
        self.now_s = 0.0
        self.director = Director(
            self.store, scheduler, cfg.saturation, EppMetrics(CollectorRegistry()),
            clock=lambda: self.now_s, flow=cfg.flow_control,
        )  # fmt: skip
        self.settled: list[tuple[Arrival, int | None, str]] = []
        self.routings: dict[str, Routing] = {}
        self.prefillers: dict[str, int] = {}
        self.sweep_interval_s = scheduler.sweep_interval_s
        self.next_sweep_s = self.sweep_interval_s

    def observe(self, metrics: Sequence[Metrics], now_s: float) -> None:
        update = self.store.update_metrics
        for eid, m in zip(self.ids, metrics, strict=True):
            update(eid, m)

    def pick(self, arrival: Arrival, now_s: float) -> int | None:
        self.now_s = now_s
        if now_s >= self.next_sweep_s:
            self.scheduler.sweep(now_s)
            self.next_sweep_s = now_s + self.sweep_interval_s
        r = arrival.request
        headers = {SESSION_HEADER: r.session_id} if r.session_id else {}
        # an adapter is the model the server is asked for (epp keys its prefixes apart)
        request = InferenceRequest(r.request_id, r.adapter or self.model, r.prompt, api=r.api,
                                   adapter=r.adapter, priority=r.priority, headers=headers)  # fmt: skip
        flow = self.director.flow
        if flow is not None:  # as epp serve's admission does, on the simulated clock
            offer = flow.offer(request, r.tenant or self.model, len(r.prompt), now_s)
            for victim in offer.displaced:
                self.settled.append((victim.ticket, None, victim.outcome))
            if not offer.go:
                if offer.item is None:
                    self.settled.append((arrival, None, offer.rejected))
                else:
                    offer.item.ticket = arrival
                return None
        return self._route(arrival, request)

    def _route(self, arrival: Arrival, request: InferenceRequest) -> int:
        routing = self.director.route(request, None)
        self.director.settle(routing)  # in serve: once the routing reply is on the wire
        self.routings[request.request_id] = routing
        prefiller = routing.result.prefiller
        if prefiller is not None:
            self.prefillers[request.request_id] = self.index_of[prefiller.id]
        return self.index_of[routing.target_id]

    def prefiller(self, request_id: str) -> int | None:
        return self.prefillers.pop(request_id, None)

    def poll(self, now_s: float) -> list[tuple[Arrival, int | None, str]]:
        self.now_s = now_s
        flow = self.director.flow
        out, self.settled = self.settled, []
        if flow is None:
            return out
        for item in flow.expire(now_s):
            out.append((item.ticket, None, item.outcome))
        for item in flow.dispatch(now_s):
            flow.routed()
            out.append((item.ticket, self._route(item.ticket, item.request), "dispatched"))
        return out

    @property
    def holding(self) -> int:
        flow = self.director.flow
        return 0 if flow is None else flow.count

    def ttft_predictions(self) -> list[tuple[float, float]]:
        return [pair for plugin in self.scheduler.plugins
                if isinstance(plugin, PredictedTtftScorer) for pair in plugin.errors.pairs]  # fmt: skip

    def first_token(self, arrival: Arrival, ttft_s: float, now_s: float) -> None:
        routing = self.routings.get(arrival.request.request_id)
        if routing is not None:
            self.now_s = now_s
            self.director.first_token(routing, ttft_s)

    def finished(self, arrival: Arrival, replica: int, info: ResponseInfo, now_s: float) -> None:
        self.now_s = now_s
        self.director.finish(self.routings.pop(arrival.request.request_id), info)

    def index_producer(self) -> PrefixProducer | None:
        return self.scheduler.plugin(PrefixProducer)

    def prefill_counter(self) -> SharedPrefill | None:
        return self.store.prefill


class EppPolicy(_EppBase):
    name = "epp"

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        super().__init__(cluster, cfg, build_scheduler(cfg, random.Random(cluster.seed)))


class PrecisePolicy(_EppBase):
    """The same config with the ``precise-prefix-cache-producer`` added, fed by the
    replicas' KV-cache events as the live producer is fed from ZMQ (with the replay's event
    delay and loss), and keying each request by the engine's own block names (what the
    tokenizer and vLLM's hash give in production)."""

    name = "precise"
    wants_events = True

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        self.keyer = ArrivalKeyer(cluster.block_size_tokens)
        params = PreciseIndexConfig(block_size=cluster.block_size_tokens)
        producer = PrecisePrefixProducer(PRECISE_PREFIX_PRODUCER, params, self.keyer)
        producers = [*build_producers(cfg), producer]
        super().__init__(
            cluster, cfg, build_scheduler(cfg, random.Random(cluster.seed), producers=producers)
        )
        self.producer = producer

    def _route(self, arrival: Arrival, request: InferenceRequest) -> int:
        self.keyer.next_blocks = arrival.block_hashes
        return super()._route(arrival, request)

    def kv_events(self, replica: int, batch: EventBatch, now_s: float) -> None:
        eid = self.ids[replica]
        if self.producer.apply(eid, batch, now_s) is not None:  # replay is not modelled
            self.producer.apply_replayed(eid, batch, None, now_s)


class ArrivalKeyer:
    """Keys a replayed request by the block names its engine uses (set per arrival)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_blocks: list[int] = []

    def keys(self, request: InferenceRequest) -> BlockKeys | str:
        blocks = self.next_blocks
        return BlockKeys(blocks, self.block_size, len(blocks) * self.block_size)


class OraclePolicy(_EppBase):
    """The same config, with the approximate index replaced by an oracle producer that reads
    the replicas' true cache contents (``OracleProducer``)."""

    name = "oracle"

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        producer = OracleProducer(cluster.engines, cluster.endpoint_ids,
                                  cluster.block_size_tokens * CHARS_PER_TOKEN)  # fmt: skip
        super().__init__(
            cluster, cfg, build_scheduler(cfg, random.Random(cluster.seed), producers=[producer])
        )
        self.producer = producer

    def _route(self, arrival: Arrival, request: InferenceRequest) -> int:
        self.producer.next_blocks = arrival.block_hashes
        return super()._route(arrival, request)


class OracleProducer:
    """A prefix producer that knows, instead of guessing: the leading blocks of the request
    each replica's engine holds right now (the bound an index fed by KV-cache events
    reaches). It records nothing: the caches are the truth."""

    name = "oracle-prefix-producer"

    def __init__(
        self, engines: Sequence[Engine], endpoint_ids: Sequence[EndpointId], block_chars: int
    ) -> None:
        self.engines = dict(zip(endpoint_ids, engines, strict=True))
        self.block_chars = block_chars
        self.next_blocks: list[int] = []
        """The engine-side block names of the request being scheduled (set by the policy)."""

    def prepare(self, state: CycleState, endpoints: Sequence[Endpoint]) -> None:
        hashes = self.next_blocks
        matched: dict[EndpointId, int] = {}
        if hashes:
            for e in endpoints:
                n = self.engines[e.id].cache.contains_prefix(hashes)
                if n:
                    matched[e.id] = n
        state.prefix = PrefixMatch(hashes, matched, self.block_chars)



class TtftOraclePolicy(Policy):
    name = "ttft-oracle"

    def __init__(self, cluster: Cluster) -> None:
        self.engines = cluster.engines
        self.in_flight = cluster.in_flight
        self.rng = random.Random(cluster.seed)

    def pick(self, arrival: Arrival, now_s: float) -> int:
        req = arrival.request
        probe = EngineRequest(req.request_id, req.prompt_tokens, arrival.block_hashes,
                              req.output_tokens)  # fmt: skip
        try:
            firsts = [e.first_token_if(probe, now_s) for e in self.engines]
        except RequestTooLarge:  # too large for every replica: the replayer rejects it
            return _least_loaded(self.in_flight, self.rng)
        soonest = min(firsts)
        best = [i for i, t in enumerate(firsts) if t == soonest]
        if len(best) == 1:
            return best[0]
        return best[_least_loaded([self.in_flight[i] for i in best], self.rng)]


POLICY_NAMES = (
    "epp",
    "precise",
    "oracle",
    "cache-aware",
    "chwbl",
    "session-affinity",
    "least-load",
    "round-robin",
    "random",
)

ROLE_AWARE_POLICIES = ("epp", "precise", "oracle")
"""Policies that read P/D roles (epp's scheduler with a disaggregation config)."""

EXTRA_POLICY_NAMES = ("ttft-oracle",)
"""Policies the replay runs only when named (``--policies``)."""

PolicyFactory = Callable[[Cluster], Policy]
_EPP_POLICIES: dict[str, Callable[[Cluster, EppConfig], Policy]] = {
    "epp": EppPolicy, "precise": PrecisePolicy, "oracle": OraclePolicy,
}


def pd_config(decider: str, params: dict[str, Any] | None = None) -> EppConfig:
    """The shipped ``pd`` profile with another decider plugin type (and its parameters): the
    P/D comparisons' variants (bench/bench_pd.py)."""
    from importlib import resources

    import yaml

    doc = yaml.safe_load(resources.files("epp.config").joinpath("profiles/pd.yaml").read_text("utf-8"))
    doc["plugins"] = [p for p in doc["plugins"] if not p["type"].endswith("-pd-decider")]
    doc["plugins"].append({"type": decider, "parameters": params} if params else {"type": decider})
    handler = next(p for p in doc["plugins"] if p["type"] == "disagg-profile-handler")
    handler["parameters"]["deciders"] = {"prefill": decider}
    return parse_config(doc, f"pd, decider {decider} {params or ''}")


def policy_factory(spec: str, default_cfg: EppConfig | None = None) -> tuple[str, PolicyFactory]:
    """``spec`` is a policy name; ``epp``, ``precise`` and ``oracle`` take an optional config
    after a colon (``epp:filter-chain``, ``epp:my.yaml``). Returns the display name and a factory."""
    name, _, arg = spec.partition(":")
    if name in _EPP_POLICIES:
        cfg = load_config(arg) if arg else (default_cfg or default_config())
        cls = _EPP_POLICIES[name]
        return spec, lambda cluster: cls(cluster, cfg)
    simple: dict[str, Callable[[Cluster], Policy]] = {
        "random": RandomPolicy,
        "round-robin": RoundRobinPolicy,
        "least-load": LeastLoadPolicy,
        "session-affinity": SessionAffinityPolicy,
        "chwbl": ChwblPolicy,
        "cache-aware": CacheAwarePolicy,
        "ttft-oracle": TtftOraclePolicy,
    }
    if name not in simple or arg:
        known = ", ".join((*POLICY_NAMES, *EXTRA_POLICY_NAMES))
        raise ValueError(f"unknown policy {spec!r} (known: {known})")
    return spec, simple[name]
