"""The emulator's KV-cache event publisher: vLLM's ZMQ wire format, numbering and replay.

Like vLLM's ``ZmqEventPublisher``: a PUB socket that binds when the endpoint has ``*``,
``::``, ``ipc://`` or ``inproc://`` and connects otherwise; one message per engine step that
changed the cache, ``(topic, seq, msgpack [ts, events, dp_rank])`` with ``seq`` counting from
0; an optional ROUTER socket that answers a request ``[identity, b"", start_seq]`` with every
buffered batch from ``start_seq`` on, then an end marker (seq -1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from epp.plugins.preciseprefix.events import Kind, KvEvent, encode
from epp.supervise import spawn

log = logging.getLogger(__name__)

_KINDS = {"stored": Kind.STORED, "removed": Kind.REMOVED, "cleared": Kind.CLEARED}
_END = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ipc and inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(
        self, endpoint: str, topic: str, replay_endpoint: str = "", block_size: int = 16,
        buffer_steps: int = 10_000,
    ) -> None:  # fmt: skip
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        for one in endpoint.split(","):  # several: the same events to every listener
            if binds(one):
                self.pub.bind(one)
            else:
                self.pub.connect(one)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.topic = topic
        self.block_size = block_size
        self.seq = 0
        self.pending: list[KvEvent] = []
        self.buffer: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer_steps)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint = ""
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        if self.router is not None:
            self._task = spawn("kv-events-replay", self._serve_replay)

    def cache_event(self, kind: str, hashes: Sequence[int]) -> None:
        """The cache's event sink (``PrefixCache.events``)."""
        self.pending.append(KvEvent(_KINDS[kind], list(hashes), "GPU", None, self.block_size))

    def flush(self) -> None:
        """Publish what the last engine step changed, as one batch."""
        if not self.pending:
            return
        frames = encode(self.topic, self.seq, time.time(), self.pending)
        self.pending = []
        self.buffer.append((self.seq, frames))
        self.seq += 1
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart(frames, flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, (topic, seq_b, payload) in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([ident, b"", topic, seq_b, payload])
            await self.router.send_multipart([ident, b"", b"", _END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.ctx.destroy(linger=0)
