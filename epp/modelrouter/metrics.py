"""Prometheus metrics of ``epp model-router``: requests per model and pool, the model list.

Label values are bounded: ``model_name`` is a model the catalog knows (at most its
``max_models``), or ``unknown`` for any other name a client sends; ``pool`` a configured pool.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.modelrouter.catalog import ModelCatalog, ModelRoute
from epp.observability.hotpath import LightCounter, LightHistogram

UNKNOWN = "unknown"
"""``model_name`` of a request for a model the gateway does not serve (or names none)."""
NONE = ""


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = LightCounter(
            "epp_model_router_requests",
            "Requests by the body's model (model_name), the base model whose pool serves it "
            "(target_model_name: the model itself, or an adapter's base), the pool, and the "
            "outcome: routed, or the HTTP status the router answered (404 unknown model, 400, "
            "413...); model_name 'unknown' for a model the gateway does not serve.",
            ["model_name", "target_model_name", "pool", "outcome"],
            registry=r,
        )
        self.duration = LightHistogram(
            "epp_model_router_duration_seconds",
            "Time to read the model from a request body and choose its pool (after the body "
            "arrived).",
            buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                     0.01, 0.025, 0.1),
            registry=r,
        )
        self.models = Gauge(
            "epp_model_router_models",
            "Models the gateway routes, by pool and kind (base, adapter).",
            ["pool", "kind"],
            registry=r,
        )
        self.list_refreshes = Counter(
            "epp_model_router_model_list_refreshes",
            "Rounds of GET /v1/models over a pool's servers, by result (ok: at least one "
            "server answered; error: none did, the last list is kept; no_servers: the pool's "
            "addresses resolved to none).",
            ["pool", "result"],
            registry=r,
        )
        self.list_age = Gauge(
            "epp_model_router_model_list_age_seconds",
            "Seconds since a pool's servers last answered GET /v1/models.",
            ["pool"],
            registry=r,
        )
        self.task_failures = Counter(
            "epp_background_task_failures",
            "Background task runs that raised and were restarted, by task kind.",
            ["kind"],
            registry=r,
        )

    def request(self, route: ModelRoute | None, outcome: str) -> None:
        if route is None:
            key = (UNKNOWN, NONE, NONE, outcome)
        else:
            key = (route.model, route.base_model, route.pool, outcome)
        self.requests.labels(*key).inc()

    def refresh_models(self, catalog: ModelCatalog, pools: tuple[str, ...]) -> None:
        counts = {(p, k): 0 for p in pools for k in ("base", "adapter")}
        for route in catalog.routes.values():
            counts[(route.pool, "adapter" if route.adapter else "base")] += 1
        for (pool, kind), n in counts.items():
            self.models.labels(pool, kind).set(n)

    def list_refreshed(self, pool: str, result: str) -> None:
        self.list_refreshes.labels(pool, result).inc()

    def task_failed(self, kind: str) -> None:
        self.task_failures.labels(kind).inc()
