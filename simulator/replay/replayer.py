"""Discrete-event replay of a workload against N emulated replicas and one routing policy.

Clock: simulated seconds from 0, jumped from event to event. Events are arrivals (in trace
order; a request log's closed-loop row, ``after`` another, ``delay_s`` after that one's
answer ends), the replicas' own events (``Engine.next_event_time``: admissions, first tokens,
finishes) and metric scrapes every ``scrape_interval_s`` (by default the period the policy's
epp config asks for, ``scraping.intervalSeconds``: 200 ms, 1 s for ``predicted-ttft``; as a
production scraper polls ``/metrics``). The replicas answer a scrape at no cost, so epp's
``scraping.serverShare`` (which slows the scraping of servers slow to render their page)
never stretches the period here.

For each arrival at ``t``:

1. every replica runs up to just before ``t``; responses that ended are fed back to the
   policy in time order (epp: the Director's ``finish`` with the server's
   ``cached_tokens`` and, when the workload has text, the generated text);
2. policies that read metrics see the last scrape at or before ``t``: the replicas are run
   to that tick and their running/waiting counts, KV usage and cache config are read there.
   Only the last tick before an arrival is materialised: nothing reads the metrics of the
   ticks in between, and the datastore's per-scrape state (``pending``) depends only on the
   last one. This is what makes a 17-minute trace cheap;
3. the policy picks a replica, the router counts the request in flight, and the request is
   submitted to that replica's engine. A request larger than the replica's whole KV cache
   is rejected (as vLLM rejects a prompt over its context) and reported as such.

Requests that arrive at the same instant share an engine step (the engine's own rule), so
replicas are advanced to the float just before ``t``, never to ``t`` itself.

Disaggregated serving (``ReplayConfig.roles``, ``--pd P:D``): replicas carry the
``llm-d.ai/role`` label, and a request the policy splits (epp's ``disagg-profile-handler``)
runs as the decoder's sidecar runs it: a prefill with one output token on the prefiller, the
KV transfer (``CostModel.kv_transfer_s`` of the prompt's full blocks), then the request on
the decoder, which loads the transferred blocks instead of computing them. The client's
first token is the decoder's. A split makes the replicas depend on each other (a prefill's
end submits to the decoder), so the replicas then advance event by event in time order.

Replicas on a shared host (``CostModel.shared_host_slowdown`` > 0) also depend on each other:
they advance event by event too, and whenever one starts or stops working the others' steps
are re-timed from their next step boundary. Host stalls (``CostModel.host_stall_rate_hz``)
are one seeded schedule all the replicas' engines share: they all stop during one.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from epp.datastore.scraper import DEFAULT_INTERVAL_S
from epp.framework.endpoint import EndpointId, Metrics
from epp.framework.types import ResponseInfo
from epp.plugins.preciseprefix.events import EventBatch, Kind, KvEvent
from epp.sync.apply import RemoteApplier
from epp.sync.load import PeerPrefill, SharedPrefill
from epp.sync.node import SharedIndex
from simulator.clihelp import parse_pd
from simulator.model.cache import PrefixCache, model_seed
from simulator.model.cost import CostModel
from simulator.model.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    Finished,
    RequestTooLarge,
    StepResult,
)
from simulator.model.stalls import HostStalls
from simulator.replay.policies import Arrival, Cluster, Policy, PolicyFactory
from simulator.replay.workload import (
    TraceRequest,
    Workload,
    engine_block_hashes,
    final_block_hashes,
    reply_text,
)

_EVENT_KINDS = {"stored": Kind.STORED, "removed": Kind.REMOVED, "cleared": Kind.CLEARED}


@dataclass(slots=True, frozen=True)
class ReplayConfig:
    replicas: int = 8
    kv_blocks: int = 4096
    """KV blocks per replica (4,096 x 16 tokens = 65,536 tokens)."""
    block_size_tokens: int = 16
    scrape_interval_s: float | None = None
    """Seconds between metric scrapes; None: the policy's own (an epp config's
    ``scraping.intervalSeconds``), else 200 ms."""
    max_num_seqs: int = 32
    max_batched_tokens: int = 8192
    chunked_prefill: bool = False
    """Replicas prefill in chunks of ``max_batched_tokens`` a step, shared with the decodes
    (vLLM's chunked prefill; ``EngineConfig.chunked_prefill``)."""
    max_loras: int = 4
    """Most distinct LoRA adapters a replica runs in one batch (vLLM ``--max-loras``)."""
    seed: int = 0
    model: str = "sim-model"
    sample_interval_s: float = 1.0
    """Per-replica load (running + waiting) is recorded at this period for the plots."""
    cost: CostModel = field(default_factory=CostModel)
    # --- where an index built from what the router sent goes wrong (docs/precise-prefix.md) ---
    routers: int = 1
    """Independent router instances (epp replicas, ``--epp-replicas``); arrival ``i`` goes
    through router ``i % routers``. Every router sees every scrape and KV event."""
    sync_delay_s: float | None = None
    """Index sync between the routers (``epp serve --peers``; ``--sync-flush-ms``): each
    router's own prefix index writes reach the others' indexes this long later, through the sync layer's
    ``RemoteApplier`` (the flush period, 20 ms by default, plus the network), and so does
    its prefill in flight (``sync_prefill``). None: no sync, each router learns only from
    what it routed. Only policies with an approximate prefix index (epp's) have anything to
    share; the others route as without."""
    sync_prefill: bool = True
    """With sync, each router also sends the others its prefill in flight (the predicted-TTFT
    scorer's, as ``epp serve`` does); False shares the index writes alone."""
    bypass_share: float = 0.0
    """Share of arrivals sent straight to a random replica, past the routers."""
    restarts: tuple[tuple[float, int], ...] = ()
    """(time in seconds, replica): the replica's cache is reset then (a restarted server)."""
    reported_kv_blocks: int = 0
    """KV blocks the replicas report in their metrics (0: ``kv_blocks``); more than they
    have models a cache smaller than configured."""
    event_delay_s: float = 0.05
    """KV-cache events reach the routers this long after the engine stored or evicted."""
    event_loss: float = 0.0
    """Share of KV-event batches lost on the way (sequence gaps)."""
    roles: tuple[str, ...] = ()
    """Per replica, its ``llm-d.ai/role`` label (prefill, decode, prefill-decode; "" none);
    empty: no roles (aggregated serving). See :func:`pd_roles`."""
    replies_cached: bool = True
    """A chat reply's blocks stay cached for the conversation's next turn, whose prompt holds
    the reply as the tokens generated (a model whose text comes back through its tokenizer as
    the same tokens). False: only the prompt's blocks do, as on the stack's real vLLM
    servers, whose tiny model has random weights: its replies come back as other tokens, and
    the next turn hits no block of the reply (the joint-8 session, docs/research/findings.md)."""
    reply_text_learned: bool = True
    """The router hears each reply's text when it ends, as ``epp serve`` does when the whole
    response passes through it (``epp envoy-config --response full-duplex``). False: it hears
    the usage and the first-token time only, as with the default bootstrap, whose streamed
    answers epp does not read past their first bytes (docs/envoy.md)."""

    def __post_init__(self) -> None:
        for name in ("replicas", "kv_blocks", "block_size_tokens", "max_num_seqs", "max_loras"):
            if getattr(self, name) <= 0:
                raise ValueError(f"replay setting {name!r} must be > 0")
        if (self.scrape_interval_s is not None and self.scrape_interval_s <= 0) \
                or self.sample_interval_s <= 0:
            raise ValueError("scrape and sample intervals must be > 0")
        if self.routers < 1:
            raise ValueError("replay setting 'routers' must be >= 1")
        for name in ("bypass_share", "event_loss"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"replay setting {name!r} must be in [0, 1]")
        if self.sync_delay_s is not None and self.sync_delay_s < 0:
            raise ValueError("replay setting 'sync_delay_s' must be >= 0")
        if self.event_delay_s < 0 or self.reported_kv_blocks < 0:
            raise ValueError("event_delay_s and reported_kv_blocks must be >= 0")
        for _, replica in self.restarts:
            if not 0 <= replica < self.replicas:
                raise ValueError(f"restart of replica {replica}: there are {self.replicas}")
        if self.roles:
            if len(self.roles) != self.replicas:
                raise ValueError(f"{len(self.roles)} roles for {self.replicas} replicas")
            bad = set(self.roles) - {"", *ROLES}
            if bad:
                raise ValueError(f"unknown role(s) {sorted(bad)} (known: {', '.join(ROLES)})")

    @property
    def disaggregated(self) -> bool:
        return any(self.roles)


ROLES = ("prefill", "decode", "prefill-decode", "both")


def pd_roles(spec: str) -> tuple[str, ...]:
    """``P:D`` -> P prefill replicas, then D decode replicas (``2:6``)."""
    n_pre, n_dec = parse_pd(spec)
    return ("prefill",) * n_pre + ("decode",) * n_dec


@dataclass(slots=True)
class Outcome:
    """One request's fate (mutable: filled in as its events happen)."""

    request_id: str
    replica: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    admitted_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    cached_tokens: int = 0
    router: int = 0
    """The router that picked the replica (-1: sent past the routers)."""
    tenant: str = ""
    dispatched_s: float = math.nan
    """When it reached a replica (later than ``arrival_s`` when flow control queued it)."""
    reason: str = ""
    """Why it was rejected (``too-large``, or flow control's reason)."""
    rejected: bool = False
    finished_count: int = 0
    """How many times a finish was reported (1 for a served request; tests check it)."""
    prefiller: int = -1
    """The replica that ran its prefill apart (disaggregated serving), -1: none."""
    prefill_done_s: float = math.nan
    """When that prefill ended (the KV transfer starts then)."""
    prefill_cached_tokens: int = 0
    """Prompt tokens that prefill found in the prefiller's cache."""


@dataclass(slots=True)
class ReplayResult:
    policy: str
    config: ReplayConfig
    outcomes: list[Outcome]
    sample_times_s: list[float]
    replica_load: list[list[int]]
    """Per replica, running + waiting requests at each sample time."""
    peak_blocks: list[int]
    """Per replica, the most blocks ever held (used + cached) at a sample or scrape."""
    wall_s: float
    ttft_predictions: list[tuple[float, float]] = field(default_factory=list)
    """(predicted, observed) TTFT of every response a policy's cost model predicted
    (``predicted-ttft-scorer``), for its prediction error."""
    scrape_interval_s: float = math.nan
    """The scrape period the policy saw (nan: it reads no metrics)."""


@dataclass(slots=True)
class _Live:
    arrival: Arrival
    outcome: Outcome
    reply: str
    decode: EngineRequest | None = None
    """Split requests: what the decoder runs once the prefill's KV has arrived."""


PREFILL_SUFFIX = "#prefill"
"""Engine request id of a split request's prefill: the request's id and this."""

ProgressFn = Callable[[int], None]


@dataclass(slots=True, frozen=True)
class _Wire:
    """A sync record as it crosses the network (the shape ``RemoteApplier`` reads)."""

    endpoint_id: str
    hashes: Sequence[int]
    age_s: float


class _IndexSync:
    """Index sync between the replay's routers, on the simulated clock. Each router's own
    index writes are taken where the live outbox takes them (the producer's ``subscribe``
    seam) and reach every other router's ``RemoteApplier`` ``delay_s`` later. With
    ``counters`` (each router's ``SharedPrefill`` plugin), each router's prefill in flight
    reaches the others' ``PeerPrefill`` as it stood ``delay_s`` ago, as the live stream sends
    it whole every flush. A router applies what is due when it next picks, which is all its
    index and its prefill figures are read for."""

    def __init__(self, producers: Sequence[SharedIndex], delay_s: float,
                 counters: Sequence[SharedPrefill] = ()) -> None:  # fmt: skip
        self.delay_s = delay_s
        self.log: deque[tuple[float, int, EndpointId, Sequence[int]]] = deque()
        """The writes not yet applied by every router: (stamp, source router, endpoint, hashes)."""
        self.base = 0
        """The log position of ``log[0]``."""
        self.cursor = [0] * len(producers)
        """Per router, the log position of the first write it has not read."""
        self.now_s = 0.0
        self.appliers = [RemoteApplier(p.apply_remote, lambda _eid: True, lambda: self.now_s)
                         for p in producers]  # fmt: skip
        for k, producer in enumerate(producers):
            producer.subscribe(functools.partial(self._record, k))
        self.counters = list(counters)
        n = len(self.counters)
        self.peers = [PeerPrefill() for _ in range(n)]
        for counter, peers in zip(self.counters, self.peers, strict=True):
            counter.use_peer_prefill(peers.tokens)
        self.sets: list[list[tuple[float, dict[str, float]]]] = [[] for _ in range(n)]
        """Per router, its prefill in flight each time it changed: (time, the whole set)."""
        self.read = [[0] * n for _ in range(n)]
        """``read[k][j]``: the position in ``sets[j]`` of the set router k last applied."""

    def _record(self, source: int, endpoint_id: EndpointId, hashes: Sequence[int], now_s: float) -> None:
        self.log.append((now_s, source, endpoint_id, hashes))

    def note(self, router: int, now_s: float) -> None:
        """``router`` may have changed its prefill in flight (a pick, a first token, an end)."""
        if not self.counters:
            return
        sets = self.sets[router]
        now = dict(self.counters[router].prefill_in_flight())
        if sets and sets[-1][1] == now:
            return
        sets.append((max(now_s, sets[-1][0]) if sets else now_s, now))

    def deliver(self, router: int, now_s: float) -> None:
        """Apply to ``router``'s index the other routers' writes made ``delay_s`` or more ago,
        and to its ``PeerPrefill`` their prefill in flight as it stood then."""
        self.now_s = now_s
        due = now_s - self.delay_s
        log, i = self.log, self.cursor[router] - self.base
        wires = []
        while i < len(log) and log[i][0] <= due:
            stamp, source, eid, hashes = log[i]
            if source != router:
                wires.append(_Wire(eid, hashes, now_s - stamp))
            i += 1
        self.cursor[router] = i + self.base
        if wires:
            self.appliers[router].apply(wires)
        read = min(self.cursor)
        while self.base < read:
            log.popleft()
            self.base += 1
        for j, sets in enumerate(self.sets):
            if j == router or not sets:
                continue
            at = bisect.bisect_right(sets, due, key=lambda e: e[0]) - 1
            if at >= 0:
                self.read[router][j] = at
                self.peers[router].update(str(j), sets[at][1].items(), now_s)
            # the sets every other router has read past are not needed again
            done = min(self.read[k][j] for k in range(len(self.sets)) if k != j)
            if done > 1024:
                del sets[:done]
                for k in range(len(self.sets)):
                    if k != j:
                        self.read[k][j] -= done


class Replayer:
    def __init__(self, config: ReplayConfig | None = None) -> None:
        self.config = config or ReplayConfig()
        self.engines: list[Engine] = []

    def run(
        self,
        workload: Workload,
        factory: PolicyFactory,
        name: str = "",
        progress: ProgressFn | None = None,
    ) -> ReplayResult:
        cfg = self.config
        wall0 = time.perf_counter()
        run = _Run(cfg, factory)
        self.engines = run.engines
        interval = cfg.scrape_interval_s or run.policy.scrape_interval_s or DEFAULT_INTERVAL_S
        last_scrape = -math.inf
        needs_metrics = run.policy.needs_metrics
        restarts = sorted(cfg.restarts)

        def reach(t: float, before: float) -> None:
            """Everything that happens before ``before``: restarts, samples, the scrape
            ``t`` sees, the replicas' steps, the KV events that have arrived."""
            nonlocal last_scrape
            while restarts and restarts[0][0] <= t:
                at, replica = restarts.pop(0)
                run.run_to(math.nextafter(at, -math.inf))
                run.restart(replica, at)
            run.sample_until(before)
            if needs_metrics:
                ts = math.floor(t / interval) * interval
                if ts > last_scrape:
                    run.run_to(min(ts, before))
                    run.scrape(ts)
                    last_scrape = ts
            run.run_to(before)
            run.deliver_events(t)

        for count, req in enumerate(run.arrivals(workload, reach), 1):
            t = req.arrival_s
            reach(t, math.nextafter(t, -math.inf))
            run.submit(req, t)
            if progress is not None and count % 64 == 0:
                progress(count)
        run.drain()
        if progress is not None:
            progress(len(run.outcomes))
        return ReplayResult(
            name or run.policy.name, cfg, run.outcomes, run.sample_times, run.loads, run.peak,
            time.perf_counter() - wall0,
            [pair for p in run.policies for pair in p.ttft_predictions()],
            interval if needs_metrics else math.nan,
        )  # fmt: skip


class _Run:
    """One policy's replay: the replicas, the requests in flight and what is measured."""

    def __init__(self, cfg: ReplayConfig, factory: PolicyFactory) -> None:
        self.cfg = cfg
        n = cfg.replicas
        engine_cfg = EngineConfig(max_num_seqs=cfg.max_num_seqs, max_batched_tokens=cfg.max_batched_tokens,
                                  max_loras=cfg.max_loras, chunked_prefill=cfg.chunked_prefill)  # fmt: skip
        self.max_loras = engine_cfg.max_loras
        self.engines = [
            Engine(PrefixCache(cfg.kv_blocks, cfg.block_size_tokens), cfg.cost, engine_cfg, seed=cfg.seed * 1_000 + i)
            for i in range(n)
        ]
        cost = cfg.cost
        stalls = HostStalls(cost.host_stall_rate_hz * cost.speedup, cost.host_stall_s / cost.speedup, cfg.seed)
        if stalls.active:  # one schedule: the host stops all of them at once
            for eng in self.engines:
                eng.stalls = stalls
        self.shared = cfg.cost.shared_host_slowdown if n > 1 else 0.0
        """The shared host's slowdown (0: independent replicas)."""
        self.busy = [False] * n
        ids = [EndpointId(f"10.0.{i // 250}.{i % 250 + 1}:8000") for i in range(n)]
        self.in_flight = [[0] * n for _ in range(cfg.routers)]
        """Per router, requests it sent to each replica and has not seen end."""
        self.policies: list[Policy] = [
            factory(Cluster(self.engines, ids, self.in_flight[k], cfg.block_size_tokens,
                            cfg.model, cfg.seed + k, cfg.roles))
            for k in range(cfg.routers)
        ]  # fmt: skip
        self.policy = self.policies[0]
        self.sync: _IndexSync | None = None
        if cfg.sync_delay_s is not None and cfg.routers > 1:
            # only when every router has it (epp's policies): the others route as without
            producers = [x for p in self.policies if (x := p.index_producer()) is not None]
            counters = [c for p in self.policies if (c := p.prefill_counter()) is not None]
            if len(producers) == cfg.routers:
                shared = counters if cfg.sync_prefill and len(counters) == cfg.routers else []
                self.sync = _IndexSync(producers, cfg.sync_delay_s, shared)
        if cfg.disaggregated and not self.policy.knows_roles:
            raise ValueError(f"policy {self.policy.name!r} does not read endpoint roles: "
                             "disaggregated replays (--pd) run epp, precise or oracle with a "
                             "P/D config (--config pd)")  # fmt: skip
        self.seed = model_seed(cfg.model)
        self.live: dict[str, _Live] = {}
        self.outcomes: list[Outcome] = []
        self.sample_times: list[float] = []
        self.loads: list[list[int]] = [[] for _ in range(n)]
        self.peak = [0] * n
        self.next_sample = 0.0
        self.rng = random.Random(cfg.seed ^ 0x5EED)
        # disaggregated serving: KV transfers on their way to a decoder
        self.transfers: list[tuple[float, int, str]] = []
        """Heap of (ready, order, request id)."""
        self.transfer_order = 0
        self.arrivals_count = 0
        # closed loop: requests sent after others end
        self.waiting: dict[str, list[TraceRequest]] = {}
        """Per request id, the requests waiting for it to end."""
        self.unreleased: dict[str, int] = {}
        """Per waiting request, how many of the requests it waits for have not ended."""
        self.blocked = 0
        self.released: list[tuple[float, int, TraceRequest]] = []
        """Heap of (arrival, order, request): released, not yet submitted."""
        self.release_order = 0
        self.pending: dict[str, Outcome] = {}
        """Requests not yet at a replica (held by a router's flow control)."""
        # KV-cache events, for policies that read them (vLLM's publisher, one per replica)
        self.wants_events = any(p.wants_events for p in self.policies)
        self.event_buffer: list[list[KvEvent]] = [[] for _ in range(n)]
        self.event_seq = [0] * n
        self.in_transit: deque[tuple[float, int, EventBatch]] = deque()
        if self.wants_events:
            for i, eng in enumerate(self.engines):
                eng.cache.events = functools.partial(self._cache_event, i)

    def arrivals(self, workload: Workload, reach: Callable[[float, float], None]) -> Iterator[TraceRequest]:
        """The workload's requests in arrival order. A request sent ``after`` another
        (closed loop, a request log's ``after``) arrives ``delay_s`` after that one's answer
        ends: while such requests wait, the replicas advance event by event (``reach``) so
        that each is released at its time, before later arrivals."""
        requests = workload.requests()
        if getattr(workload, "closed_loop", False):  # read whole: a row may wait for any other
            independent = []
            for r in requests:
                if r.after:
                    for parent in r.after:
                        self.waiting.setdefault(parent, []).append(r)
                    self.unreleased[r.request_id] = len(r.after)
                    self.blocked += 1
                else:
                    independent.append(r)
            requests = iter(independent)
        nxt = next(requests, None)
        released = self.released
        while nxt is not None or released or self.blocked:
            t_src = nxt.arrival_s if nxt is not None else math.inf
            stepped = -math.inf
            while self.blocked:
                t_rel = released[0][0] if released else math.inf
                t_eng = self.next_event_time()
                if t_eng is None or t_eng >= min(t_src, t_rel) or t_eng <= stepped:
                    break
                reach(t_eng, t_eng)
                stepped = t_eng
            if released and released[0][0] < t_src:
                t_rel, _, req = heapq.heappop(released)
                yield dataclasses.replace(req, arrival_s=t_rel)
            elif nxt is not None:
                yield nxt
                nxt = next(requests, None)
            elif self.next_event_time() is None:
                raise ValueError(f"{self.blocked} requests wait for requests that never ran")
            else:
                t_eng = self.next_event_time()
                assert t_eng is not None
                reach(t_eng, t_eng)

    def next_event_time(self) -> float | None:
        """The replicas' (and KV transfers') next event, None when all are idle."""
        times = [t for e in self.engines if (t := e.next_event_time()) is not None]
        if self.transfers:
            times.append(self.transfers[0][0])
        return min(times) if times else None

    def _release(self, request_id: str, t: float) -> None:
        """``request_id`` ended at ``t``: the requests sent after it (and after others that
        have ended before) are due."""
        for req in self.waiting.pop(request_id, ()):
            left = self.unreleased[req.request_id] - 1
            if left:
                self.unreleased[req.request_id] = left
                continue
            del self.unreleased[req.request_id]
            self.blocked -= 1
            self.release_order += 1
            heapq.heappush(self.released, (t + req.delay_s, self.release_order, req))

    def _cache_event(self, replica: int, kind: str, hashes: Sequence[int]) -> None:
        self.event_buffer[replica].append(KvEvent(_EVENT_KINDS[kind], hashes, "GPU", None,
                                                  self.cfg.block_size_tokens))  # fmt: skip

    def _flush_events(self, t: float) -> None:
        """What the replicas published up to ``t``, one batch each, on its way to the routers."""
        cfg = self.cfg
        for i, buf in enumerate(self.event_buffer):
            if not buf:
                continue
            seq = self.event_seq[i]
            self.event_seq[i] = seq + 1
            batch = EventBatch("", seq, t, buf)
            self.event_buffer[i] = []
            if cfg.event_loss and self.rng.random() < cfg.event_loss:
                continue
            self.in_transit.append((t + cfg.event_delay_s, i, batch))

    def deliver_events(self, now: float) -> None:
        transit = self.in_transit
        while transit and transit[0][0] <= now:
            at, replica, batch = transit.popleft()
            for p in self.policies:
                p.kv_events(replica, batch, at)

    def restart(self, replica: int, t: float) -> None:
        """The replica's server restarted: its cache is empty and its event numbering
        starts again from 0."""
        if self.wants_events:
            self._flush_events(t)
            self.event_seq[replica] = 0
        self.engines[replica].cache.reset()
        if self.wants_events:
            self._flush_events(t)

    def run_to(self, x: float) -> None:
        """Every replica runs to ``x``; finished requests go back to the policy in time order."""
        if self.cfg.disaggregated or self.shared:
            self._run_events_to(x)
        else:
            done: list[tuple[float, int, Finished]] = []
            for i, eng in enumerate(self.engines):
                ne = eng.next_event_time()
                if ne is not None and ne <= x:
                    self._took(i, eng.advance(x), done)
            self._settle(done)
        if self.wants_events and x != math.inf:
            self._flush_events(x)
        if self.holding and x != math.inf:
            self.poll(x)  # room for held requests (they reach a replica at x)

    def _run_events_to(self, x: float) -> None:
        """Replicas that hand work to each other (prefill -> KV transfer -> decode), or share
        a host, advance one event at a time, the earliest first, so a decode starts at its
        transfer's end and a step is timed by what the others do when it starts."""
        engines = self.engines
        transfers = self.transfers
        while True:
            soonest, which = math.inf, -1
            for i, eng in enumerate(engines):
                ne = eng.next_event_time()
                if ne is not None and ne < soonest:
                    soonest, which = ne, i
            ready = transfers[0][0] if transfers else math.inf
            if transfers and ready <= x and ready <= soonest:
                _, _, rid = heapq.heappop(transfers)
                self._decode(rid, ready)
            elif which >= 0 and soonest <= x:
                done: list[tuple[float, int, Finished]] = []
                self._took(which, engines[which].advance(soonest), done)
                self._settle(done)
                if self.shared:
                    self._contend(soonest)
            else:
                return

    def _contend(self, t: float) -> None:
        """Re-time the replicas whose share of the host changed at ``t``: a replica's steps
        take ``1 + shared * (busy others / others)`` times their cost."""
        engines = self.engines
        busy = [e.next_event_time() is not None for e in engines]
        if busy == self.busy:
            return
        self.busy = busy
        n_busy, others = sum(busy), len(engines) - 1
        for i, eng in enumerate(engines):
            slowdown = 1.0 + self.shared * (n_busy - busy[i]) / others
            if slowdown != eng.slowdown:
                eng.slowdown = slowdown
                if busy[i]:
                    eng.reprice(t)

    def _took(self, i: int, res: StepResult, done: list[tuple[float, int, Finished]]) -> None:
        live = self.live
        for f in res.first_tokens:
            if f.request_id.endswith(PREFILL_SUFFIX):
                continue  # the sidecar drops the prefiller's token
            entry = live[f.request_id]
            o = entry.outcome
            o.admitted_s = f.admitted_s
            o.first_token_s = f.time_s
            if o.router >= 0:
                self.policies[o.router].first_token(entry.arrival, f.time_s - o.dispatched_s,
                                                    f.time_s)  # fmt: skip
                if self.sync is not None:
                    self.sync.note(o.router, f.time_s)
        for d in res.finished:
            if d.request_id.endswith(PREFILL_SUFFIX):
                self._prefilled(
                    d.request_id.removesuffix(PREFILL_SUFFIX), d.time_s, d.cached_tokens
                )
            else:
                done.append((d.time_s, i, d))

    def _settle(self, done: list[tuple[float, int, Finished]]) -> None:
        if len(done) > 1:
            done.sort(key=lambda e: (e[0], e[1]))
        live = self.live
        for t_done, i, d in done:
            entry = live.pop(d.request_id)
            o = entry.outcome
            o.finish_s = t_done
            if self.waiting:
                self._release(d.request_id, t_done)
            # a split request's compute saved is the prefiller's hits; the decoder reports
            # what it loaded as cached too (as vLLM does), which the router learns from
            o.cached_tokens = d.cached_tokens if o.prefiller < 0 else o.prefill_cached_tokens
            o.finished_count += 1
            if o.router >= 0:
                self.in_flight[o.router][i] -= 1
                reply = entry.reply if self.cfg.reply_text_learned else ""
                info = ResponseInfo(200, o.prompt_tokens, d.cached_tokens, d.output_tokens, reply,
                                    ttft_s=o.first_token_s - o.dispatched_s)  # fmt: skip
                self.policies[o.router].finished(entry.arrival, i, info, t_done)
                if self.sync is not None:
                    self.sync.note(o.router, t_done)

    def _prefilled(self, request_id: str, t: float, cached_tokens: int) -> None:
        """A split request's prefill ended: its KV (the prompt's full blocks) goes to the decoder."""
        entry = self.live[request_id]
        entry.outcome.prefill_done_s = t
        entry.outcome.prefill_cached_tokens = cached_tokens
        assert entry.decode is not None
        full = (
            entry.decode.num_prompt_tokens
            // self.cfg.block_size_tokens
            * self.cfg.block_size_tokens
        )
        self.transfer_order += 1
        heapq.heappush(self.transfers, (t + self.cfg.cost.kv_transfer_s(full), self.transfer_order,
                                        request_id))  # fmt: skip

    def _decode(self, request_id: str, t: float) -> None:
        """The KV arrived: the request runs on its decoder."""
        entry = self.live[request_id]
        assert entry.decode is not None
        self.engines[entry.outcome.replica].submit(entry.decode, t)  # sized at the prefill
        if self.shared:
            self._contend(t)

    def note_blocks(self) -> None:
        for i, eng in enumerate(self.engines):
            c = eng.cache
            self.peak[i] = max(self.peak[i], c.used_blocks + c.cached_blocks)

    def sample_until(self, before: float) -> None:
        while self.next_sample <= before:
            self.run_to(self.next_sample)
            self.sample()

    def sample(self) -> None:
        self.sample_times.append(self.next_sample)
        for i, eng in enumerate(self.engines):
            self.loads[i].append(eng.num_running + eng.num_waiting)
        self.note_blocks()
        self.next_sample += self.cfg.sample_interval_s

    def scrape(self, ts: float) -> None:
        cfg = self.cfg
        stamp = max(ts, 1e-9)  # epp reads scraped_at_s == 0 as "never scraped"
        reported = cfg.reported_kv_blocks or cfg.kv_blocks
        metrics = [
            Metrics(
                waiting=eng.num_waiting,
                running=eng.num_running,
                kv_usage=eng.kv_usage,
                running_adapters=frozenset(eng.running_adapters()),
                waiting_adapters=frozenset(eng.waiting_adapters()),
                max_adapters=self.max_loras,
                block_size_tokens=cfg.block_size_tokens,
                num_gpu_blocks=reported,
                scraped_at_s=stamp,
                served_models=frozenset({cfg.model}),
            )
            for eng in self.engines
        ]
        for p in self.policies:
            p.observe(metrics, ts)

    def submit(self, req: TraceRequest, t: float) -> None:
        cfg = self.cfg
        hashes = engine_block_hashes(req, cfg.block_size_tokens, self.seed)
        arrival = Arrival(req, hashes)
        k = self.arrivals_count % cfg.routers
        self.arrivals_count += 1
        outcome = Outcome(req.request_id, -1, t, req.prompt_tokens, req.output_tokens,
                          tenant=req.tenant)  # fmt: skip
        self.outcomes.append(outcome)
        self.pending[req.request_id] = outcome
        if cfg.bypass_share and self.rng.random() < cfg.bypass_share:
            outcome.router = -1
            self._start(arrival, self.rng.randrange(cfg.replicas), t)
            return
        outcome.router = k
        if self.sync is not None:
            self.sync.deliver(k, t)
        replica = self.policies[k].pick(arrival, t)
        if self.sync is not None:
            self.sync.note(k, t)
        if replica is not None:
            self._start(arrival, replica, t)
        self.poll(t)

    def poll(self, t: float) -> None:
        """What the routers released (flow control) or rejected since."""
        for policy in self.policies:
            for arrival, replica, reason in policy.poll(t):
                if replica is None:
                    o = self.pending.pop(arrival.request.request_id)
                    o.rejected, o.reason = True, reason
                    o.finished_count += 1
                    self._release(o.request_id, t)
                else:
                    self._start(arrival, replica, t)

    @property
    def holding(self) -> int:
        return sum(p.holding for p in self.policies)

    def _start(self, arrival: Arrival, replica: int, t: float) -> None:
        """The request reaches ``replica`` at ``t``."""
        req = arrival.request
        outcome = self.pending.pop(req.request_id)
        outcome.replica = replica
        outcome.dispatched_s = t
        router = outcome.router
        if router >= 0:
            self.in_flight[router][replica] += 1
        reply = reply_text(req)
        final = final_block_hashes(req, reply, self.cfg.block_size_tokens, self.seed) if self.cfg.replies_cached else None
        ereq = EngineRequest(req.request_id, req.prompt_tokens, arrival.block_hashes,
                             req.output_tokens, final, req.adapter)  # fmt: skip
        prefiller = self.policies[router].prefiller(req.request_id) if router >= 0 else None
        entry = self.live[req.request_id] = _Live(arrival, outcome, reply)
        try:
            if prefiller is None:
                self.engines[replica].submit(ereq, t)
            else:  # the decoder's sidecar: prefill there (one token), then decode here
                outcome.prefiller = prefiller
                entry.decode = dataclasses.replace(ereq, external_tokens=req.prompt_tokens)
                decoder = self.engines[replica].cache
                if decoder.blocks_for(req.prompt_tokens + req.output_tokens) > decoder.num_blocks:
                    raise RequestTooLarge("too large for the decoder")
                prefill = EngineRequest(req.request_id + PREFILL_SUFFIX, req.prompt_tokens,
                                        arrival.block_hashes, 1, None, req.adapter)  # fmt: skip
                self.engines[prefiller].submit(prefill, t)
        except RequestTooLarge:
            del self.live[req.request_id]
            outcome.rejected = True
            outcome.reason = "too-large"
            outcome.finished_count += 1
            self._release(req.request_id, t)
            if router >= 0:
                self.in_flight[router][replica] -= 1
                self.policies[router].finished(arrival, replica, ResponseInfo(status=400), t)
                if self.sync is not None:
                    self.sync.note(router, t)
        if self.shared:
            self._contend(t)

    def drain(self) -> None:
        """Keep sampling while replicas work or routers hold requests, then run everything
        to the end."""
        while (
            self.holding
            or self.transfers
            or any(e.next_event_time() is not None for e in self.engines)
        ):
            self.run_to(self.next_sample)
            self.scrape(self.next_sample)
            self.poll(self.next_sample)
            self.sample()
        self.run_to(math.inf)
        self.note_blocks()
        assert not self.live, f"{len(self.live)} requests never finished"
