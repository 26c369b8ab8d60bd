"""Validation of config values with pydantic: one mechanism for every section and parameter
class, and one translation of its errors into ``ConfigError`` messages that name the field.

Sections and plugin parameters are frozen dataclasses owned by their packages
(``PrefixIndexConfig`` in ``epp.prefix``, plugin parameters in ``epp.plugins``...). For each,
:func:`build` derives a strict pydantic model once (camelCase keys, snake_case accepted, no
unknown keys, no silent coercion: ``2.5`` is not an integer, ``1`` is not ``true``), validates
the YAML mapping with it and returns the dataclass. Numbers must not be negative unless the
class says otherwise in ``__config_signed__``; ``__config_min__`` (field name -> lowest
value) sets a higher floor, ``__config_max__`` (field name -> highest value) a ceiling.
Numbers must be finite (``.nan`` and ``.inf`` are refused, naming the field). A size (an
integer field whose name ends in ``_bytes``) is an integer or a string with a unit, as the
flags take it: ``64MiB``, ``512k``, ``1048576`` (:func:`parse_byte_size`). A duration (a
field whose name ends in ``_seconds``, or a mapping of them) is at most ``MAX_SECONDS``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, create_model
from pydantic.alias_generators import to_camel

from epp.errors import ConfigError

T = TypeVar("T")

STRICT = ConfigDict(
    strict=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True,
    allow_inf_nan=False,
)

MAX_SECONDS = 365 * 86400.0
"""The longest duration a config field or a seconds flag may give (a year): far inside what
Envoy's durations, asyncio's timers and ``threading`` waits take."""

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2,
          "mb": 1000**2, "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3,
          "gi": 1024**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "ti": 1024**4,
          "tib": 1024**4}  # fmt: skip
SIZE_UNITS = "B, k/kB, Ki/KiB, M/MB, Mi/MiB, G/GB, Gi/GiB, T/TB, Ti/TiB (case-insensitive)"


def parse_byte_size(text: str) -> int:
    """``8MiB``, ``512k``, ``1.5GiB``, ``1048576`` -> bytes (units: ``SIZE_UNITS``); raises
    ValueError saying what a size looks like (not a size, not finite, below 1 byte). The one
    parser of sizes: the flags (``epp.cli.flags.byte_size``) and the config's ``*Bytes``
    fields."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = t[len(num) :].strip()
    if not num or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size like 8MiB, 512KiB or 1048576")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 8MiB, 512KiB or 1048576") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite size")
    size = int(value * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return size


def _size_or_int(value: Any) -> Any:
    return parse_byte_size(value) if isinstance(value, str) else value


ByteSize = Annotated[int, BeforeValidator(_size_or_int)]
"""A config size: an integer of bytes or a string with a unit (``64MiB``)."""

_MESSAGES = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
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
        hint = ByteSize if f.name.endswith("_bytes") and hints[f.name] is int else hints[f.name]
        fields[f.name] = (hint, default)
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
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        v = getattr(params, f.name)
        if f.name.endswith("_seconds") and v is not None:
            for key, secs in (v.items() if isinstance(v, Mapping) else ((None, v),)):
                if secs > MAX_SECONDS:
                    field_name = to_camel(f.name) + ("" if key is None else f".{key}")
                    raise ConfigError(f"{where}.{field_name}",
                                      f"must be <= {MAX_SECONDS:g} s (a year), got {secs!r}")
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
