"""Validation of config values with pydantic: one mechanism for every section and parameter
class, and one translation of its errors into ``ConfigError`` messages that name the field.

Sections and plugin parameters are frozen dataclasses owned by their packages
(``PrefixIndexConfig`` in ``epp.prefix``, plugin parameters in ``epp.plugins``...). For each,
:func:`build` derives a strict pydantic model once (camelCase keys, snake_case accepted, no
unknown keys, no silent coercion: ``2.5`` is not an integer, ``1`` is not ``true``), validates
the YAML mapping with it and returns the dataclass. Numbers must not be negative unless the
class says otherwise in ``__config_signed__``; ``__config_min__`` (field name -> lowest
value) sets a higher floor, ``__config_max__`` (field name -> highest value) a ceiling.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic.alias_generators import to_camel

from epp.errors import ConfigError

T = TypeVar("T")

STRICT = ConfigDict(
    strict=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
)

_MESSAGES = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "dataclass_type": "expected a mapping",
    "missing": "missing",
}


def path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """``('plugins', 0, 'weight')`` under ``prefix`` -> ``prefix.plugins[0].weight``."""
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def config_error(exc: ValidationError, prefix: str, known: str = "") -> ConfigError:
    """The first error of a validation, as a ConfigError naming the field."""
    err = exc.errors()[0]
    where = path(prefix, tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return ConfigError(where, f"unknown field (known: {known or 'none'})")
    base = _MESSAGES.get(kind)
    if base is None:
        ctx = err.get("ctx") or {}
        if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
                  "less_than": "<"}[kind]  # fmt: skip
            bound = next(iter(ctx.values()), "")
            return ConfigError(where, f"must be {op} {bound}, got {err.get('input')!r}")
        if kind == "too_short":
            return ConfigError(where, "must not be empty")
        if kind == "literal_error":
            names = [n for n in re.findall(r"'([^']*)'", str(ctx.get("expected", ""))) if n]
            return ConfigError(where, f"must be one of {', '.join(names)}, got {err.get('input')!r}")
        message = str(ctx.get("error", err["msg"]))
        return ConfigError(where, message[0].lower() + message[1:] if message else kind)
    if kind == "missing":
        return ConfigError(where, base)
    return ConfigError(where, f"{base}, got {err.get('input')!r}")


@functools.cache
def _model_of(cls: Any) -> type[BaseModel]:
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else ...
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        fields[f.name] = (hints[f.name], default)
    model: type[BaseModel] = create_model(f"{cls.__name__}Schema", __config__=STRICT, **fields)
    return model


def known_fields(cls: type) -> str:
    return ", ".join(to_camel(f.name) for f in dataclasses.fields(cls)) or "none"


def build(cls: type[T], raw: Any, where: str) -> T:
    """A frozen parameter dataclass from a YAML mapping (None: all defaults); raises
    ConfigError naming the bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(where, "expected a mapping of parameters")
    try:
        validated = _model_of(typing.cast(Any, cls)).model_validate(dict(raw))
    except ValidationError as exc:
        raise config_error(exc, where, known_fields(cls)) from None
    params = cls(**dict(validated))
    signed = getattr(cls, "__config_signed__", ())
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        v = getattr(params, f.name)
        if f.name not in signed and isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
            raise ConfigError(f"{where}.{to_camel(f.name)}", f"must not be negative, got {v}")
    for name, low in getattr(cls, "__config_min__", {}).items():
        v = getattr(params, name)
        if v < low:
            raise ConfigError(f"{where}.{to_camel(name)}", f"must be >= {low:g}, got {v!r}")
    for name, high in getattr(cls, "__config_max__", {}).items():
        v = getattr(params, name)
        if v > high:
            raise ConfigError(f"{where}.{to_camel(name)}", f"must be <= {high:g}, got {v!r}")
    return params


def validate(model: type[BaseModel], raw: Any, where: str) -> Any:
    """Validate ``raw`` with a pydantic model; raises ConfigError naming the bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        known = ", ".join(f.alias or n for n, f in model.model_fields.items())
        raise config_error(exc, where, known) from None
