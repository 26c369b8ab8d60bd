"""Which pool serves a model: the pools' base models and the LoRA adapters of each.

Adapters come from several sources, in this order of precedence: the configuration
(``--adapters``, the ``--pools`` file), Kubernetes ConfigMaps in the llm-d payload processor's
format (``epp.modelrouter.kubernetes``), and what the pools' servers list on
``GET /v1/models`` (vLLM lists a LoRA module with ``parent``: its base model). An adapter
whose base model is in no pool, or whose name is a base model's, is ignored (logged once per
change); one claimed for two base models goes to the source of higher precedence, then to the
source named first. At most ``max_models`` names are known; past it new adapters are
ignored (logged), so a server or a ConfigMap cannot grow the router without bound.

Lookups read one dict; a change of a source rebuilds it (on the event loop, which is the
only writer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from epp.envoyconfig import PoolRoute

log = logging.getLogger(__name__)

CONFIG = "config"
"""The configured adapters' source name (the highest precedence)."""
DEFAULT_MAX_MODELS = 10_000


@dataclass(slots=True, frozen=True)
class ModelRoute:
    """Where a model's requests go."""

    model: str
    base_model: str
    """The model itself, or the adapter's base model: the value of x-gateway-base-model-name."""
    pool: str

    @property
    def adapter(self) -> bool:
        return self.model != self.base_model


def _precedence(source: str) -> tuple[int, str]:
    kind = 0 if source == CONFIG else 1 if source.startswith("configmap:") else 2
    return kind, source


class ModelCatalog:
    """Model name -> :class:`ModelRoute`, for the base models of ``pools`` and the adapters
    their sources name."""

    def __init__(self, pools: Sequence[PoolRoute], max_models: int = DEFAULT_MAX_MODELS) -> None:
        self._bases = {m: p.name for p in pools for m in p.models}
        self._pool_models = {p.name: p.models for p in pools}
        self.max_models = max(max_models, len(self._bases))
        self._sources: dict[str, dict[str, str]] = {}
        self._routes: Mapping[str, ModelRoute] = MappingProxyType({})
        self.ignored = 0
        """Adapters left out at the last rebuild (unknown base, a base's name, over the cap)."""
        self.version = 0
        """Bumped at every rebuild that changed the routes (the model list is rebuilt then)."""
        self._rebuild()

    def lookup(self, model: str) -> ModelRoute | None:
        return self._routes.get(model)

    @property
    def routes(self) -> Mapping[str, ModelRoute]:
        """Every known model, base models first (pool order), then adapters."""
        return self._routes

    def base_models(self, pool: str) -> tuple[str, ...]:
        return self._pool_models.get(pool, ())

    def set_adapters(self, source: str, adapters: Mapping[str, str]) -> None:
        """Replace what ``source`` says (adapter -> base model); ``{}`` forgets it."""
        current = self._sources.get(source)
        if current == adapters or (current is None and not adapters):
            return
        if adapters:
            self._sources[source] = dict(adapters)
        else:
            self._sources.pop(source, None)
        self._rebuild()

    def _rebuild(self) -> None:
        routes = {m: ModelRoute(m, m, pool) for m, pool in self._bases.items()}
        ignored: list[str] = []
        for source in sorted(self._sources, key=_precedence):
            for adapter, base in self._sources[source].items():
                if adapter in routes:
                    if routes[adapter].base_model != base and adapter not in self._bases:
                        ignored.append(f"{adapter} (base {base}, from {source}: already "
                                       f"{routes[adapter].base_model})")  # fmt: skip
                    elif adapter in self._bases:
                        ignored.append(f"{adapter} (from {source}: a base model's name)")
                    continue
                pool = self._bases.get(base)
                if pool is None:
                    ignored.append(f"{adapter} (from {source}: base {base} is in no pool)")
                    continue
                if len(routes) >= self.max_models:
                    ignored.append(f"{adapter} (from {source}: over {self.max_models} models)")
                    continue
                routes[adapter] = ModelRoute(adapter, base, pool)
        if ignored and len(ignored) != self.ignored:
            log.warning("model router: %d adapters ignored: %s", len(ignored),
                        "; ".join(ignored[:10]) + ("; ..." if len(ignored) > 10 else ""))  # fmt: skip
        self.ignored = len(ignored)
        if routes != self._routes:
            self._routes = MappingProxyType(routes)
            self.version += 1
