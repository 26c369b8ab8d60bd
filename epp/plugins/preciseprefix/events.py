"""Decoding of the KV-cache events vLLM (and SGLang) publish over ZMQ. Pure: bytes in,
values out; the sockets live in ``epp.plugins.preciseprefix.subscriber``.

Wire format (vLLM 0.32 ``vllm/distributed/kv_events.py``): one message = three frames,
``topic``, ``seq`` (8-byte big-endian, +1 per message per publisher) and a msgpack array
``[ts, [event, ...], data_parallel_rank]``. An event is a map tagged by ``type``:

* ``BlockStored`` {``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``, ``extra_keys``, ``group_idx``, ...}
* ``BlockRemoved`` {``block_hashes``, ``medium``, ``group_idx``}
* ``AllBlocksCleared`` {}

Fields equal to their default may be absent. Older servers encode an event as an array
``[type, field, ...]`` in declaration order; both are read. Block hashes are 64-bit integers
(the last 8 bytes of the digest) or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, the raw
digest bytes, which are reduced the same way.

Every size is bounded before anything is allocated for it: a hostile or broken publisher
gets :class:`BadMessage`, never a stall.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_MESSAGE_BYTES = 16 << 20
"""A batch larger than this is refused unread (vLLM's are a few KB to a few hundred KB)."""
MAX_EVENTS_PER_BATCH = 65_536
MAX_KEYS_PER_EVENT = 1 << 20


class BadMessage(ValueError):
    """A message that is not a KV-event batch (counted and dropped by the caller)."""


class Kind(enum.Enum):
    STORED = "BlockStored"
    REMOVED = "BlockRemoved"
    CLEARED = "AllBlocksCleared"


@dataclass(slots=True, frozen=True)
class KvEvent:
    kind: Kind
    keys: Sequence[int] = ()
    """Block keys (64-bit), in sequence order for ``STORED``."""
    medium: str | None = None
    parent: int | None = None
    block_size: int = 0


@dataclass(slots=True, frozen=True)
class EventBatch:
    topic: str
    seq: int
    ts: float
    events: list[KvEvent]
    dp_rank: int = 0
    unknown: int = 0
    """Events of a type epp does not use (skipped)."""


_POSITIONAL = {
    Kind.STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    Kind.REMOVED: ("block_hashes", "medium"),
    Kind.CLEARED: (),
}
_KINDS = {k.value: k for k in Kind}


def _key(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & 0xFFFF_FFFF_FFFF_FFFF
    if isinstance(value, bytes | bytearray) and value:
        return int.from_bytes(value[-8:], "big")
    raise BadMessage(f"block hash of type {type(value).__name__}")


def _keys(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadMessage("block_hashes is not a list")
    if len(value) > MAX_KEYS_PER_EVENT:
        raise BadMessage(f"{len(value)} block hashes in one event")
    return [_key(v) for v in value]


def _fields(raw: Any) -> tuple[Kind | None, dict[str, Any]]:
    if isinstance(raw, dict):
        kind = _KINDS.get(raw.get("type"))  # type: ignore[arg-type]
        return kind, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = _KINDS.get(raw[0])
        if kind is None:
            return None, {}
        return kind, dict(zip(_POSITIONAL[kind], raw[1:], strict=False))
    raise BadMessage("an event is neither a map nor a tagged array")


def decode_event(raw: Any) -> KvEvent | None:
    """One event, or None for a type epp does not use."""
    kind, f = _fields(raw)
    if kind is None:
        return None
    if kind is Kind.CLEARED:
        return KvEvent(kind)
    medium = f.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise BadMessage("medium is not a string")
    keys = _keys(f.get("block_hashes"))
    if kind is Kind.REMOVED:
        return KvEvent(kind, keys, medium)
    parent_raw = f.get("parent_block_hash")
    parent = None if parent_raw is None else _key(parent_raw)
    block_size = f.get("block_size", 0)
    if not isinstance(block_size, int) or block_size < 0:
        raise BadMessage("block_size is not a non-negative integer")
    return KvEvent(kind, keys, medium, parent, block_size)


def decode(frames: Sequence[bytes]) -> EventBatch:
    """A ZMQ message (topic, seq, payload) as an :class:`EventBatch`."""
    if len(frames) != 3:
        raise BadMessage(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic_b, seq_b, payload = frames
    if len(seq_b) != 8:
        raise BadMessage(f"sequence frame of {len(seq_b)} bytes (expected 8)")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"payload of {len(payload)} bytes (limit {MAX_MESSAGE_BYTES})")
    try:
        topic = bytes(topic_b).decode("utf-8")
    except UnicodeDecodeError:
        raise BadMessage("topic is not UTF-8") from None
    seq = int.from_bytes(seq_b, "big", signed=True)
    try:
        doc = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, use_list=True,
            max_array_len=MAX_KEYS_PER_EVENT, max_map_len=1024, max_str_len=1 << 20,
            max_bin_len=1 << 20, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadMessage(f"payload is not msgpack: {type(exc).__name__}") from None
    if not isinstance(doc, list) or len(doc) < 2:
        raise BadMessage("payload is not [ts, events, dp_rank]")
    ts, raw_events = doc[0], doc[1]
    rank = doc[2] if len(doc) > 2 and isinstance(doc[2], int) else 0
    if not isinstance(ts, int | float) or not isinstance(raw_events, list):
        raise BadMessage("payload is not [ts, events, dp_rank]")
    if len(raw_events) > MAX_EVENTS_PER_BATCH:
        raise BadMessage(f"{len(raw_events)} events in one batch")
    events: list[KvEvent] = []
    unknown = 0
    for raw in raw_events:
        ev = decode_event(raw)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return EventBatch(topic, seq, float(ts), events, rank, unknown)


def encode(topic: str, seq: int, ts: float, events: Sequence[KvEvent], dp_rank: int = 0) -> list[bytes]:
    """The three frames vLLM would send for ``events`` (the emulator publishes with this)."""
    out: list[dict[str, Any]] = []
    for ev in events:
        if ev.kind is Kind.CLEARED:
            out.append({"type": ev.kind.value})
        elif ev.kind is Kind.REMOVED:
            out.append({"type": ev.kind.value, "block_hashes": list(ev.keys), "medium": ev.medium})
        else:
            out.append({
                "type": ev.kind.value, "block_hashes": list(ev.keys),
                "parent_block_hash": ev.parent, "token_ids": [], "block_size": ev.block_size,
                "lora_id": None, "medium": ev.medium,
            })  # fmt: skip
    payload = msgpack.packb([ts, out, dp_rank], use_bin_type=True)
    return [topic.encode("utf-8"), seq.to_bytes(8, "big", signed=True), payload]
