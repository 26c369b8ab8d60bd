"""A fixed pool: ``--endpoints 10.0.0.1:8000,10.0.0.2:8000`` or the config's ``staticEndpoints``.

    staticEndpoints:
      - 10.0.0.1:8000
      - {address: 10.0.0.2, port: 8000, metricsPort: 9000, engine: sglang, labels: {zone: a}}
      - {address: 10.0.0.3, port: 8000, role: prefill}
      - {address: 10.0.0.4, port: 8001, rank: 1}

An entry may carry ``engine`` (``vllm`` by default, or ``sglang``): it picks the metric names
the scraper reads. ``metricsPort`` defaults to the serving port. ``role`` (``prefill``,
``decode``, ``prefill-decode``) is its role in a disaggregated pool: the ``llm-d.ai/role``
label pods carry (docs/disaggregation.md). ``rank`` is a data-parallel rank's index on its
host (0 by default): its KV events are read at ``eventsPort + rank``, as vLLM offsets them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.endpoint import (
    ENGINE_LABEL,
    ROLE_LABEL,
    Endpoint,
    endpoint_id,
    parse_endpoint_id,
)
from epp.schema import STRICT, validate

CONFIG_SECTION = "staticEndpoints"


def parse_endpoint_list(text: str, engine: str = "", where: str = "--endpoints") -> list[Endpoint]:
    """``ip:port,ip:port`` -> endpoints; raises ConfigError naming the bad entry."""
    out: list[Endpoint] = []
    for i, item in enumerate(p for p in text.split(",") if p.strip()):
        try:
            host, port = parse_endpoint_id(item)
        except ValueError as exc:
            raise ConfigError(f"{where}[{i}]", str(exc)) from None
        out.append(_endpoint(host, port, 0, engine, {}))
    return _unique(out, where)


class _StaticEndpoint(BaseModel):
    model_config = STRICT
    address: Annotated[str, StringConstraints(min_length=1)]
    port: int = Field(ge=1, le=65535)
    metrics_port: int = Field(0, ge=0, le=65535)
    """0: the serving port."""
    engine: Literal["", "vllm", "sglang"] = ""
    """An unknown engine would be scraped for vLLM's metric names, never matching."""
    labels: dict[str, str] = {}
    role: Literal["", "prefill", "decode", "prefill-decode", "both"] = ""
    """Shorthand for the ``llm-d.ai/role`` label."""
    rank: int = Field(0, ge=0, le=1023)
    """Data-parallel rank (its KV events at ``eventsPort + rank``)."""


def endpoints_from_config(raw: Mapping[str, Any] | None) -> list[Endpoint]:
    section = (raw or {}).get(CONFIG_SECTION)
    if section is None:
        return []
    if not isinstance(section, list):
        raise ConfigError(CONFIG_SECTION, "must be a list of 'ip:port' strings or mappings")
    out: list[Endpoint] = []
    for i, item in enumerate(section):
        where = f"{CONFIG_SECTION}[{i}]"
        if isinstance(item, str):
            out.extend(parse_endpoint_list(item, where=where))
            continue
        if not isinstance(item, Mapping):
            raise ConfigError(where, "must be 'ip:port' or a mapping with address and port")
        e: _StaticEndpoint = validate(_StaticEndpoint, dict(item), where)
        labels = dict(e.labels)
        if e.role:
            labels[ROLE_LABEL] = e.role
        out.append(_endpoint(e.address, e.port, e.metrics_port, e.engine, labels, e.rank))
    return _unique(out, CONFIG_SECTION)


def _endpoint(host: str, port: int, metrics_port: int, engine: str, labels: dict[str, str],
              rank: int = 0) -> Endpoint:  # fmt: skip
    if engine:
        labels[ENGINE_LABEL] = engine
    return Endpoint(
        id=endpoint_id(host, port),
        address=host,
        port=port,
        labels=MappingProxyType(labels),
        metrics_port=metrics_port,
        rank=rank,
    )


def _unique(endpoints: list[Endpoint], where: str) -> list[Endpoint]:
    seen: set[str] = set()
    for e in endpoints:
        if e.id in seen:
            raise ConfigError(where, f"endpoint {e.id} listed twice")
        seen.add(e.id)
    return endpoints


class StaticSource:
    """Loads a fixed list into the datastore once (the datastore is then ``synced``)."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = tuple(endpoints)

    def start(self, datastore: Datastore) -> None:
        datastore.replace_all(self.endpoints)
