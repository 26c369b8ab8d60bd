"""What epp does to a request before and after the scheduler sees it: the values of the
``requestControl:`` config section (parsed by ``epp.config.request_control``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


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


