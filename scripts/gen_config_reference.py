"""Write docs/config-reference.md from the schema: every top-level section and every plugin
type of the registry, with each parameter's YAML name, type, default and the comment written
beside the field in the code, and a link to the plugin's own page. Each plugin's page (the
README of its folder, or the page beside its module: ``plugin_page``) is written by hand
but for its parameter tables, which this script rewrites between ``<!-- parameters: TYPE
-->`` and ``<!-- end parameters -->``. tests/unit/config/test_config_reference.py fails when
either is stale. Run: ./run python scripts/gen_config_reference.py"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "config-reference.md"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a class (attribute docstrings),
    its base classes' included."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if base is not object:
            docs.update(_own_field_docs(base))
    docs.update(_own_field_docs(cls))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for stmt, nxt in zip(body, [*body[1:], None], strict=True):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def dataclass_table(cls: type) -> list[str]:
    fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]  # type: ignore[arg-type]
    if not fields:
        return ["No parameters.", ""]
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| parameter | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields:
        doc = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{_camel(f.name)}` | {_type_name(hints[f.name])} | {_default(f)} | {doc} |")
    return [*rows, ""]


def pydantic_table(model: Any) -> list[str]:
    rows = ["| field | default |", "| --- | --- |"]
    for name, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append(f"| `{_camel(name)}` | `{default!r}` |")
    return [*rows, ""]


def plugin_page(pt: Any) -> Path:
    """A plugin type's page: ``README.md`` in its package's folder (``epp/plugins/NAME/``), or
    for a plugin that is a module (``epp/plugins/NAME.py``, which may hold several types of a
    kind) the page beside it, ``epp/plugins/NAME.md``. Each type is a ``## `TYPE` `` section."""
    parts = pt.factory.__module__.split(".")
    assert parts[:2] == ["epp", "plugins"] and len(parts) >= 3, pt.factory.__module__
    if len(parts) > 3:
        return ROOT / "epp" / "plugins" / parts[2] / "README.md"
    return ROOT / "epp" / "plugins" / f"{parts[2]}.md"


_PARAMS_BLOCK = re.compile(r"(<!-- parameters: (?P<name>[a-z0-9-]+) -->\n).*?(<!-- end parameters -->)", re.S)


def render_pages() -> dict[Path, str]:
    """Every plugin page with its parameter tables regenerated. Raises ValueError naming a
    plugin type whose page, section or parameter block is missing."""
    from epp.plugins.registry import PLUGIN_TYPES

    pages: dict[Path, str] = {}
    for name, pt in PLUGIN_TYPES.items():
        path = plugin_page(pt)
        if path not in pages:
            if not path.is_file():
                raise ValueError(f"{name}: no page {path.relative_to(ROOT)}")
            pages[path] = path.read_text(encoding="utf-8")
        text = pages[path]
        if f"## `{name}`" not in text or f"<!-- parameters: {name} -->" not in text:
            raise ValueError(f"{path.relative_to(ROOT)}: no '## `{name}`' section with a "
                             f"'<!-- parameters: {name} -->' block")  # fmt: skip

    def table(match: re.Match[str]) -> str:
        pt = PLUGIN_TYPES[match["name"]]
        rows = dataclass_table(pt.params)
        return match.group(1) + "\n".join(rows) + match.group(3)

    return {path: _PARAMS_BLOCK.sub(table, text) for path, text in pages.items()}


def render() -> str:
    from epp.datastore.scraper import ScrapingConfig
    from epp.flowcontrol.controller import FlowControlConfig
    from epp.framework.saturation import SaturationConfig
    from epp.framework.shortlist import ShortlistConfig
    from epp.plugins.registry import DEFAULT_PRODUCERS, PLUGIN_TYPES
    from epp.request import settings as request_control
    from epp.schema import SIZE_UNITS

    out = [
        "# Configuration reference",
        "",
        "Generated from the code by `./run python scripts/gen_config_reference.py` (a test",
        "fails when it is stale); the guide is [configuration.md](configuration.md). Keys are",
        "camelCase (snake_case is accepted); values are checked strictly (no coercion, no",
        "unknown keys, numbers non-negative unless said otherwise, finite: `.nan` and `.inf`",
        "are refused) and every error names the field. A size (a key ending in `Bytes`) is a",
        "number of bytes or a string with a unit, as the flags take it: `64MiB`, `512KiB`,",
        "`1.5GiB`, `512k` (units: " + SIZE_UNITS + "). A duration (a key ending in `Seconds`) is at",
        "most a year (31536000).",
        "",
        "## Top-level sections",
        "",
    ]
    sections: list[tuple[str, str, type]] = [
        ("saturation", "when the pool counts as saturated (shedding, flow control)", SaturationConfig),
        ("scraping", "the scrape period this config wants, and how much of a server's time its scrapes may take", ScrapingConfig),
        ("flowControl", "admission queue, fairness and priority bands (docs/flow-control.md)",
         FlowControlConfig),
        ("shortlist", "which candidates the scorers see in a large pool: the endpoints each "
         "scorer nominates and the least queued (docs/configuration.md)", ShortlistConfig),
    ]
    for pt in PLUGIN_TYPES.values():
        if pt.section:
            sections.append((pt.section, "defaults of the parameters of the plugin types "
                             "listed with it below", pt.params))
    for name, about, cls in sections:
        out += [f"### `{name}`", "", about[0].upper() + about[1:] + ".", "", *dataclass_table(cls)]
    out += [
        "### `requestControl`", "",
        "What epp does to a request before and after scheduling (model rewrites, priorities, "
        "the body cap, fallbacks); the format with an example is in "
        "`epp/request/settings.py`.", "",
        *pydantic_table(request_control._Section),
        "### `staticEndpoints`", "",
        "A fixed pool: a list of `ip:port` strings or `{address, port, labels}` mappings "
        "(`epp/datastore/static.py`), with `role: prefill|decode|prefill-decode` for "
        "disaggregated pools (the `llm-d.ai/role` label); `--endpoints` on the command line "
        "does the same.", "",
        "## Plugin types", "",
        "A plugin is listed under `plugins:` as `{type, name, parameters}`; filters, scorers "
        "(with a `weight`) and the picker are referenced from a scheduling profile; data "
        "producers run for every request and are not referenced. With several profiles, a "
        "profile handler runs them and names the deciders it asks (docs/disaggregation.md).", "",
    ]
    defaults = {v: k for k, v in DEFAULT_PRODUCERS.items()}
    for kind in ("producer", "filter", "scorer", "picker", "decider", "handler"):
        out += [f"### {'Profile handler' if kind == 'handler' else kind.title()}s", ""]
        for name, pt in PLUGIN_TYPES.items():
            if pt.kind != kind:
                continue
            out += [f"#### `{name}`", "", pt.summary[0].upper() + pt.summary[1:] + ".", ""]
            notes = []
            if pt.provides:
                notes.append("provides " + ", ".join(f"`{p}`" for p in pt.provides))
            reads = pt.reads(pt.params())
            if reads:
                notes.append("reads " + ", ".join(f"`{r}`" for r in reads))
            if name in defaults:
                notes.append("added when a plugin reads what it provides and no producer is configured")
            if pt.section:
                notes.append(f"defaults from the `{pt.section}` section")
            if notes:
                out += ["; ".join(notes).capitalize() + ".", ""]
            page = plugin_page(pt).relative_to(ROOT).as_posix()
            out += [f"What it does, its formula, the data it reads and why it is built so: "
                    f"[{page}](../{page}#{name}).", ""]
            out += dataclass_table(pt.params)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
    for path, text in render_pages().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
