"""The package structure docs/architecture.md describes: no import cycle between epp's
packages, and the simulator drives the request lifecycle only through the Director."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_imports() -> dict[str, set[str]]:
    """epp package -> the epp packages its modules import (epp/<pkg>/... or epp/<module>.py)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in (ROOT / "epp").rglob("*.py"):
        rel = path.relative_to(ROOT / "epp")
        if rel.parts[0] == "sync" and "gen" in rel.parts:
            continue
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("epp."):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("epp.")]
            for name in names:
                dst = name.split(".")[1]
                if dst != src:
                    edges[src].add(dst)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_epp_packages() -> None:
    edges = package_imports()
    assert "scheduling" in edges and "config" in edges  # the walk saw the packages
    assert cycles(edges) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_simulator_reaches_the_request_lifecycle_only_through_the_director() -> None:
    lifecycle = {"request_started", "request_finished"}
    offenders = []
    for path in (ROOT / "simulator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in lifecycle:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
