"""The package structure docs/architecture.md describes: no import cycle between epp's
packages nor between its modules, layers that point one way (sync does not stand on the
Envoy transport, the config loader not on the scheduler), and the simulator drives the
request lifecycle only through the Director."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

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


def module_imports() -> dict[str, set[str]]:
    """epp module -> the epp modules it imports, every import counted (at the top, inside a
    function, under ``TYPE_CHECKING``): ``from epp.a import b`` names the module ``epp.a.b``
    when there is one, else ``epp.a``; a package is its ``__init__``."""
    modules: dict[str, Path] = {}
    for path in (ROOT / "epp").rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[:3] == ("epp", "sync", "gen"):
            continue
        parts = rel.with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for src, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{path}: a relative import"
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = name
                while dst and dst not in modules:
                    dst = dst.rpartition(".")[0]
                if dst and dst != src:
                    edges[src].add(dst)
    return edges


def test_no_import_cycle_between_epp_modules() -> None:
    """Inside a package too, modules import one way (a plugin's producer uses its subscriber
    and its metrics, which name what they need of it by protocol)."""
    edges = module_imports()
    assert "epp.plugins.preciseprefix.producer" in edges  # the walk saw the modules
    assert cycles(edges) == []


LAYERS_APART = [
    ("sync", "extproc"),  # replica sync carries observations; it does not stand on Envoy's transport
    ("config", "scheduling"),  # the loader's sections are value types (epp.framework), not the scheduler's
]


@pytest.mark.parametrize(("src", "dst"), LAYERS_APART)
def test_a_lower_layer_imports_no_upper_one(src: str, dst: str) -> None:
    edges = package_imports()
    assert src in edges  # the walk saw the package
    assert dst not in edges[src], f"epp/{src} imports epp/{dst}"


def test_simulator_reaches_the_request_lifecycle_only_through_the_director() -> None:
    lifecycle = {"request_started", "request_finished"}
    offenders = []
    for path in (ROOT / "simulator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in lifecycle:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_the_ground_floor_imports_no_other_epp_package() -> None:
    """epp.framework (the value types and the plugin interfaces) stands on nothing of epp:
    the datastore, the scheduler and every plugin stand on it."""
    edges = package_imports()
    assert edges.get("framework", set()) == set()
    assert "framework" in edges["scheduling"] and "framework" in edges["datastore"]


COMPOSITION_ROOTS = {
    "epp/plugins/registry.py",  # the one place plugin types are named
    "epp/wiring.py",  # builds the scheduler from the config and the registry
    "simulator/replay/policies.py",  # the replay's policies: builds schedulers as wiring does
}
WIRE_FORMATS = {"epp.plugins.preciseprefix.events"}
"""vLLM's KV-event wire format: the emulator publishes it and the replayer feeds it."""


def test_no_module_imports_a_plugin_outside_the_registry_and_the_composition_roots() -> None:
    offenders = []
    for top in ("epp", "simulator"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("epp/plugins/") or rel in COMPOSITION_ROOTS:
                continue
            for name in _imports(path):
                if name == "epp.plugins.registry" or name in WIRE_FORMATS:
                    continue
                if name.startswith("epp.plugins"):
                    offenders.append(f"{rel}: {name}")
    assert offenders == []


def test_a_plugin_imports_no_other_plugin() -> None:
    """Each plugin is self-contained: it may share a module of its own kind's helpers
    (pickers' parameters, the LoRA tiers of the scorers), never another plugin's package."""
    offenders = []
    for path in (ROOT / "epp" / "plugins").rglob("*.py"):
        rel = path.relative_to(ROOT / "epp" / "plugins")
        if rel.name == "registry.py":
            continue
        own = rel.parts[0] if len(rel.parts) > 1 else None
        for name in _imports(path):
            parts = name.split(".")
            if parts[:2] != ["epp", "plugins"] or len(parts) < 3:
                continue
            if (ROOT / "epp" / "plugins" / parts[2]).is_dir() and parts[2] != own:
                offenders.append(f"{rel}: {name}")
    assert offenders == []


def _code_strings(path: Path) -> set[str]:
    """String constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    }


def test_the_runner_and_the_loader_name_no_plugin() -> None:
    """The server starts plugins through the Lifecycle hook and finds the shared index by
    protocol; the loader adds default producers by the data they provide (the registry's
    DEFAULT_PRODUCERS): neither names a plugin type or class."""
    from epp.plugins.registry import PLUGIN_TYPES

    names = set(PLUGIN_TYPES)
    classes = {pt.factory.__qualname__.split(".")[0] for pt in PLUGIN_TYPES.values()}
    for rel in ("epp/server/runner.py", "epp/config/loader.py"):
        path = ROOT / rel
        assert not _code_strings(path) & names, rel
        identifiers = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        assert not identifiers & classes, rel
        assert not [n for n in _imports(path)
                    if n.startswith("epp.plugins") and n != "epp.plugins.registry"], rel
