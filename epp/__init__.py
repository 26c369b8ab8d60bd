"""epp: a prefix-cache-aware endpoint picker for LLM inference behind Envoy (ext_proc)."""

from __future__ import annotations


def package_version() -> str:
    """The installed ``epp`` distribution's version, from its package metadata (the one place
    it is written is ``pyproject.toml``); "unknown" in a tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("epp")
    except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return "unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":  # read on demand: importing epp stays free of the lookup
        return package_version()
    raise AttributeError(f"module 'epp' has no attribute {name!r}")
