"""Kubernetes discovery, the values: pool specs, pod membership, objective priorities, and
the API constants. Pure functions over raw objects (the JSON the API server returns)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epp.framework.endpoint import Endpoint, endpoint_id

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"

RawObject = Mapping[str, Any]


class DiscoveryError(RuntimeError):
    """Discovery could not start: no credentials, or no first full list in time."""





@dataclass(slots=True, frozen=True)
class WatchTiming:
    """Timeouts and backoff of the reflectors; tests shrink them."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    watch_timeout_s: int = 300
    """Server-side timeout of one watch request; the reflector then re-watches."""
    request_timeout_s: float = 30.0
    """Connect timeout, and read timeout of lists; a watch may stay idle for its own timeout."""
    sync_timeout_s: float = 60.0
    """How long ``start`` waits for the first full list before it gives up."""
    stop_timeout_s: float = 2.0


DEFAULT_TIMING = WatchTiming()


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """Which pods belong to the pool, and the ports they serve on.

    ``match_labels`` is None when the server-side label selector alone decides membership
    (``--endpoint-selector``, which may use set-based expressions epp does not evaluate).
    """

    match_labels: Mapping[str, str] | None
    target_ports: tuple[int, ...]

    @classmethod
    def from_pool(cls, pool: RawObject) -> PoolSpec:
        """Read an ``InferencePool`` (v1); raises ValueError naming the bad field."""
        spec = pool.get("spec") or {}
        selector = spec.get("selector") or {}
        labels = selector.get("matchLabels")
        if not isinstance(labels, dict) or not labels:
            raise ValueError("spec.selector.matchLabels must be a non-empty map")
        ports = []
        for i, port in enumerate(spec.get("targetPorts") or ()):
            number = port.get("number") if isinstance(port, dict) else None
            if not isinstance(number, int) or not 0 < number < 65536:
                raise ValueError(f"spec.targetPorts[{i}].number must be a port, got {number!r}")
            ports.append(number)
        if not ports:
            raise ValueError("spec.targetPorts must list at least one port")
        return cls(
            match_labels=MappingProxyType({str(k): str(v) for k, v in labels.items()}),
            target_ports=tuple(ports),
        )

    def selects(self, labels: Mapping[str, str]) -> bool:
        if self.match_labels is None:
            return True
        return all(labels.get(k) == v for k, v in self.match_labels.items())

    def label_selector(self) -> str:
        """The selector in the API's query syntax (``a=b,c=d``)."""
        if self.match_labels is None:
            return ""
        return ",".join(f"{k}={v}" for k, v in sorted(self.match_labels.items()))


def pod_is_member(pod: RawObject) -> bool:
    """Ready (condition Ready=True), not terminating, and with an IP."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def pod_endpoints(pod: RawObject, spec: PoolSpec) -> list[Endpoint]:
    """The endpoints a pod contributes: one per target port (a data-parallel rank each, in
    the order the pool lists them), or none. Each carries the pod's UID (``instance``): a
    new pod at a reused IP is another server."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if not spec.selects(labels) or not pod_is_member(pod):
        return []
    ip = str(pod["status"]["podIP"])
    frozen = MappingProxyType(dict(labels))
    uid = str((pod.get("metadata") or {}).get("uid") or "")[:64]
    return [
        Endpoint(id=endpoint_id(ip, port), address=ip, port=port, labels=frozen, metrics_port=port,
                 rank=rank, instance=uid)
        for rank, port in enumerate(spec.target_ports)
    ]


class ObjectivePriorities:
    """InferenceObjective name -> priority, readable from any thread.

    ``initial`` holds priorities from configuration; discovered objectives override them by
    name and never erase them. An objective without ``spec.priority`` has priority 0, as
    upstream defines; an unknown name has none (the caller applies its default).
    """

    def __init__(self, initial: Mapping[str, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._configured: dict[str, int] = dict(initial or {})
        self._discovered: dict[str, int] = {}

    def priority_of(self, name: str) -> int | None:
        with self._lock:
            found = self._discovered.get(name)
            return self._configured.get(name) if found is None else found

    def snapshot(self) -> Mapping[str, int]:
        with self._lock:
            return {**self._configured, **self._discovered}

    def set(self, name: str, priority: int) -> None:
        with self._lock:
            self._discovered[name] = priority

    def discard(self, name: str) -> None:
        with self._lock:
            self._discovered.pop(name, None)

    def replace(self, discovered: Mapping[str, int]) -> None:
        """Make the discovered objectives exactly ``discovered`` (a full re-list)."""
        with self._lock:
            self._discovered = dict(discovered)


def objective_priority(objective: RawObject) -> int:
    priority = (objective.get("spec") or {}).get("priority")
    return priority if isinstance(priority, int) else 0
