"""Chained hashing of fixed-size character chunks.

``h_1 = H(chunk_1, seed=H(model, adapter, cache_salt))`` and ``h_i = H(chunk_i, seed=h_(i-1))``
with ``H = xxh3_64`` over the chunk's UTF-8 bytes. Equal ``h_i`` therefore implies (up to 64-bit
collisions) an equal prompt up to the end of chunk ``i`` under the same model, adapter and salt.
A trailing partial chunk is not hashed: a prompt of 100 characters with 64-character chunks
yields one hash.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)

log = logging.getLogger(__name__)

_xxh3 = xxhash.xxh3_64_intdigest

NativeChain = Callable[[str, int, int, int, int], list[int]]
"""``chain_hashes(text, block_chars, seed, start_char, max_chunks)``."""

# Inputs whose UTF-8 chunk lengths cross every XXH3 size branch (0-16, 17-128, 129-240 and
# longer bytes), ASCII and not, with seeds of both halves of the 64-bit range.
_SELF_TEST = (
    ("abcdefghijklmnop" * 40, 8, 0, 0, 0),
    ("abcdefghijklmnop" * 40, 64, 0x9E3779B97F4A7C15, 0, 0),
    ("abcdefghijklmnop" * 40, 200, 1, 0, 3),
    ("abcdefghijklmnop" * 40, 300, 0xFFFFFFFFFFFFFFFF, 0, 0),
    ("préfixe ∑ 漢字 🙂 " * 60, 32, 12345, 64, 0),
    ("préfixe ∑ 漢字 🙂 " * 60, 100, 0x8000000000000000, 0, 0),
)


def _python_chain(text: str, block: int, seed: int, start: int, max_chunks: int) -> list[int]:
    return ChunkHasher(block, max_chunks, native=False).extend_python(text, seed, start)


def checked_native(native: NativeChain | None) -> NativeChain | None:
    """``native`` if it hashes exactly as the Python loop does (the ``xxhash`` package's
    XXH3), else None with a warning. The C loop links the system's libxxhash, whose XXH3
    output changed before xxHash 0.8.0: a replica built against an older one would key
    every chunk differently from its peers and from the Python path, and share nothing."""
    if native is None:
        return None
    try:
        same = all(native(*case) == _python_chain(*case) for case in _SELF_TEST)
    except Exception:  # a broken build: its error is the reason
        log.warning("native chain hashing failed its self-test; using the Python loop",
                    exc_info=True)  # fmt: skip
        return None
    if not same:
        log.warning(
            "native chain hashing (the system's libxxhash) disagrees with the xxhash "
            "package's XXH3 (a libxxhash older than 0.8.0?); using the Python loop, slower "
            "but the same hashes as every other replica"
        )
        return None
    return native


_native: NativeChain | None
try:  # the optional C loop (setup.py); same hashes as the Python loop below
    from epp.prefix._chainhash import chain_hashes as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None
if os.environ.get("EPP_PURE_PYTHON"):
    _native = None


@lru_cache(maxsize=4096)
def chain_seed(model: str, adapter: str = "", cache_salt: str = "") -> int:
    """The seed of a request's first chunk: requests only share chunks within one seed."""
    return _xxh3(f"{model}\x00{adapter}\x00{cache_salt}".encode())


@dataclass(slots=True, frozen=True)
class ChunkHasher:
    """Cuts text into ``block_chars``-character chunks and hashes them as a chain.

    ``max_chunks`` caps how many leading chunks are hashed (0: the whole prompt). Unlike a
    fixed 16 KB window, the default looks at every chunk, so long prompts that differ late
    (multi-turn conversations, RAG over a shared preamble) still separate.
    """

    block_chars: int = 64
    max_chunks: int = 0
    native: bool = True
    """Use the native loop when it is in use (``NATIVE``); False: always the Python loop."""

    def hashes(self, text: str, seed: int) -> list[int]:
        return self.extend(text, seed, 0)

    def extend(self, text: str, seed: int, start_char: int) -> list[int]:
        """Hashes of the full chunks of ``text[start_char:]``, chained from ``seed``.

        ``start_char`` must be a multiple of ``block_chars``; with ``seed`` the last hash of the
        chunks before it, the result continues that chain (used to extend a prompt's chain
        with the generated reply without hashing the prompt again).
        """
        if self.native and _native is not None:
            return _native(text, self.block_chars, seed, start_char, self.max_chunks)
        return self.extend_python(text, seed, start_char)

    def extend_python(self, text: str, seed: int, start_char: int) -> list[int]:
        """The reference loop (also the fallback when the native module is not built)."""
        size = self.block_chars
        n = (len(text) - start_char) // size
        if self.max_chunks:
            n = min(n, max(0, self.max_chunks - start_char // size))
        if n <= 0:
            return []
        out: list[int] = [0] * n
        h = seed
        f = _xxh3
        if text.isascii():
            data = text.encode("ascii")
            off = start_char
            for i in range(n):
                h = out[i] = f(data[off : off + size], h)
                off += size
        else:
            off = start_char
            for i in range(n):
                h = out[i] = f(text[off : off + size].encode(), h)
                off += size
        return out


_native = checked_native(_native)
NATIVE = _native is not None
"""Whether the native hashing loop is in use: built, not turned off (``EPP_PURE_PYTHON=1``)
and equal to the Python loop on the import-time self-test."""
