"""The ``requestControl:`` section of the YAML config, its values and its parser: what epp
does to a request before and after the scheduler sees it (the Director that does it is
``epp.requestcontrol``).

    requestControl:
      maxBodyBytes: 8MiB             # 413 above this (bytes, or with a unit: 8MiB, 512KiB)
      fallbacks: 0                   # extra endpoints after the pick, comma-separated
      baseModels: [meta-llama/Llama-3.1-8B-Instruct]   # names that are not LoRA adapters
      modelRewrites:                 # client model -> served model (or a weighted split)
        llama: meta-llama/Llama-3.1-8B-Instruct
        chat:
          - {model: chat-v2, weight: 90}
          - {model: chat-v3, weight: 10}
      modelPriorities: {batch-summarizer: -1}
      objectives: {premium: 10, batch: -1}   # x-gateway-inference-objective -> priority
      servedEndpointHeader: ""       # response header naming the endpoint epp routed to
      pickReasonHeader: false        # x-epp-pick-reason on every response: why that endpoint
      loadRoutedPaths: [/v1/images/generations]   # more APIs routed by load and model

Every field is optional. Errors name the field (``requestControl.modelRewrites.chat[1].weight``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field, StringConstraints

from epp.errors import ConfigError
from epp.request.apis import BUILTIN, LoadRoutedApi, normalize_path
from epp.schema import STRICT, ByteSize, validate

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_BODY_BYTES_LIMIT = (1 << 30) - (1 << 20)
"""The largest body cap (1023 MiB): epp's gRPC message limit is twice the cap plus 1 MiB,
and gRPC's limit is an int32 (``epp.server.runner``)."""


@dataclass(slots=True, frozen=True)
class ModelTarget:
    model: str
    weight: int = 1


@dataclass(slots=True, frozen=True)
class RequestControlConfig:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    fallbacks: int = 0
    base_models: frozenset[str] = frozenset()
    model_rewrites: Mapping[str, tuple[ModelTarget, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    model_priorities: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    objective_priorities: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    served_endpoint_header: str = ""
    """A response header set to the endpoint epp routed the request to ('' = none; the
    conformance profile: ``x-conformance-test-served-endpoint``)."""
    pick_reason_header: bool = False
    """Every response carries ``x-epp-pick-reason``: the winner, the runner-up and the scores
    that separated them (it names the pool's endpoints; off by default). Without it a request
    asks with ``x-epp-explain: 1``, honoured only with ``--trust-control-headers``."""
    load_routed_paths: tuple[str, ...] = ()
    """Request paths routed by load and model (never keyed) beside the built-in APIs
    (docs/apis.md); any other path with a body is a 404."""


SECTION = "requestControl"

Name = Annotated[str, StringConstraints(min_length=1)]


class _Target(BaseModel):
    model_config = STRICT
    model: Name
    weight: int = Field(1, ge=0)


def _targets(value: Any) -> Any:
    """A bare model name is a one-target split."""
    return [{"model": value}] if isinstance(value, str) else value


class _Section(BaseModel):
    model_config = STRICT
    max_body_bytes: ByteSize = Field(DEFAULT_MAX_BODY_BYTES, ge=1, le=MAX_BODY_BYTES_LIMIT)
    fallbacks: int = Field(0, ge=0)
    base_models: list[Name] = []
    model_rewrites: dict[str, Annotated[list[_Target], BeforeValidator(_targets),
                                        Field(min_length=1)]] = {}  # fmt: skip
    model_priorities: dict[str, int] = {}
    objectives: dict[str, int] = {}
    served_endpoint_header: Annotated[str, StringConstraints(pattern=r"^[a-z0-9-]*$")] = ""
    pick_reason_header: bool = False
    load_routed_paths: list[Annotated[str, StringConstraints(pattern=r"^/[^?#\s]*$",
                                                             max_length=512)]] = []  # fmt: skip


def parse_request_control(raw: Mapping[str, Any] | None) -> RequestControlConfig:
    """Parse the whole config mapping's ``requestControl`` section (absent -> defaults)."""
    section = (raw or {}).get(SECTION)
    if section is None:
        return RequestControlConfig()
    if not isinstance(section, Mapping):
        raise ConfigError(SECTION, "must be a mapping")
    parsed: _Section = validate(_Section, dict(section), SECTION)
    rewrites: dict[str, tuple[ModelTarget, ...]] = {}
    for model, targets in parsed.model_rewrites.items():
        if sum(t.weight for t in targets) <= 0:
            raise ConfigError(f"{SECTION}.modelRewrites.{model}", "weights must not all be zero")
        rewrites[model] = tuple(ModelTarget(t.model, t.weight) for t in targets)
    for i, path in enumerate(parsed.load_routed_paths):
        known = BUILTIN.get(normalize_path(path))
        if known is not None and not isinstance(known, LoadRoutedApi):
            raise ConfigError(f"{SECTION}.loadRoutedPaths[{i}]",
                              f"{path} is keyed by epp ({known.kind.value}); it cannot be routed by load")  # fmt: skip
    return RequestControlConfig(
        max_body_bytes=parsed.max_body_bytes,
        fallbacks=parsed.fallbacks,
        base_models=frozenset(parsed.base_models),
        model_rewrites=MappingProxyType(rewrites),
        model_priorities=MappingProxyType(dict(parsed.model_priorities)),
        objective_priorities=MappingProxyType(dict(parsed.objectives)),
        served_endpoint_header=parsed.served_endpoint_header,
        pick_reason_header=parsed.pick_reason_header,
        load_routed_paths=tuple(parsed.load_routed_paths),
    )
