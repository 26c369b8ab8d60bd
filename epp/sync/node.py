"""Index sync over gRPC: serve this replica's own writes, follow every peer's.

Each replica runs an ``epp.sync.v1.IndexSync`` server on its sync port and one follower per
peer that calls ``Subscribe`` and applies the batches it receives. The producer's
``on_record`` feeds the outbox; received records go to ``apply_remote``, which never
publishes, so a write travels exactly one hop. Design and failure modes: docs/sync.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics
from epp.prefix.producer import PrefixProducer
from epp.supervise import spawn
from epp.sync.apply import RemoteApplier
from epp.sync.gen import sync_pb2, sync_pb2_grpc
from epp.sync.outbox import Outbox, OutboxRead
from epp.sync.peers import HostPort, PeerSet, watch_dns

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 << 20
_MAX_BATCH_CHUNKS = 65_536
"""Hashes per message (512 KiB of fixed64): a batch of long prompts is split, not refused."""
_SELF = "subscribed to itself"


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
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0


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

    async def Subscribe(  # the generated servicer's method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if request.replica_id == self.replica_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _SELF)
        outbox = self._outbox
        cursor = outbox.head
        self.subscribers += 1
        self._metrics.sync_subscribers.set(self.subscribers)
        log.info("sync subscriber %s connected (%s)", request.replica_id, context.peer())
        try:
            yield sync_pb2.RecordBatch(replica_id=self.replica_id)  # "connected"
            while True:
                event = self._wakeup.event
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self._opts.flush_interval_s)
                while True:
                    read = outbox.read(cursor, self._opts.batch_records, _MAX_BATCH_CHUNKS)
                    if not read.writes and not read.dropped:
                        break
                    cursor = read.next_cursor
                    yield self._encode(read)
                    if len(read.writes) < self._opts.batch_records:
                        break
        finally:
            self.subscribers -= 1
            self._metrics.sync_subscribers.set(self.subscribers)
            log.info("sync subscriber %s left", request.replica_id)

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


class SyncNode:
    """One replica's end of index sync: the server, the outbox, the peer followers."""

    def __init__(
        self,
        options: SyncOptions,
        producer: PrefixProducer,
        datastore: Datastore,
        metrics: EppMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.replica_id = uuid.uuid4().hex[:12]
        self.metrics = metrics
        self._wakeup = _Wakeup()
        self.outbox = Outbox(options.buffer_records, options.batch_records, self._wakeup)
        self.applier = RemoteApplier(
            producer.apply_remote, lambda eid: datastore.get(eid) is not None, clock
        )
        self.service = IndexSyncService(
            self.replica_id, self.outbox, self._wakeup, options, metrics, clock
        )
        self.peers = PeerSet(self._follow, metrics.task_failed)
        self.connected: set[str] = set()
        self.port = -1
        self._producer = producer
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._published_seen = 0
        self._rng = random.Random()

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
        self.port = server.add_insecure_port(f"{host}:{self.options.port}")
        if self.port == 0:
            raise OSError(f"cannot bind the sync port at {host}:{self.options.port}")
        await server.start()
        self._server = server
        self._producer.on_record = self.outbox.append
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

    def refresh_metrics(self) -> None:
        """Periodic (housekeeping): counters the request path keeps as plain ints."""
        published = self.outbox.published
        if published > self._published_seen:
            self.metrics.sync_published.inc(published - self._published_seen)
            self._published_seen = published
        self.metrics.sync_peers.set(self.peers.followed)
        self.metrics.sync_peers_connected.set(len(self.connected))

    async def stop(self) -> None:
        self._producer.on_record = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.close()
        if self._server is not None:
            await self._server.stop(0)
        self.refresh_metrics()

    # --- following one peer --------------------------------------------------------------

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
                async with grpc.aio.insecure_channel(target, options=channel_options) as channel:
                    stub = sync_pb2_grpc.IndexSyncStub(channel)
                    call = stub.Subscribe(sync_pb2.SubscribeRequest(replica_id=self.replica_id))
                    async for batch in call:
                        if target not in self.connected:
                            self.connected.add(target)
                            self.metrics.sync_peers_connected.set(len(self.connected))
                            log.info("sync: following %s (replica %s)", target, batch.replica_id)
                            failing, backoff = False, opts.backoff_initial_s
                        if batch.records:
                            res = self.applier.apply(batch.records)
                            self.metrics.sync_applied.inc(res.applied)
                            if res.ignored:
                                self.metrics.sync_dropped_unknown.inc(res.ignored)
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
            except Exception as exc:  # noqa: BLE001 - a follower must outlive any bad batch
                if not failing:
                    log.warning("sync: peer %s failed (%s), retrying with backoff", target, exc)
                failing = True
            finally:
                if target in self.connected:
                    self.connected.discard(target)
                    self.metrics.sync_peers_connected.set(len(self.connected))
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))
            backoff = min(opts.backoff_max_s, backoff * 2)
