"""Routing policies the replayer compares. Each picks a replica index for one arrival.

* ``epp``: the real epp :class:`~epp.scheduling.scheduler.Scheduler` built from a config
  file (the shipped default unless one is named), fed as production feeds it: endpoint
  metrics through a :class:`~epp.datastore.store.Datastore` at every scrape, in-flight and
  pending counts through ``request_started``/``request_finished``, and ``on_response`` with
  the server's ``cached_tokens`` and the generated text (when the workload has text).
* ``precise``: the same profile (filters, weighted scorers, picker of the same config), but
  the prefix match is read from the replicas' true caches (``contains_prefix``), the upper
  bound that an index fed by KV-cache events would reach. Load is balanced exactly as epp
  balances it, so the gap between ``epp`` and ``precise`` is the cost of approximation.
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
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from epp.config.loader import EppConfig, default_config, load_config
from epp.datastore.endpoint import Endpoint, EndpointId, Metrics
from epp.datastore.store import Datastore
from epp.request.types import InferenceRequest
from epp.scheduling.scheduler import Scheduler, build_profile
from epp.scheduling.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from simulator.model.engine import Engine
from simulator.model.tokens import CHARS_PER_TOKEN
from simulator.replay.radix import ApproxRadixTree
from simulator.replay.workload import TraceRequest


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


class Policy:
    """Base: override ``pick``; ``observe`` (scrapes) and ``finished`` are optional."""

    name = "policy"
    needs_metrics = False

    def pick(self, arrival: Arrival, now_s: float) -> int:
        raise NotImplementedError

    def observe(self, metrics: Sequence[Metrics], now_s: float) -> None:
        pass

    def finished(self, arrival: Arrival, replica: int, info: ResponseInfo, now_s: float) -> None:
        pass


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
    """Endpoints in a real Datastore, refreshed by scrapes as the production scraper does."""

    needs_metrics = True

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        self.cfg = cfg
        self.model = cluster.model
        self.ids = list(cluster.endpoint_ids)
        self.index_of = {eid: i for i, eid in enumerate(self.ids)}
        self.store = Datastore(stale_after_s=cfg.saturation.metrics_staleness_seconds)
        for eid in self.ids:
            host, _, port = eid.rpartition(":")
            self.store.upsert(Endpoint(eid, host, int(port)))
        self.picks: dict[str, PickResult] = {}

    def observe(self, metrics: Sequence[Metrics], now_s: float) -> None:
        update = self.store.update_metrics
        for eid, m in zip(self.ids, metrics):
            update(eid, m)

    def _inference_request(self, arrival: Arrival) -> InferenceRequest:
        r = arrival.request
        return InferenceRequest(r.request_id, self.model, r.prompt, api=r.api)


class EppPolicy(_EppBase):
    name = "epp"

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        super().__init__(cluster, cfg)
        self.scheduler = Scheduler.from_config(cfg, random.Random(cluster.seed))
        self.store.on_removed(self.scheduler.remove_endpoint)
        self.store.on_metrics(self.scheduler.observe_endpoint)
        self.sweep_interval_s = cfg.prefix.sweep_interval_seconds
        self.next_sweep_s = self.sweep_interval_s

    def pick(self, arrival: Arrival, now_s: float) -> int:
        if now_s >= self.next_sweep_s:
            self.scheduler.sweep(now_s)
            self.next_sweep_s = now_s + self.sweep_interval_s
        result = self.scheduler.schedule(
            self._inference_request(arrival), self.store.snapshot(), now_s
        )
        target = result.target.id
        self.store.request_started(target)
        self.picks[arrival.request.request_id] = result
        return self.index_of[target]

    def finished(self, arrival: Arrival, replica: int, info: ResponseInfo, now_s: float) -> None:
        result = self.picks.pop(arrival.request.request_id)
        self.store.request_finished(result.target.id)
        self.scheduler.on_response(result, info)


class PrecisePolicy(_EppBase):
    name = "precise"

    def __init__(self, cluster: Cluster, cfg: EppConfig) -> None:
        super().__init__(cluster, cfg)
        self.profile = build_profile(cfg)
        self.engines = list(cluster.engines)
        self.rng = random.Random(cluster.seed)
        self.block_chars = cluster.block_size_tokens * CHARS_PER_TOKEN
        self.targets: dict[str, EndpointId] = {}

    def pick(self, arrival: Arrival, now_s: float) -> int:
        hashes = arrival.block_hashes
        matched: dict[EndpointId, int] = {}
        if hashes:
            for eid, engine in zip(self.ids, self.engines):
                n = engine.cache.contains_prefix(hashes)
                if n:
                    matched[eid] = n
        state = CycleState(self._inference_request(arrival), now_s, self.rng)
        state.prefix = PrefixMatch(hashes, matched, self.block_chars)
        outcome = self.profile.run(state, self.store.snapshot(), 1)
        target = outcome.targets[0].id
        self.store.request_started(target)
        self.targets[arrival.request.request_id] = target
        return self.index_of[target]

    def finished(self, arrival: Arrival, replica: int, info: ResponseInfo, now_s: float) -> None:
        self.store.request_finished(self.targets.pop(arrival.request.request_id))


POLICY_NAMES = (
    "epp",
    "precise",
    "cache-aware",
    "chwbl",
    "session-affinity",
    "least-load",
    "round-robin",
    "random",
)

PolicyFactory = Callable[[Cluster], Policy]


def policy_factory(spec: str, default_cfg: EppConfig | None = None) -> tuple[str, PolicyFactory]:
    """``spec`` is a policy name; ``epp`` and ``precise`` take an optional config after a
    colon (``epp:filter-chain``, ``epp:my.yaml``). Returns the display name and a factory."""
    name, _, arg = spec.partition(":")
    if name in ("epp", "precise"):
        cfg = load_config(arg) if arg else (default_cfg or default_config())
        cls = EppPolicy if name == "epp" else PrecisePolicy
        return spec, lambda cluster: cls(cluster, cfg)
    simple: dict[str, Callable[[Cluster], Policy]] = {
        "random": RandomPolicy,
        "round-robin": RoundRobinPolicy,
        "least-load": LeastLoadPolicy,
        "session-affinity": SessionAffinityPolicy,
        "chwbl": ChwblPolicy,
        "cache-aware": CacheAwarePolicy,
    }
    if name not in simple or arg:
        raise ValueError(f"unknown policy {spec!r} (known: {', '.join(POLICY_NAMES)})")
    return spec, simple[name]
