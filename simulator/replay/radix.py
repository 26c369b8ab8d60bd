"""A character radix tree shared by several tenants, as the SGLang router keeps one.

Each node holds an edge label (a run of characters) and, per tenant (worker), when that
tenant last received a prompt through the node. Inserting a prompt for a tenant marks every
node on its path; the tenant's size is the number of characters of the nodes it is marked
on. ``match`` returns the longest prefix of a text present in the tree (for any tenant) and
the tenant that most recently used the deepest matched node.

Written from the published behaviour, not from SGLang's code. Edge comparisons work on
string slices (C speed), so a 60 KB prompt costs a few slice compares per node visited.
"""

from __future__ import annotations

from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "label", "tenants")

    def __init__(self, label: str, tenants: dict[int, float] | None = None) -> None:
        self.label = label
        self.children: dict[str, _Node] = {}
        self.tenants: dict[int, float] = tenants if tenants is not None else {}


def _common(label: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``label`` and ``text[pos:]``."""
    n = len(label)
    if text.startswith(label, pos):
        return n
    lo, hi = 0, min(n, len(text) - pos)  # invariant: lo chars match, hi+1 do not all match
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True, frozen=True)
class TreeMatch:
    matched_chars: int
    tenant: int
    """The tenant holding the match; -1 when nothing matched."""


class ApproxRadixTree:
    def __init__(self, num_tenants: int) -> None:
        self.root = _Node("")
        self.sizes = [0] * num_tenants
        """Characters each tenant is marked on."""

    def match(self, text: str) -> TreeMatch:
        node = self.root
        pos = 0
        deepest: _Node | None = None
        n = len(text)
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            k = _common(child.label, text, pos)
            pos += k
            deepest = child
            if k < len(child.label):
                break
            node = child
        if deepest is None or not deepest.tenants:
            return TreeMatch(0, -1)
        tenants = deepest.tenants
        tenant = max(tenants, key=lambda t: (tenants[t], -t))
        return TreeMatch(pos, tenant)

    def insert(self, text: str, tenant: int, now_s: float) -> None:
        node = self.root
        node.tenants[tenant] = now_s
        pos = 0
        n = len(text)
        sizes = self.sizes
        while pos < n:
            c = text[pos]
            child = node.children.get(c)
            if child is None:
                leaf = _Node(text[pos:], {tenant: now_s})
                node.children[c] = leaf
                sizes[tenant] += n - pos
                return
            label = child.label
            k = _common(label, text, pos)
            if k < len(label):
                # Split: a new inner node holds the shared part, the old child the rest.
                inner = _Node(label[:k], dict(child.tenants))
                child.label = label[k:]
                inner.children[child.label[0]] = child
                node.children[c] = inner
                child = inner
            if tenant not in child.tenants:
                sizes[tenant] += len(child.label)
            child.tenants[tenant] = now_s
            pos += len(child.label)
            node = child

    def smallest_tenant(self) -> int:
        sizes = self.sizes
        return min(range(len(sizes)), key=sizes.__getitem__)
