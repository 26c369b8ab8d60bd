"""docs/config-reference.md is generated from the code: it must match what the generator
writes now, and name every plugin type and every parameter."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

from epp.plugins.registry import PLUGIN_TYPES

ROOT = Path(__file__).resolve().parents[3]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_current() -> None:
    assert (ROOT / "docs" / "config-reference.md").read_text() == generator().render(), (
        "docs/config-reference.md is stale: ./run python scripts/gen_config_reference.py"
    )


def test_every_plugin_and_parameter_is_documented() -> None:
    text = generator().render()
    gen = generator()
    for name, pt in PLUGIN_TYPES.items():
        assert f"#### `{name}`" in text
        for f in dataclasses.fields(pt.params):
            assert f"| `{gen._camel(f.name)}` |" in text
    assert "|  |\n" not in text  # every parameter has its meaning written beside it


def test_every_plugin_has_its_page_and_the_reference_links_it() -> None:
    """Each plugin type has a section on its page beside its code (the README of its folder,
    or the page beside its module), whose parameter tables are current, and the reference
    links that section."""
    gen = generator()
    reference = gen.render()
    for path, text in gen.render_pages().items():  # raises naming a type without its page
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)}: its parameter tables are stale: "
            "./run python scripts/gen_config_reference.py"
        )
    for name, pt in PLUGIN_TYPES.items():
        page = gen.plugin_page(pt).relative_to(ROOT).as_posix()
        assert f"[{page}](../{page}#{name})" in reference, name
