"""The pool as epp sees it, as JSON: what ``GET /debug/endpoints`` on epp's metrics port
serves and ``epp dry-run --snapshot`` reads back.

    {"endpoints": [{"id": "10.0.0.1:8000", "labels": {...}, "rank": 0, "stale": false,
                    "pending": 0, "in_flight": 2,
                    "metrics": {"waiting": 0, "running": 2, "kv_usage": 0.12,
                                "running_adapters": [], "waiting_adapters": [],
                                "max_adapters": 0, "block_size_tokens": 16,
                                "num_gpu_blocks": 4096, "served_models": ["m"],
                                "not_serving": "", "age_s": 0.08}}]}

``age_s`` is how old the last scrape was when the snapshot was taken (null: never scraped).
``not_serving`` is why the server says it cannot serve now ('' = it can; ``asleep``: vLLM's
sleep mode): such an endpoint is no candidate, live or in ``epp dry-run``.
Bad input raises ValueError naming the entry and field; the list is bounded
(``MAX_ENDPOINTS``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, EndpointId, Metrics, parse_endpoint_id

MAX_ENDPOINTS = 10_000


def snapshot_json(ds: Datastore, now_s: float) -> dict[str, Any]:
    """The datastore's endpoints (module docstring); ``now_s`` on the scrapes' monotonic clock."""
    in_flight = ds.in_flight()
    out = []
    for e in ds.snapshot():
        m = e.metrics
        out.append({
            "id": e.id, "labels": dict(e.labels), "rank": e.rank, "stale": e.stale,
            "pending": e.pending, "in_flight": in_flight.get(e.id, 0),
            "metrics": {
                "waiting": m.waiting, "running": m.running, "kv_usage": m.kv_usage,
                "running_adapters": sorted(m.running_adapters),
                "waiting_adapters": sorted(m.waiting_adapters), "max_adapters": m.max_adapters,
                "block_size_tokens": m.block_size_tokens, "num_gpu_blocks": m.num_gpu_blocks,
                "served_models": sorted(m.served_models), "not_serving": m.not_serving,
                "age_s": round(now_s - m.scraped_at_s, 3) if m.known else None,
            },
        })  # fmt: skip
    return {"endpoints": out}


def load_snapshot(doc: Any, ds: Datastore, now_s: float) -> None:
    """Fill ``ds`` with a snapshot's endpoints as they were: metrics as old as they were,
    requests in flight and pending as counted; stale ones marked (the datastore's own rule)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("endpoints"), list):
        raise ValueError('a snapshot is {"endpoints": [...]} (GET /debug/endpoints on epp)')
    entries = doc["endpoints"]
    if len(entries) > MAX_ENDPOINTS:
        raise ValueError(f"{len(entries)} endpoints; at most {MAX_ENDPOINTS}")
    for i, raw in enumerate(entries):
        where = f"endpoints[{i}]"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected an object")
        try:
            endpoint, metrics, in_flight, pending = _entry(raw, now_s)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        ds.upsert(endpoint)
        for _ in range(max(0, in_flight - pending)):
            ds.request_started(endpoint.id)
        if metrics is not None:
            ds.update_metrics(endpoint.id, metrics)
        for _ in range(pending):
            ds.request_started(endpoint.id)
    ds.mark_stale(now_s)
    ds.synced = True


def _count(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 31:
        raise ValueError(f"{key} must be a count, got {value!r}")
    return value


def _names(raw: Mapping[str, Any], key: str) -> frozenset[str]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of names")
    return frozenset(value)


def _reason(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"{key} must be a short reason ('' = serving), got {value!r:.80}")
    return value


def _entry(raw: Mapping[str, Any], now_s: float) -> tuple[Endpoint, Metrics | None, int, int]:
    eid = raw.get("id")
    if not isinstance(eid, str):
        raise ValueError("id must be ip:port")
    host, port = parse_endpoint_id(eid)
    labels = raw.get("labels", {})
    if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("labels must map names to strings")
    endpoint = Endpoint(EndpointId(eid), host, port, dict(labels), rank=_count(raw, "rank"))
    m = raw.get("metrics", {})
    if not isinstance(m, Mapping):
        raise ValueError("metrics must be an object")
    age = m.get("age_s")
    if age is None:
        metrics = None
    else:
        kv = m.get("kv_usage", 0.0)
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 <= age < math.inf:
            raise ValueError(f"metrics.age_s must be seconds >= 0, got {age!r}")
        if isinstance(kv, bool) or not isinstance(kv, int | float) or not 0 <= kv <= 1:
            raise ValueError(f"metrics.kv_usage must be in 0..1, got {kv!r}")
        metrics = Metrics(
            waiting=_count(m, "waiting"), running=_count(m, "running"), kv_usage=float(kv),
            running_adapters=_names(m, "running_adapters"),
            waiting_adapters=_names(m, "waiting_adapters"), max_adapters=_count(m, "max_adapters"),
            block_size_tokens=_count(m, "block_size_tokens"),
            num_gpu_blocks=_count(m, "num_gpu_blocks"), served_models=_names(m, "served_models"),
            scraped_at_s=max(1e-9, now_s - float(age)), not_serving=_reason(m, "not_serving"),
        )  # fmt: skip
    return endpoint, metrics, _count(raw, "in_flight"), _count(raw, "pending")
