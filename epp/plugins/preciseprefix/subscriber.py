"""Subscribing to the model servers' KV-cache events over ZMQ, for the precise producer.

Two modes (``eventsMode`` of the ``precise-prefix-cache-producer``):

* ``connect`` (default): one SUB socket per endpoint, connected to
  ``tcp://<endpoint ip>:<eventsPort + rank>`` when the endpoint joins the pool and closed
  when it leaves. Servers bind their PUB socket (``"endpoint": "tcp://*:5557"``), so any
  number of epp replicas can listen to every server. A data-parallel rank publishes on the
  port offset by its rank (vLLM does this), and its endpoint carries that rank (its index
  among the pool's ``targetPorts``, or a static endpoint's ``rank``): each rank is its own
  endpoint, with its own socket, index entries and failures.
* ``bind``: one SUB socket bound at ``eventsEndpoint``; servers connect to it and are told
  apart by their topic (``kv@<ip>:<port>@<model>``).

Each batch is decoded (``epp.plugins.preciseprefix.events``, bounded) and applied to the producer on the
event loop; the loop yields between batches, so an event storm delays events, never
requests. ZMQ's receive high-water mark (``queueBatches``) bounds what waits: a subscriber
that falls behind loses batches, which the producer sees as a sequence gap. A gap is
repaired through the server's replay socket when ``replayPort`` is set (a DEALER request
for every batch from the first missing one, bounded by ``replayTimeoutSeconds``); otherwise
the endpoint resyncs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from epp.framework.endpoint import EndpointId
from epp.plugins.preciseprefix.events import MAX_MESSAGE_BYTES, BadMessage, EventBatch, decode
from epp.plugins.preciseprefix.params import PreciseIndexConfig
from epp.supervise import spawn

log = logging.getLogger(__name__)

_END_SEQ = -1
_MAX_REPLAY_BATCHES = 20_000


def _host(endpoint_id: EndpointId) -> str:
    host = endpoint_id.rpartition(":")[0]
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class EventSink(Protocol):
    """What the subscriber feeds (``PrecisePrefixProducer``): the batches it reads, the
    losses it counts, and the endpoints' ranks and topics it asks about."""

    @property
    def params(self) -> PreciseIndexConfig: ...
    def rank_of(self, endpoint_id: EndpointId) -> int: ...
    def endpoint_for_topic(self, topic: str) -> EndpointId | None: ...
    def drop(self, endpoint_id: EndpointId, reason: str, count: int = 1) -> None: ...
    def apply(self, endpoint_id: EndpointId, batch: EventBatch, now_s: float) -> int | None: ...
    def apply_replayed(
        self, endpoint_id: EndpointId, held: EventBatch, replayed: Sequence[EventBatch] | None,
        now_s: float,
    ) -> None: ...  # fmt: skip


@dataclass(slots=True)
class KvEventSubscriber:
    producer: EventSink
    clock: Callable[[], float] = time.monotonic
    ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    _readers: dict[EndpointId, asyncio.Task[None]] = field(default_factory=dict)
    _stopped: bool = False
    bound_endpoint: str = ""
    """Bind mode: the address actually bound (``tcp://*:0`` resolves to a port)."""
    on_failure: Callable[[str], None] | None = None
    """Told of each reader failure (``epp_background_task_failures_total``)."""

    @property
    def params(self) -> PreciseIndexConfig:
        return self.producer.params

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, self.params.queue_batches)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        return sock

    # --- connect mode: one reader per endpoint -----------------------------------------

    def endpoint_changed(self, endpoint_id: EndpointId, joined: bool) -> None:
        """The producer's endpoint listener: start or stop that endpoint's reader."""
        if self._stopped or self.params.events_mode != "connect":
            return
        task = self._readers.pop(endpoint_id, None)
        if task is not None:
            task.cancel()
        if joined:
            # supervised: a reader that raises is logged, counted and restarted with backoff
            self._readers[endpoint_id] = spawn(
                "kv-events-reader", functools.partial(self._read_endpoint, endpoint_id),
                name=f"kv-events {endpoint_id}", on_failure=self._on_failure,
            )  # fmt: skip

    def _on_failure(self, kind: str) -> None:
        if self.on_failure is not None:
            self.on_failure(kind)

    async def _read_endpoint(self, endpoint_id: EndpointId) -> None:
        port = self.params.events_port + self.producer.rank_of(endpoint_id)
        address = f"tcp://{_host(endpoint_id)}:{port}"
        sock = self._socket()
        try:
            sock.connect(address)
            log.debug("kv events: subscribed to %s for %s", address, endpoint_id)
            while True:
                frames = await sock.recv_multipart(copy=True)
                await self._handle(endpoint_id, frames)
        except Exception:
            self.producer.drop(endpoint_id, "reader-error")
            raise
        finally:
            sock.close(linger=0)

    # --- bind mode: one socket, endpoints by topic -------------------------------------

    async def run_bound(self) -> None:
        sock = self._socket()
        try:
            sock.bind(self.params.events_endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            log.info("kv events: listening on %s", self.bound_endpoint)
            while True:
                frames = await sock.recv_multipart(copy=True)
                topic = frames[0].decode("utf-8", "replace") if frames else ""
                endpoint_id = self.producer.endpoint_for_topic(topic)
                if endpoint_id is None:
                    self.producer.drop(EndpointId("unknown"), "unknown-topic")
                    continue
                await self._handle(endpoint_id, frames)
        finally:
            sock.close(linger=0)

    # --- both -----------------------------------------------------------------------

    async def _handle(self, endpoint_id: EndpointId, frames: list[bytes]) -> None:
        try:
            batch = decode(frames)
        except BadMessage as exc:
            self.producer.drop(endpoint_id, "bad-message")
            log.debug("kv events from %s: %s", endpoint_id, exc)
            return
        missing = self.producer.apply(endpoint_id, batch, self.clock())
        if missing is not None:
            replayed = await self._replay(endpoint_id, missing)
            self.producer.apply_replayed(endpoint_id, batch, replayed, self.clock())
        await asyncio.sleep(0)  # let requests in between batches

    async def _replay(self, endpoint_id: EndpointId, start_seq: int) -> list[EventBatch] | None:
        """Every batch from ``start_seq`` on, from the server's replay socket, or None."""
        port = self.params.replay_port + self.producer.rank_of(endpoint_id)
        address = f"tcp://{_host(endpoint_id)}:{port}"
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
        out: list[EventBatch] = []
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            async with asyncio.timeout(self.params.replay_timeout_seconds):
                while len(out) < _MAX_REPLAY_BATCHES:
                    frames = await sock.recv_multipart(copy=True)
                    if len(frames) != 4:
                        return None
                    _, topic, seq_b, payload = frames
                    if int.from_bytes(seq_b, "big", signed=True) == _END_SEQ:
                        return out
                    try:
                        out.append(decode([topic, seq_b, payload]))
                    except BadMessage:
                        return None
            return out
        except (TimeoutError, zmq.ZMQError):
            log.info("kv events: replay from %s (seq %d on) failed", address, start_seq)
            return None
        finally:
            sock.close(linger=0)

    async def run(self) -> None:
        """Bind mode's socket loop; in connect mode, readers come and go with endpoints and
        this just waits (so both modes are one supervised task)."""
        if self.params.events_mode == "bind":
            await self.run_bound()
        else:
            await asyncio.Event().wait()

    async def close(self) -> None:
        self._stopped = True
        tasks = list(self._readers.values())
        self._readers.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.ctx.destroy(linger=0)
