"""Index sync over gRPC: serve this replica's own writes, follow every peer's.

Each replica runs an ``epp.sync.v1.IndexSync`` server on its sync port and one follower per
peer that calls ``Subscribe`` and applies the batches it receives. The producer's
``on_record`` feeds the outbox; received records go to ``apply_remote``, which never
publishes, so a write travels exactly one hop. Design and failure modes: docs/sync.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import grpc

from epp.datastore.store import Datastore
from epp.framework.endpoint import EndpointId
from epp.framework.observation import Kind, Observation
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.supervise import spawn
from epp.sync.apply import RemoteApplier, stamp_from_age
from epp.sync.gen import sync_pb2, sync_pb2_grpc
from epp.sync.load import PeerPrefill
from epp.sync.outbox import DEFAULT_CAPACITY_CHUNKS, ItemRing, Outbox, OutboxRead
from epp.sync.peers import HostPort, PeerSet, resolve_ips, watch_dns
from epp.sync.stored import SharedStored

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 << 20
_MAX_BATCH_CHUNKS = 65_536
"""Hashes per message (512 KiB of fixed64): a batch of long prompts is split, not refused."""
_MAX_PREFILL_ENDPOINTS = 10_000
"""Endpoints in one prefill set (sent or applied)."""
_PREFILL_HEARTBEAT_S = 1.0
"""An unchanged prefill set is sent again this often, so that a peer can tell quiet from gone."""
_PREFILL_STALE_S = 3.0
"""A peer's prefill set that has not been renewed for this long no longer counts."""
_SELF = "subscribed to itself"
_STORED_PER_PART = 4096
_MAX_OBSERVED_STORED = 4
"""Stored ids taken from one observation (a reader notes at most 4)."""
"""Stored objects per snapshot part."""

RecordSink = Callable[[EndpointId, Sequence[int], float], None]
"""Told of each index write the replica makes itself: endpoint, chain hashes, stamp."""


@runtime_checkable
class SharedIndex(Protocol):
    """What index sync shares, implemented by the plugin that owns the index (the
    approximate prefix producer): the server looks for it among the plugins by this
    protocol, not by name."""

    name: str

    @property
    def index(self) -> PrefixIndex: ...

    def subscribe(self, sink: RecordSink) -> Callable[[], None]:
        """Hear of every index write this replica makes itself; returns the unsubscribe."""
        ...

    def apply_remote(self, endpoint_id: EndpointId, hashes: Sequence[int], stamp_s: float) -> None:
        """Store a peer's write (never republished)."""
        ...


@dataclass(slots=True)
class SyncOptions:
    port: int = 9004
    """0 picks a free port (tests)."""
    peers: list[HostPort] = field(default_factory=list)
    peer_dns: HostPort | None = None
    own_ips: frozenset[str] = frozenset()
    """This pod's addresses, skipped in DNS answers."""
    dns_interval_s: float = 5.0
    flush_interval_s: float = 0.02
    batch_records: int = 256
    buffer_records: int = 8192
    buffer_chunks: int = DEFAULT_CAPACITY_CHUNKS
    """Chain hashes the outbox holds for slow subscribers, at most (its bound in bytes)."""
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    tls: SyncTls | None = None
    """Mutual TLS on the sync port; None: plaintext (logged loudly)."""
    max_subscribers: int = 32
    """Concurrent Subscribe/Snapshot streams served; more get RESOURCE_EXHAUSTED."""
    warm_timeout_s: float = 10.0
    """A starting replica spends at most this long fetching a peer's index (0: no warm start)."""
    warm_max_entries: int = 4_000_000
    share_prefill: bool = True
    """Also send this replica's prefill in flight and add the peers' to its own (the prefill
    ledger the predicted-TTFT and token-load scorers and the load-aware decider read);
    False: the index writes alone."""


@dataclass(slots=True, frozen=True)
class SyncTls:
    """PEM files: this replica's certificate and key (served and presented to peers) and the
    CA that signed every replica's certificate. Peers must present a certificate from that
    CA; a follower checks the peer's certificate against ``server_name`` (when set) instead
    of the address it dials (pod IPs are rarely in a certificate)."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str = ""

    def _read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for flag, path in (("--sync-cert", self.cert_file), ("--sync-key", self.key_file),
                           ("--sync-ca", self.ca_file)):  # fmt: skip
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as exc:
                raise OSError(f"cannot read {flag} {path!r}: {exc.strerror}") from None
        return out[0], out[1], out[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(ca, key, cert)


@dataclass(slots=True, frozen=True)
class WarmStart:
    """What a starting replica fetched from a peer."""

    peer: str
    entries: int
    endpoints: int
    seconds: float
    complete: bool
    """False when the size or time bound cut the snapshot short."""


class _Wakeup:
    """Broadcast to every subscriber stream: a fresh event per round, set once."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()


class IndexSyncService(sync_pb2_grpc.IndexSyncServicer):  # type: ignore[misc]
    def __init__(
        self,
        replica_id: str,
        outbox: Outbox,
        wakeup: _Wakeup,
        options: SyncOptions,
        metrics: EppMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.replica_id = replica_id
        self._outbox = outbox
        self._wakeup = wakeup
        self._opts = options
        self._metrics = metrics
        self._clock = clock
        self.subscribers = 0
        self.snapshots = 0
        self.index: PrefixIndex | None = None
        self.observations = ItemRing()
        self.stored = ItemRing(options.buffer_records)
        """Stored objects this replica learnt, ``(id, endpoint)`` stamped with their use."""
        self.stored_source: Callable[[], list[tuple[str, EndpointId, float]]] | None = None
        """Every stored object this replica holds, for snapshots (``SharedStored``)."""
        self.prefill_source: Callable[[], Mapping[str, float]] | None = None
        """This replica's prefill in flight per endpoint (the predicted-TTFT scorer's
        ``outstanding``), sent to the subscribers whole (``RecordBatch.prefill``)."""

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if request.replica_id == self.replica_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _SELF)
        if self.subscribers + self.snapshots >= self._opts.max_subscribers:
            log.warning("sync stream from %s refused: %d already open (--sync-max-subscribers)",
                        context.peer(), self.subscribers + self.snapshots)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "this replica serves no more sync streams")

    async def Snapshot(  # the generated servicer's method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await self._admit(request, context)
        index = self.index
        if index is None:
            return
        self.snapshots += 1
        budget = request.max_entries or (1 << 62)
        sent = 0
        try:
            for eid in index.endpoint_ids():
                if sent >= budget:
                    break
                # the export reads the index a slice (~1k entries) at a time, on the loop:
                # requests are served between slices (one piece held it 55 ms per 200k)
                part = sync_pb2.SnapshotPart(endpoint_id=eid)
                part_chunks = 0
                for piece in index.export_slices(eid):
                    now = self._clock()
                    for w in piece.writes:
                        if sent >= budget:
                            break
                        part.writes.add(hashes=w.hashes, age_s=now - w.stamp_s)
                        part_chunks += len(w.hashes)
                        sent += len(w.hashes)
                        if part_chunks >= _MAX_BATCH_CHUNKS:
                            yield part
                            part = sync_pb2.SnapshotPart(endpoint_id=eid)
                            part_chunks = 0
                    part.roots.extend(piece.roots)
                    await asyncio.sleep(0)
                yield part
            stored = 0
            if self.stored_source is not None:
                items = self.stored_source()
                now = self._clock()
                for start in range(0, len(items), _STORED_PER_PART):
                    part = sync_pb2.SnapshotPart()
                    for oid, eid, stamp in items[start : start + _STORED_PER_PART]:
                        part.stored.add(id=oid, endpoint_id=eid, age_s=now - stamp)
                    stored += len(part.stored)
                    yield part
            log.info("sync snapshot of %d entries and %d stored objects sent to %s", sent,
                     stored, request.replica_id)  # fmt: skip
        finally:
            self.snapshots -= 1

    async def Subscribe(  # the generated servicer's method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await self._admit(request, context)
        outbox, observations, stored = self._outbox, self.observations, self.stored
        cursor, seen, stored_seen = outbox.attach(), observations.head, stored.head
        self.subscribers += 1
        self._metrics.sync_subscribers.set(self.subscribers)
        log.info("sync subscriber %s connected (%s)", request.replica_id, context.peer())
        sent_prefill: dict[str, float] | None = None
        sent_prefill_at = -math.inf
        try:
            yield sync_pb2.RecordBatch(replica_id=self.replica_id)  # "connected"
            while True:
                event = self._wakeup.event
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self._opts.flush_interval_s)
                most = self._opts.batch_records
                prefill = self._prefill_due(sent_prefill, sent_prefill_at)
                while True:
                    read = outbox.read(cursor, most, _MAX_BATCH_CHUNKS)
                    observed = observations.read(seen, most)
                    homes = stored.read(stored_seen, most)
                    if (not read.writes and not read.dropped and not observed.items
                            and not homes.items and prefill is None):  # fmt: skip
                        break
                    cursor, seen, stored_seen = read.next_cursor, observed.next_cursor, homes.next_cursor
                    batch = self._encode(read)
                    self._add_observations(batch, observed.items)
                    self._add_stored(batch, homes.items, homes.dropped)
                    if prefill is not None:
                        batch.prefill_snapshot = True
                        for eid, tokens in prefill.items():
                            batch.prefill.add(endpoint_id=eid, tokens=tokens)
                        sent_prefill, sent_prefill_at, prefill = prefill, self._clock(), None
                    yield batch
                    if len(read.writes) < most and len(observed.items) < most and len(homes.items) < most:
                        break
        finally:
            outbox.detach()
            self.subscribers -= 1
            self._metrics.sync_subscribers.set(self.subscribers)
            log.info("sync subscriber %s left", request.replica_id)

    def _prefill_due(self, sent: dict[str, float] | None, sent_at: float) -> dict[str, float] | None:
        """This replica's prefill in flight when it is to be sent: changed since the stream's
        last set, or that set is a second old (so that the peer can tell quiet from gone)."""
        source = self.prefill_source
        if source is None:
            return None
        now = dict(itertools.islice(source().items(), _MAX_PREFILL_ENDPOINTS))
        if now != sent or self._clock() - sent_at >= _PREFILL_HEARTBEAT_S:
            return now
        return None

    def _add_observations(self, batch: Any, items: list[tuple[Any, float]]) -> None:
        if not items:
            return
        now = self._clock()
        for o, stamp in items:
            # first_bytes_age_s is carried as a stamp until now (negative: no bytes came)
            first = o.first_bytes_age_s
            batch.observations.add(
                token=o.token, kind=int(o.kind), age_s=now - stamp,
                first_bytes_age_s=max(0.0, now - first) if first >= 0 else first,
                status=o.status, prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens,
                completion_tokens=o.completion_tokens, response_bytes=o.response_bytes,
                generated_text=o.generated_text, stored_ids=o.stored_ids,
            )  # fmt: skip

    def _add_stored(self, batch: Any, items: list[tuple[Any, float]], dropped: int) -> None:
        if dropped:
            self._metrics.sync_dropped_slow.inc(dropped)
        if not items:
            return
        now = self._clock()
        add = batch.stored.add
        for (oid, eid), stamp in items:
            add(id=oid, endpoint_id=eid, age_s=now - stamp)

    def _encode(self, read: OutboxRead) -> Any:
        now = self._clock()
        batch = sync_pb2.RecordBatch(replica_id=self.replica_id, dropped=read.dropped)
        add = batch.records.add
        for w in read.writes:
            add(endpoint_id=w.endpoint_id, hashes=w.hashes, age_s=now - w.stamp_s)
        if read.dropped:
            self._metrics.sync_dropped_slow.inc(read.dropped)
        self._metrics.sync_sent.inc(len(read.writes))
        return batch


def _observation(o: Any) -> Observation:
    """A received ``epp.sync.v1.Observation`` as the observer's value (an unknown kind from
    a newer peer reads as ENDED: the request is released, not kept waiting)."""
    kind = Kind(o.kind) if o.kind in Kind._value2member_map_ else Kind.ENDED
    return Observation(
        o.token, kind, o.age_s, o.first_bytes_age_s, o.status, o.prompt_tokens,
        o.cached_tokens, o.completion_tokens, o.response_bytes, o.generated_text,
        tuple(o.stored_ids[:_MAX_OBSERVED_STORED]),
    )


class SyncNode:
    """One replica's end of index sync: the server, the outbox, the peer followers."""

    def __init__(
        self,
        options: SyncOptions,
        producer: SharedIndex,
        datastore: Datastore,
        metrics: EppMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.replica_id = uuid.uuid4().hex[:12]
        self.metrics = metrics
        self._wakeup = _Wakeup()
        self.outbox = Outbox(options.buffer_records, options.batch_records, self._wakeup,
                             options.buffer_chunks)  # fmt: skip
        self.applier = RemoteApplier(
            producer.apply_remote, lambda eid: datastore.get(eid) is not None, clock,
            index=producer.index,
        )
        self.service = IndexSyncService(
            self.replica_id, self.outbox, self._wakeup, options, metrics, clock
        )
        self.service.index = producer.index
        self.on_observations: Callable[[Sequence[Observation]], None] | None = None
        """Peers' observations of responses (``ResponseHandoff.apply_remote``)."""
        self.peer_prefill = PeerPrefill(stale_s=_PREFILL_STALE_S, max_endpoints=_MAX_PREFILL_ENDPOINTS)
        """The other replicas' prefill in flight (``share_prefill`` connects it to the ledger)."""
        self._clock = clock
        self.peers = PeerSet(self._follow, metrics.task_failed)
        self.connected: set[str] = set()
        self.follow_failures: collections.Counter[str] = collections.Counter()
        """Per peer, subscriptions that failed or ended (then retried with backoff)."""
        self.port = -1
        self._producer = producer
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._published_seen = 0
        self._rng = random.Random()
        self._warm_progress: tuple[str, int, int] | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._stored: SharedStored | None = None
        self._unsubscribe_stored: Callable[[], None] | None = None

    async def start(self, host: str) -> int:
        """Serve on ``host:options.port``, hook the producer, start following peers."""
        server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            # followers ping every 10 s to notice a peer that vanished without a FIN
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        sync_pb2_grpc.add_IndexSyncServicer_to_server(self.service, server)
        address = f"{host}:{self.options.port}"
        tls = self.options.tls
        if tls is not None:
            self.port = server.add_secure_port(address, tls.server_credentials())
        else:
            log.warning(
                "INSECURE: index sync is PLAINTEXT and unauthenticated on %s (--sync-insecure): "
                "any process that reaches it can read the chunk hashes of every prompt routed "
                "and steer routing. Set --sync-cert/--sync-key/--sync-ca instead (docs/sync.md)",
                address,
            )
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind the sync port at {host}:{self.options.port}")
        await server.start()
        self._server = server
        self._unsubscribe = self._producer.subscribe(self.outbox.append)
        if self._stored is not None:
            self._unsubscribe_stored = self._stored.subscribe_stored(self._publish_stored)
        self.peers.update(str(p) for p in self.options.peers)
        if self.options.peer_dns is not None:
            self._tasks.append(spawn(
                "sync-dns",
                functools.partial(watch_dns, self.options.peer_dns, self.peers,
                                  self.options.own_ips, self.options.dns_interval_s),
                on_failure=self.metrics.task_failed,
            ))
        log.info("index sync: replica %s serving on %d, peers %s%s", self.replica_id, self.port,
                 sorted(self.peers.addresses) or "none",
                 f", resolving {self.options.peer_dns}" if self.options.peer_dns else "")
        return self.port

    def share_prefill(self, own: Callable[[], Mapping[str, float]]) -> Callable[[EndpointId], float]:
        """Send ``own`` (this replica's prefill in flight per endpoint) to the subscribers;
        returns the lookup of the other replicas' (the predicted-TTFT scorer's
        ``peer_prefill``)."""
        self.service.prefill_source = own
        return self.peer_prefill.tokens

    def share_stored(self, owner: SharedStored) -> None:
        """Send the stored objects ``owner`` learns to the subscribers and in snapshots;
        give it the peers' (before ``start``)."""
        self._stored = owner
        self.service.stored_source = owner.export_stored

    def _publish_stored(self, object_id: str, endpoint_id: EndpointId, stamp_s: float) -> None:
        """A stored object this replica learnt goes to the peers at once, not at the next
        flush: a client's follow-up may come through a peer as soon as the reply reached it
        (an agent's tool call and its result, milliseconds later)."""
        self.service.stored.append((object_id, endpoint_id), stamp_s)
        self._wakeup()

    def _apply_stored(self, items: Sequence[Any]) -> int:
        """Peers' stored objects (``epp.sync.v1.StoredObject``) into the owner's table."""
        owner = self._stored
        if owner is None:
            return 0
        now = self._clock()
        for item in items:
            owner.apply_remote_stored(item.id, EndpointId(item.endpoint_id),
                                      stamp_from_age(now, item.age_s))  # fmt: skip
        return len(items)

    def publish_observation(self, observation: Observation) -> None:
        """Queue an observation of a peer's request for every subscriber (stamped now on
        this node's clock; sent with its age)."""
        self.service.observations.append(observation, self._clock())

    def refresh_metrics(self) -> None:
        """Periodic (housekeeping): counters the request path keeps as plain ints."""
        published = self.outbox.published
        if published > self._published_seen:
            self.metrics.sync_published.inc(published - self._published_seen)
            self._published_seen = published
        self.metrics.sync_peers.set(self.peers.followed)
        self.metrics.sync_peers_connected.set(len(self.connected))
        self.peer_prefill.expire(self._clock())
        self.metrics.sync_peer_prefill.set(self.peer_prefill.total())

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._unsubscribe_stored is not None:
            self._unsubscribe_stored()
            self._unsubscribe_stored = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.close()
        if self._server is not None:
            await self._server.stop(0)
        self.refresh_metrics()

    # --- peers ---------------------------------------------------------------------------

    def _channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        tls = self.options.tls
        if tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)

    async def warm_start(self, ready: Callable[[], Awaitable[None]] | None = None) -> WarmStart | None:
        """Fetch the index of the first peer that answers, within ``warm_timeout_s`` and
        ``warm_max_entries``. ``ready`` is awaited first (the pool must be known: writes for
        unknown endpoints are dropped). None when no peer answered."""
        opts = self.options
        if opts.warm_timeout_s <= 0:
            return None
        started = self._clock()
        try:
            async with asyncio.timeout(opts.warm_timeout_s):
                if ready is not None:
                    await ready()
                targets = [str(p) for p in opts.peers]
                if opts.peer_dns is not None:
                    with contextlib.suppress(OSError, UnicodeError):
                        ips = await resolve_ips(opts.peer_dns.host, opts.peer_dns.port)
                        targets += [str(HostPort(ip, opts.peer_dns.port)) for ip in ips
                                    if ip not in opts.own_ips]  # fmt: skip
                empty: WarmStart | None = None
                for target in targets:
                    result = await self._fetch_snapshot(target, started)
                    if result is not None and result.entries:
                        return result
                    empty = result or empty  # a peer that is starting too knows nothing yet
                return empty
        except TimeoutError:
            log.warning("sync warm start: no complete snapshot within %.1fs (--sync-warm-"
                        "timeout-s); serving with what arrived", opts.warm_timeout_s)
            if self._warm_progress is not None:
                peer, entries, endpoints = self._warm_progress
                return WarmStart(peer, entries, endpoints, self._clock() - started, False)
        return None

    async def _fetch_snapshot(self, target: str, started: float) -> WarmStart | None:
        opts = self.options
        entries = stored = 0
        endpoints: set[str] = set()
        try:
            async with self._channel(target, [
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)
            ]) as channel:  # fmt: skip
                stub = sync_pb2_grpc.IndexSyncStub(channel)
                call = stub.Snapshot(sync_pb2.SnapshotRequest(
                    replica_id=self.replica_id, max_entries=opts.warm_max_entries
                ))  # fmt: skip
                async for part in call:
                    if part.stored:
                        stored += self._apply_stored(part.stored)
                        continue
                    entries += self.applier.restore(part)
                    endpoints.add(part.endpoint_id)
                    self._warm_progress = (target, entries, len(endpoints))
                    if entries >= opts.warm_max_entries:
                        call.cancel()
                        break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                log.warning("sync warm start: peer %s failed (%s)", target, exc.code().name)
            return None
        result = WarmStart(target, entries, len(endpoints), self._clock() - started,
                           entries < opts.warm_max_entries)  # fmt: skip
        log.info("sync warm start: %d entries for %d endpoints and %d stored objects from %s "
                 "in %.2fs", entries, len(endpoints), stored, target, result.seconds)
        return result

    # --- following one peer --------------------------------------------------------------

    def _apply_batch(self, target: str, batch: Any) -> None:
        """One ``RecordBatch`` from the peer at ``target``."""
        if batch.prefill_snapshot:
            self.peer_prefill.update(
                target, ((p.endpoint_id, p.tokens) for p in batch.prefill), self._clock()
            )  # fmt: skip
        if batch.observations and self.on_observations is not None:
            self.on_observations([_observation(o) for o in batch.observations])
        if batch.stored:
            self._apply_stored(batch.stored)
        if batch.records:
            res = self.applier.apply(batch.records)
            self.metrics.sync_applied.inc(res.applied)
            if res.ignored:
                self.metrics.sync_dropped_unknown.inc(res.ignored)

    def _follow_failed(self, target: str) -> None:
        self.follow_failures[target] += 1
        self.metrics.sync_follow_failures.inc()

    async def _follow(self, target: str) -> None:
        """Subscribe to ``target`` and apply what it sends; on any failure wait (exponential
        backoff with jitter, reset once a stream opens) and subscribe again. Until cancelled,
        or until the peer turns out to be this replica."""
        opts = self.options
        backoff = opts.backoff_initial_s
        failing = False
        channel_options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            # we own the retry loop: let a dead peer fail the call instead of queueing on it
            ("grpc.initial_reconnect_backoff_ms", 100),
        ]
        while True:
            try:
                async with self._channel(target, channel_options) as channel:
                    stub = sync_pb2_grpc.IndexSyncStub(channel)
                    call = stub.Subscribe(sync_pb2.SubscribeRequest(replica_id=self.replica_id))
                    async for batch in call:
                        if target not in self.connected:
                            self.connected.add(target)
                            self.metrics.sync_peers_connected.set(len(self.connected))
                            log.info("sync: following %s (replica %s)", target, batch.replica_id)
                            failing, backoff = False, opts.backoff_initial_s
                        self._apply_batch(target, batch)
                raise ConnectionResetError("stream ended")
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and exc.details() == _SELF:
                    log.info("sync: %s is this replica; not following it", target)
                    return
                if not failing:
                    log.warning("sync: peer %s unreachable (%s), retrying with backoff",
                                target, exc.code().name)
                failing = True
                self._follow_failed(target)
            except Exception as exc:
                if not failing:
                    log.warning("sync: peer %s failed (%s), retrying with backoff", target, exc)
                failing = True
                self._follow_failed(target)
            finally:
                self.peer_prefill.forget(target)
                if target in self.connected:
                    self.connected.discard(target)
                    self.metrics.sync_peers_connected.set(len(self.connected))
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))
            backoff = min(opts.backoff_max_s, backoff * 2)
