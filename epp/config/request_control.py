"""The ``requestControl:`` section of the YAML config: what epp does to a request before and
after the scheduler sees it.

    requestControl:
      maxBodyBytes: 8388608          # 413 above this
      fallbacks: 0                   # extra endpoints after the pick, comma-separated
      baseModels: [meta-llama/Llama-3.1-8B-Instruct]   # names that are not LoRA adapters
      modelRewrites:                 # client model -> served model (or a weighted split)
        llama: meta-llama/Llama-3.1-8B-Instruct
        chat:
          - {model: chat-v2, weight: 90}
          - {model: chat-v3, weight: 10}
      modelPriorities: {batch-summarizer: -1}
      objectives: {premium: 10, batch: -1}   # x-gateway-inference-objective -> priority

Every field is optional. Errors name the field (``requestControl.modelRewrites.chat[1].weight``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from epp.errors import ConfigError
from epp.request.control import DEFAULT_MAX_BODY_BYTES, ModelTarget, RequestControlConfig

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ModelTarget", "RequestControlConfig", "parse_request_control"]

SECTION = "requestControl"
def parse_request_control(raw: Mapping[str, Any] | None) -> RequestControlConfig:
    """Parse the whole config mapping's ``requestControl`` section (absent -> defaults)."""
    section = (raw or {}).get(SECTION)
    if section is None:
        return RequestControlConfig()
    if not isinstance(section, Mapping):
        raise ConfigError(SECTION, "must be a mapping")
    known = {
        "maxBodyBytes",
        "fallbacks",
        "baseModels",
        "modelRewrites",
        "modelPriorities",
        "objectives",
    }
    for key in section:
        if key not in known:
            raise ConfigError(f"{SECTION}.{key}", f"unknown field (known: {', '.join(sorted(known))})")
    return RequestControlConfig(
        max_body_bytes=_int(section, "maxBodyBytes", DEFAULT_MAX_BODY_BYTES, minimum=1),
        fallbacks=_int(section, "fallbacks", 0, minimum=0),
        base_models=frozenset(_str_list(section, "baseModels")),
        model_rewrites=MappingProxyType(_rewrites(section.get("modelRewrites"))),
        model_priorities=MappingProxyType(_int_map(section, "modelPriorities")),
        objective_priorities=MappingProxyType(_int_map(section, "objectives")),
    )


def _int(section: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{SECTION}.{key}", f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{SECTION}.{key}", f"must be >= {minimum}, got {value}")
    return value


def _str_list(section: Mapping[str, Any], key: str) -> list[str]:
    value = section.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{SECTION}.{key}", "must be a list of non-empty strings")
    return value


def _int_map(section: Mapping[str, Any], key: str) -> dict[str, int]:
    value = section.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{SECTION}.{key}", "must be a mapping of name -> integer")
    out: dict[str, int] = {}
    for name, prio in value.items():
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ConfigError(f"{SECTION}.{key}.{name}", f"must be an integer, got {prio!r}")
        out[str(name)] = prio
    return out


def _rewrites(value: Any) -> dict[str, tuple[ModelTarget, ...]]:
    where = f"{SECTION}.modelRewrites"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(where, "must be a mapping of model -> target model or weighted list")
    out: dict[str, tuple[ModelTarget, ...]] = {}
    for model, target in value.items():
        here = f"{where}.{model}"
        if isinstance(target, str) and target:
            out[str(model)] = (ModelTarget(target),)
            continue
        if not isinstance(target, list) or not target:
            raise ConfigError(here, "must be a model name or a non-empty list of {model, weight}")
        targets = []
        for i, item in enumerate(target):
            if not isinstance(item, Mapping) or not isinstance(item.get("model"), str):
                raise ConfigError(f"{here}[{i}]", "must be a mapping with a string 'model'")
            weight = item.get("weight", 1)
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
                raise ConfigError(f"{here}[{i}].weight", f"must be an integer >= 0, got {weight!r}")
            targets.append(ModelTarget(item["model"], weight))
        if sum(t.weight for t in targets) <= 0:
            raise ConfigError(here, "weights must not all be zero")
        out[str(model)] = tuple(targets)
    return out
