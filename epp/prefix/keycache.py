"""A cache of the block keys of prompts already keyed, so that a prompt extending a known
one (an agent's next turn, a sub-agent under its parent's context) is tokenized and hashed
only past the part already known.

A rendered prompt is cut into pieces before the special tokens its chat template writes
(:meth:`ModelTokenizer.segments`: the tokenizer encodes such pieces independently, so the
pieces' ids joined are the whole prompt's ids). The cache is a tree of pieces: a node is one
piece after its parent's, holding the event keys of the blocks that end inside it, the
digest of the last full block so far and the few tokens after it. Keying a prompt walks the
tree along its pieces, then encodes only the pieces past the deepest node found (in one
batch, which the tokenizers library runs in parallel outside the GIL) and hashes their
blocks on from that node's digest.

Bounds: at most ``max_tokens`` tokens of prompt are held (a node counts its tokens plus
:data:`NODE_COST`), least recently used leaves first; memory is about 8 bytes per block
plus ~200 bytes per node. Pieces are known by their length and Python's string hash (64
bits; a collision would mis-key a prompt, which only misplaces a routing score). One in
``verify_every`` keyings that reused pieces is checked against the whole prompt encoded and
hashed afresh: a tokenizer that does not cut as the probe said is then keyed whole, logged
and counted.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.prefix.blockhash import BlockKeys, VllmBlockHasher
from epp.prefix.tokenize import ModelTokenizer

log = logging.getLogger(__name__)

NODE_COST = 64
"""Tokens a node counts for beyond its own, for its fixed overhead."""


@dataclass(slots=True, eq=False)
class _Node:
    key: tuple[Any, ...]
    """``(parent's serial, piece length, piece hash)``, or the root's context."""
    serial: int
    parent: _Node | None
    tokens: int
    """Tokens of the prompt up to the end of this piece."""
    blocks: int
    """Full blocks up to the end of this piece."""
    keys: array[int]
    """Event keys of the blocks that end inside this piece."""
    digest: bytes
    """Digest of the last full block up to here (the chain's start when none)."""
    carry: tuple[int, ...]
    """Tokens after the last full block."""
    cost: int
    children: int = 0


@dataclass(slots=True)
class _Piece:
    """A piece just tokenized: its text, and what its node will hold."""

    text: str
    tokens: int
    blocks: int
    keys: array[int]
    digest: bytes
    carry: tuple[int, ...]


@dataclass(slots=True)
class KeyCacheStats:
    keyed: int = 0
    """Prompts keyed through the cache."""
    tokens_reused: int = 0
    """Prompt tokens whose keys came from the cache."""
    tokens_encoded: int = 0
    """Prompt tokens tokenized and hashed."""
    verified: int = 0
    mismatches: int = 0
    """Verifications that disagreed (that tokenizer is then keyed whole)."""
    evicted_nodes: int = 0
    disabled: set[str] = field(default_factory=set)


class PrefixKeyCache:
    """Block keys of prompts by their pieces (see the module docstring). Thread-safe:
    keying runs in worker threads; tokenizing and hashing happen outside the lock."""

    def __init__(self, hasher: VllmBlockHasher, max_tokens: int = 16_000_000,
                 verify_every: int = 1000) -> None:  # fmt: skip
        self.hasher = hasher
        self.max_tokens = max_tokens
        self.verify_every = verify_every
        self.stats = KeyCacheStats()
        self.size = 0
        """Tokens held, by the nodes' cost."""
        self._nodes: OrderedDict[tuple[Any, ...], _Node] = OrderedDict()
        """Every node, least recently used first (a parent is always used after its
        children, so the first is a leaf)."""
        self._lock = threading.Lock()
        self._serial = 0
        self._since_verify = 0

    @property
    def nodes(self) -> int:
        return len(self._nodes)

    def keys(self, tok: ModelTokenizer, text: str, add_special_tokens: bool, *,
             cache_salt: str = "", lora: tuple[str, str] | None = None,
             max_blocks: int = 0) -> BlockKeys:  # fmt: skip
        """The block keys of ``text`` tokenized by ``tok`` (as :meth:`ModelTokenizer.encode`
        with ``add_special_tokens``), at most ``max_blocks`` of them when > 0."""
        pieces = tok.segments(text, add_special_tokens)
        root_key = ("root", id(tok), add_special_tokens, cache_salt, lora)
        bs = self.hasher.block_size
        with self._lock:
            node = self._nodes.get(root_key)
            if node is None:
                node = self._add(root_key, None, 0, 0, array("Q"), self.hasher.none_hash, (), 0)
            path = [node]
            for text_piece in pieces:
                child = self._nodes.get((node.serial, len(text_piece), hash(text_piece)))
                if child is None:
                    break
                node = child
                path.append(node)
            found = len(path) - 1
            self._touch(path)
        reused = node.tokens
        new = self._encode(tok, pieces[found:], found == 0, add_special_tokens, node,
                           cache_salt, lora, max_blocks)  # fmt: skip
        tokens = new[-1].tokens if new else node.tokens
        with self._lock:
            parent: _Node | None = node if self._nodes.get(node.key) is node else None
            chain = list(path) if parent is not None else []
            for done in new:
                if parent is None:
                    break  # the tree changed under us: the keys are still right, not kept
                key = (parent.serial, len(done.text), hash(done.text))
                child = self._nodes.get(key)
                if child is None:
                    child = self._add(key, parent, done.tokens, done.blocks, done.keys,
                                      done.digest, done.carry,
                                      done.tokens - parent.tokens + NODE_COST)  # fmt: skip
                chain.append(child)
                parent = child
            if chain:
                self._touch(chain)
            self.stats.keyed += 1
            self.stats.tokens_reused += reused
            self.stats.tokens_encoded += tokens - reused
            self._evict()
        out = array("Q")
        for n in path[1:]:
            out.extend(n.keys)
        for done in new:
            out.extend(done.keys)
        result = out.tolist()
        if max_blocks:
            result = result[:max_blocks]
        if len(pieces) > 1 and self.verify_every > 0 and not max_blocks:
            self._since_verify += 1
            if self._since_verify >= self.verify_every:
                self._since_verify = 0
                return self._verify(tok, text, add_special_tokens, result, tokens,
                                    cache_salt=cache_salt, lora=lora)  # fmt: skip
        # cut short by max_blocks, ``tokens`` counts the pieces keyed, not the whole prompt
        return BlockKeys(result, bs, tokens)

    def _verify(self, tok: ModelTokenizer, text: str, add_special_tokens: bool,
                result: list[int], total: int, *, cache_salt: str,
                lora: tuple[str, str] | None) -> BlockKeys:  # fmt: skip
        ids = tok.encode(text, add_special_tokens)
        whole = self.hasher.keys(ids, cache_salt=cache_salt, lora=lora)
        with self._lock:
            self.stats.verified += 1
            if whole.keys != result or whole.num_tokens != total:
                self.stats.mismatches += 1
                self.stats.disabled.add(str(tok.directory))
                tok.disable_segments()
                self._nodes.clear()  # rare: start afresh rather than pick that tokenizer's out
                self.size = 0
                log.warning("precise prefix: %s does not tokenize piecewise like whole on a "
                            "live prompt; its prompts are keyed whole from now on", tok.directory)  # fmt: skip
        return whole

    def _encode(self, tok: ModelTokenizer, pieces: Sequence[str], first: bool,
                add_special_tokens: bool, node: _Node, cache_salt: str,
                lora: tuple[str, str] | None, max_blocks: int) -> list[_Piece]:  # fmt: skip
        """Tokenize ``pieces`` (in one batch) and hash their blocks on from ``node``."""
        out: list[_Piece] = []
        tokens, blocks, digest, carry = node.tokens, node.blocks, node.digest, node.carry
        if not pieces or (max_blocks and blocks >= max_blocks):
            return out
        bs = self.hasher.block_size
        for piece, ids in zip(pieces, tok.encode_pieces(pieces, first, add_special_tokens), strict=True):
            run = carry + tuple(ids)
            keys, digest = self.hasher.chain(digest, run, blocks, cache_salt=cache_salt, lora=lora)
            carry = run[len(keys) * bs :]
            tokens += len(ids)
            blocks += len(keys)
            out.append(_Piece(piece, tokens, blocks, array("Q", keys), digest, carry))
            if max_blocks and blocks >= max_blocks:
                break
        return out

    # --- the tree (under the lock) -----------------------------------------------------

    def _add(self, key: tuple[Any, ...], parent: _Node | None, tokens: int, blocks: int,
             keys: array[int], digest: bytes, carry: tuple[int, ...], cost: int) -> _Node:  # fmt: skip
        self._serial += 1
        node = _Node(key, self._serial, parent, tokens, blocks, keys, digest, carry, cost)
        self._nodes[key] = node
        self.size += cost
        if parent is not None:
            parent.children += 1
        return node

    def _touch(self, path: Sequence[_Node]) -> None:
        nodes = self._nodes
        for n in reversed(path):  # leaf first: a parent is always more recent than its children
            if nodes.get(n.key) is n:
                nodes.move_to_end(n.key)

    def _evict(self) -> None:
        nodes = self._nodes
        while self.size > self.max_tokens and nodes:
            key, node = next(iter(nodes.items()))
            self._drop_subtree(key)
            del node

    def _drop_subtree(self, key: tuple[Any, ...]) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        if node.children:  # not expected (parents are used after children); scan for them
            for k in [k for k, n in self._nodes.items() if n.parent is node]:
                self._drop_subtree(k)
        del self._nodes[key]
        self.size -= node.cost
        self.stats.evicted_nodes += 1
        if node.parent is not None:
            node.parent.children -= 1
