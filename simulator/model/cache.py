"""A prefix KV cache modelled on vLLM's automatic prefix caching.

The cache holds ``num_blocks`` KV blocks of ``block_size_tokens`` tokens each. A prompt is
cut into blocks; every *full* block is named by a chained hash (the hash of its content
seeded with the hash of the block before it), so equal hashes mean equal prefixes. The
cache itself is hash-agnostic: it works on the integers callers give it, whether they come
from :func:`text_block_hashes` (the live emulator) or from a trace's own block ids (the
replayer, through :func:`chain_block_ids` or as they are).

Block states, as in vLLM:

* **pinned**: held by at least one running request (``refcount > 0``), never evicted;
* **cached**: content kept after the last holder finished (``refcount == 0``); reusable
  by a later request with the same prefix, and evictable, least recently freed first;
* **anonymous**: held by a running request but not (yet) named by a hash: the prompt's
  last partial block and the room reserved for the output;
* **free**: empty.

Usage as vLLM reports it (``kv_cache_usage_perc``) counts pinned and anonymous blocks:
cached blocks are reusable memory, not used memory.

Two vLLM details are kept because they change hit counts: a request never hits its whole
prompt (the last prompt token is always recomputed, so at most ``(tokens - 1) //
block_size`` blocks hit), and freed blocks enter the LRU tail-first, so the end of a
sequence is evicted before its shared beginning.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import not_, or_
from typing import NewType

import xxhash

from simulator.model.tokens import CHARS_PER_TOKEN

BlockHash = NewType("BlockHash", int)

CacheEventSink = Callable[[str, Sequence[int]], None]
"""Told of every change to the set of named blocks, as vLLM's KV-cache events report it:
``("stored", hashes)`` when blocks get a name (newly computed prompt blocks at admission,
output blocks when a request ends), ``("removed", hashes)`` when cached blocks are evicted,
``("cleared", ())`` when the cache is reset."""

DEFAULT_BLOCK_SIZE_TOKENS = 16


def model_seed(model: str) -> int:
    """Seed of a model's first block hash: requests for different models (or LoRA adapters)
    never share blocks."""
    return xxhash.xxh3_64_intdigest(model.encode("utf-8"))


def text_block_hashes(text: str, block_size_tokens: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks of ``text`` (``block_size_tokens * 4`` characters each).

    ``hash[i] = xxh3_64(utf8(block i), seed=hash[i-1])`` with ``hash[-1] = seed``. A trailing
    partial block has no hash, as in vLLM.
    """
    block_chars = block_size_tokens * CHARS_PER_TOKEN
    n_full = len(text) // block_chars
    out: list[int] = []
    h = seed
    digest = xxhash.xxh3_64_intdigest
    data = text.encode("utf-8", "surrogatepass")
    if len(data) == len(text):
        # ASCII: characters and bytes coincide, slice a memoryview without copies.
        view = memoryview(data)
        for i in range(0, n_full * block_chars, block_chars):
            h = digest(view[i : i + block_chars], seed=h)
            out.append(h)
    else:
        for i in range(0, n_full * block_chars, block_chars):
            h = digest(text[i : i + block_chars].encode("utf-8", "surrogatepass"), seed=h)
            out.append(h)
    return out


def chain_block_ids(block_ids: Iterable[int], seed: int) -> list[int]:
    """Chain a trace's per-block ids (e.g. Mooncake ``hash_ids``) under ``seed``.

    Use it when one trace is replayed against several models; ids that are already
    prefix-unique within one model can also be passed to the cache as they are.
    """
    out: list[int] = []
    h = seed
    digest = xxhash.xxh3_64_intdigest
    for block_id in block_ids:
        h = digest(block_id.to_bytes(8, "little", signed=block_id < 0), seed=h)
        out.append(h)
    return out


@dataclass(slots=True, frozen=True)
class Allocation:
    """Result of a successful :meth:`PrefixCache.allocate`."""

    hit_blocks: int
    """Leading blocks found in the cache (their KV need not be computed)."""
    hit_tokens: int
    """``hit_blocks * block_size_tokens``: the ``cached_tokens`` the server reports."""
    new_blocks: int
    """Physical blocks taken from the free pool (after evicting cached blocks if needed)."""
    evicted_blocks: int


@dataclass(slots=True)
class _Held:
    hashes: list[int]
    """Hashed blocks this request pins, in sequence order."""
    anon_blocks: int


class PrefixCache:
    """Fixed-size block pool with prefix reuse and LRU eviction of unpinned blocks."""

    def __init__(self, num_blocks: int, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self._ref: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._held: dict[Hashable, _Held] = {}
        self._anon = 0
        self._free = num_blocks
        self.queries_tokens = 0
        """Prompt tokens looked up (``vllm:prefix_cache_queries_total``)."""
        self.hits_tokens = 0
        """Prompt tokens found cached (``vllm:prefix_cache_hits_total``)."""
        self.events: CacheEventSink | None = None
        """Where KV-cache events go (the emulator's publisher, the replay's event feed)."""

    def clone(self) -> PrefixCache:
        """An independent copy of the cache's state, with no event sink: a what-if run on it
        (``Engine.first_token_if``) changes nothing here and reports nothing."""
        c = PrefixCache(self.num_blocks, self.block_size_tokens)
        c._ref = dict(self._ref)
        c._cached = self._cached.copy()
        c._held = {k: _Held(list(h.hashes), h.anon_blocks) for k, h in self._held.items()}
        c._anon = self._anon
        c._free = self._free
        c.queries_tokens = self.queries_tokens
        c.hits_tokens = self.hits_tokens
        return c

    # -- read-only views -------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Pinned plus anonymous blocks: memory running requests hold."""
        return len(self._ref) + self._anon

    @property
    def cached_blocks(self) -> int:
        """Unpinned blocks kept for reuse (evictable)."""
        return len(self._cached)

    @property
    def free_blocks(self) -> int:
        return self._free

    @property
    def usage(self) -> float:
        """``used_blocks / num_blocks`` in 0..1, vLLM's ``kv_cache_usage_perc``."""
        return (len(self._ref) + self._anon) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size_tokens)

    def contains_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``block_hashes`` are in the cache (pinned or cached).

        Read-only: does not refresh the LRU nor count as a query.
        """
        ref = self._ref
        cached = self._cached
        n = 0
        for h in block_hashes:
            if h in ref or h in cached:
                n += 1
            else:
                break
        return n

    def holds(self, request_key: Hashable) -> bool:
        return request_key in self._held

    # -- mutations -------------------------------------------------------------------------

    def allocate(
        self,
        request_key: Hashable,
        block_hashes: Sequence[int],
        num_tokens: int,
        reserve_tokens: int = 0,
    ) -> Allocation | None:
        """Pin the cached prefix of a prompt and allocate blocks for the rest.

        ``block_hashes`` are the hashes of the prompt's full blocks, ``num_tokens`` its
        length in tokens, ``reserve_tokens`` room to reserve now for the output. Returns
        ``None`` and changes nothing when free plus evictable blocks do not suffice: the
        caller keeps the request waiting.
        """
        if request_key in self._held:
            raise ValueError(f"request {request_key!r} already holds blocks")
        bs = self.block_size_tokens
        total_blocks = -(-(num_tokens + reserve_tokens) // bs)
        anon = total_blocks - len(block_hashes)
        if anon < 0:
            raise ValueError(
                f"{len(block_hashes)} block hashes for {num_tokens + reserve_tokens} tokens"
            )
        ref = self._ref
        cached = self._cached
        # Membership is computed with C-level map/compress over the hashes: a 15k-token
        # prompt has ~1,000 blocks and the replayer allocates thousands of them.
        in_ref = list(map(ref.__contains__, block_hashes))
        in_cached = list(map(cached.__contains__, block_hashes))
        present = list(map(or_, in_ref, in_cached))
        # Leading hits, capped so that the last prompt token is always recomputed.
        limit = min(len(block_hashes), max(0, (num_tokens - 1) // bs))
        try:
            hit = present.index(False, 0, limit)
        except ValueError:
            hit = limit
        if len(set(block_hashes)) != len(block_hashes):
            return self._allocate_with_duplicates(request_key, block_hashes, num_tokens, anon, hit)
        # Blocks not present need a free or evicted block; blocks present but cached are
        # about to be pinned, so they cannot be evicted to make room.
        need = anon + present.count(False)
        if need > self._free + len(cached) - in_cached.count(True):
            return None
        # Pin what is present (it leaves the LRU), then evict, then take new blocks.
        for h in compress(block_hashes, in_ref):
            ref[h] += 1
        from_cached = list(compress(block_hashes, in_cached))
        for h in from_cached:
            del cached[h]
        ref.update(dict.fromkeys(from_cached, 1))
        evicted = self._evict(need)
        new = list(compress(block_hashes, map(not_, present)))
        ref.update(dict.fromkeys(new, 1))
        if self.events is not None and new:
            self.events("stored", new)
        return self._commit(request_key, block_hashes, num_tokens, anon, hit, need, evicted)

    def _allocate_with_duplicates(
        self,
        request_key: Hashable,
        block_hashes: Sequence[int],
        num_tokens: int,
        anon: int,
        hit: int,
    ) -> Allocation | None:
        """Slow path of :meth:`allocate` for hash lists that repeat a hash (one block each)."""
        ref = self._ref
        cached = self._cached
        need = anon
        evictable = len(cached)
        seen: set[int] = set()
        for h in block_hashes:
            if h in ref or h in seen:
                continue
            seen.add(h)
            if h in cached:
                evictable -= 1
            else:
                need += 1
        if need > self._free + evictable:
            return None
        new_hashes: list[int] = []
        for h in block_hashes:
            r = ref.get(h)
            if r is not None:
                ref[h] = r + 1
            elif h in cached:
                del cached[h]
                ref[h] = 1
            else:
                ref[h] = 0
                new_hashes.append(h)
        evicted = self._evict(need)
        for h in new_hashes:
            ref[h] += 1
        if self.events is not None and new_hashes:
            self.events("stored", list(dict.fromkeys(new_hashes)))
        return self._commit(request_key, block_hashes, num_tokens, anon, hit, need, evicted)

    def _evict(self, need: int) -> int:
        """Evict least recently freed cached blocks until ``need`` blocks are free."""
        evicted = need - self._free
        if evicted <= 0:
            return 0
        pop = self._cached.popitem
        if self.events is None:
            for _ in range(evicted):
                pop(False)
        else:
            self.events("removed", [pop(False)[0] for _ in range(evicted)])
        self._free = need
        return evicted

    def _commit(
        self,
        request_key: Hashable,
        block_hashes: Sequence[int],
        num_tokens: int,
        anon: int,
        hit: int,
        need: int,
        evicted: int,
    ) -> Allocation:
        bs = self.block_size_tokens
        self._free -= need
        self._anon += anon
        self._held[request_key] = _Held(list(block_hashes), anon)
        self.queries_tokens += num_tokens
        self.hits_tokens += hit * bs
        return Allocation(
            hit_blocks=hit, hit_tokens=hit * bs, new_blocks=need, evicted_blocks=evicted
        )

    def extend(self, request_key: Hashable, total_tokens: int) -> bool:
        """Grow a running request's allocation to cover ``total_tokens`` (decode growth).

        Returns ``False`` and changes nothing when the blocks are not available.
        """
        held = self._held[request_key]
        need = self.blocks_for(total_tokens) - len(held.hashes) - held.anon_blocks
        if need <= 0:
            return True
        if need > self._free + len(self._cached):
            return False
        self._evict(need)
        self._free -= need
        self._anon += need
        held.anon_blocks += need
        return True

    def free(self, request_key: Hashable, final_block_hashes: Sequence[int] | None = None) -> None:
        """Release a request's blocks; they stay cached until evicted.

        ``final_block_hashes`` are the hashes of the full blocks of prompt *plus output*:
        the blocks beyond the prompt's (the output, and the prompt's last block once the
        output filled it) become cached too, so a next turn that quotes the answer hits.
        Unknown keys are ignored (a request aborted while waiting holds nothing).
        """
        held = self._held.pop(request_key, None)
        if held is None:
            return
        ref = self._ref
        cached = self._cached
        self._anon -= held.anon_blocks
        self._free += held.anon_blocks
        n_own = len(held.hashes)
        extra: Sequence[int] = ()
        if final_block_hashes is not None and len(final_block_hashes) > n_own:
            extra = final_block_hashes[n_own : n_own + held.anon_blocks]
        # Tail first into the LRU, so the end of the sequence is evicted before its start.
        named: list[int] = []
        for h in reversed(extra):
            if h in ref:
                continue
            if h in cached:
                cached.move_to_end(h)
                continue
            cached[h] = None
            named.append(h)
            self._free -= 1
        if self.events is not None and named:
            self.events("stored", named[::-1])
        hashes = held.hashes
        if list(map(ref.__getitem__, hashes)).count(1) == len(hashes):
            # Common case: this request was the only holder of every block (so no repeats).
            for h in hashes:
                del ref[h]
            for h in reversed(hashes):
                cached[h] = None
            return
        for h in reversed(hashes):
            r = ref[h] - 1
            if r:
                ref[h] = r
            else:
                del ref[h]
                cached[h] = None

    def reset(self) -> int:
        """Drop every cached (unpinned) block, as vLLM's ``reset_prefix_cache`` does (and as
        a restarted server starts); returns how many went. Blocks running requests hold stay."""
        n = len(self._cached)
        self._cached.clear()
        self._free += n
        if self.events is not None:
            self.events("cleared", ())
        return n

    def reset_counters(self) -> None:
        self.queries_tokens = 0
        self.hits_tokens = 0
