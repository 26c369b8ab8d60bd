"""Kubernetes discovery: the pods of an InferencePool (or of a label selector) as endpoints.

Each watched collection has a reflector: a thread that lists the collection, then watches
it from the list's resourceVersion, re-lists after ``410 Gone`` and reconnects with
exponential backoff after any failure. The blocking ``kubernetes`` client runs only on
those threads; every change travels to the serving loop with ``call_soon_threadsafe`` and
is applied to the :class:`~epp.datastore.store.Datastore` there, so the datastore stays
single-threaded.

Membership: a pod belongs to the pool when its labels match the pool's selector, it is
Ready, it is not terminating and it has an IP. It then yields one endpoint per target
port. Everything else (unready, deleted, relabelled) leaves the datastore at once, which
tells the prefix index to forget the endpoint.

``InferenceObjective`` objects (``spec.priority``, ``spec.poolRef``) fill an
:class:`ObjectivePriorities` map that the request path reads by objective name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kubernetes import client, config, watch

from epp.datastore.endpoint import Endpoint, EndpointId, endpoint_id
from epp.datastore.store import Datastore
from epp.errors import ConfigError

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
OBJECTIVE_HEADER = "x-gateway-inference-objective"

RawObject = Mapping[str, Any]


class DiscoveryError(RuntimeError):
    """Discovery could not start: no credentials, or no first full list in time."""


# --- values ------------------------------------------------------------------------------


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
    """The endpoints a pod contributes: one per target port, or none."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if not spec.selects(labels) or not pod_is_member(pod):
        return []
    ip = str(pod["status"]["podIP"])
    frozen = MappingProxyType(dict(labels))
    return [
        Endpoint(id=endpoint_id(ip, port), address=ip, port=port, labels=frozen, metrics_port=port)
        for port in spec.target_ports
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


# --- reflector (runs on its own thread) --------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Listed:
    items: tuple[RawObject, ...]


@dataclass(slots=True, frozen=True)
class _Changed:
    type: str  # ADDED | MODIFIED | DELETED
    object: RawObject


_Delta = _Listed | _Changed


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, client.ApiException):
        message = ""
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(exc.body or "{}").get("message", "")
        return f"HTTP {exc.status} {exc.reason or ''}{': ' + message if message else ''}".strip()
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True, eq=False)
class _Reflector:
    """Keeps one collection in sync: list, watch from its resourceVersion, repeat."""

    name: str
    list_call: Callable[..., Any]
    deliver: Callable[[_Delta], None]
    report_error: Callable[[str], None]
    timing: WatchTiming
    label_selector: str = ""
    field_selector: str = ""
    _stopped: threading.Event = field(default_factory=threading.Event)
    _watch: watch.Watch | None = None
    _last_error: str = ""
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"k8s-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        w = self._watch
        if w is not None:
            w.stop()  # shuts the socket down, which unblocks the read

    def join(self, timeout_s: float) -> bool:
        thread = self._thread
        if thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            # A watch that was still connecting when stop() ran had no socket to shut
            # down yet (and Watch.stream clears its stop flag when it starts): try again.
            self.stop()
            thread.join(0.05)
        return not thread.is_alive()

    def _selectors(self) -> dict[str, str]:
        kwargs = {}
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.field_selector:
            kwargs["field_selector"] = self.field_selector
        return kwargs

    def _run(self) -> None:
        delay = self.timing.backoff_initial_s
        while not self._stopped.is_set():
            try:
                version = self._list()
                delay = self.timing.backoff_initial_s
                self._last_error = ""
                while not self._stopped.is_set():
                    version = self._watch_from(version)
            except _Expired:
                log.info("%s: watch expired (410 Gone), listing again", self.name)
                continue
            except Exception as exc:
                if self._stopped.is_set():
                    break
                text = describe_error(exc)
                self.report_error(text)
                # The same failure again (say, a CRD that is not installed) goes to debug.
                level = logging.DEBUG if text == self._last_error else logging.WARNING
                self._last_error = text
                log.log(level, "%s: %s; retrying in %.2fs", self.name, text, delay)
                self._stopped.wait(delay * random.uniform(0.8, 1.0))
                delay = min(delay * 2, self.timing.backoff_max_s)

    def _list(self) -> str:
        resp = self.list_call(
            **self._selectors(),
            _preload_content=False,
            _request_timeout=(self.timing.request_timeout_s, self.timing.request_timeout_s),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if not version:
            raise ValueError("list response without metadata.resourceVersion")
        self.deliver(_Listed(tuple(body.get("items") or ())))
        return version

    def _watch_from(self, version: str) -> str:
        """Stream events until the server ends the watch; returns the version to resume at."""
        w = watch.Watch(return_type="object")  # plain dicts, no model classes
        self._watch = w
        try:
            if self._stopped.is_set():
                return version
            stream = w.stream(
                self.list_call,
                **self._selectors(),
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.timing.watch_timeout_s,
                _request_timeout=(
                    self.timing.request_timeout_s,
                    self.timing.watch_timeout_s + self.timing.request_timeout_s,
                ),
            )
            for event in stream:
                if self._stopped.is_set():
                    break
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.deliver(_Changed(kind, event["raw_object"]))
        except client.ApiException as exc:
            if exc.status == 410:
                raise _Expired() from exc
            raise
        finally:
            self._watch = None
        return str(w.resource_version or version)


# --- the source (runs on the serving loop) -----------------------------------------------


def load_api_client() -> client.ApiClient:
    """In-cluster service account first, then the kubeconfig, as the client resolves them."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as in_cluster:
        try:
            config.load_kube_config(client_configuration=cfg)
        except (config.ConfigException, OSError) as kubeconfig:
            raise DiscoveryError(
                f"no Kubernetes credentials: not in a cluster ({in_cluster}) "
                f"and no usable kubeconfig ({kubeconfig})"
            ) from kubeconfig
    return client.ApiClient(cfg)


def api_client_for(host: str) -> client.ApiClient:
    """A client for an API server at ``host`` with no credentials (tests, kubectl proxy)."""
    return client.ApiClient(client.Configuration(host=host))


class KubernetesSource:
    """Feeds a Datastore from an InferencePool and its pods, or from a pod label selector.

    ``start`` returns after the first full list of pods (``synced``), or raises
    :class:`DiscoveryError` naming what went wrong. ``objectives`` fills as
    InferenceObjectives of the pool (or of the namespace, without a pool) come and go.
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        pool_name: str | None = None,
        pool_namespace: str = "default",
        endpoint_selector: str | None = None,
        target_ports: Iterable[int] = (),
        api_client: client.ApiClient | None = None,
        objectives: ObjectivePriorities | None = None,
        timing: WatchTiming = WatchTiming(),
    ) -> None:
        ports = tuple(target_ports)
        if pool_name and endpoint_selector:
            raise ConfigError("--endpoint-selector", "give either a pool name or a selector")
        if not pool_name and not endpoint_selector:
            raise ConfigError("--pool-name", "give a pool name or an endpoint selector")
        if pool_name and ports:
            raise ConfigError(
                "--endpoint-target-ports", "only with an endpoint selector; a pool has its own"
            )
        if endpoint_selector and not ports:
            raise ConfigError("--endpoint-target-ports", "required with an endpoint selector")
        for port in ports:
            if not 0 < port < 65536:
                raise ConfigError("--endpoint-target-ports", f"{port} is not a port")
        self._datastore = datastore
        self._pool_name = pool_name
        self._namespace = pool_namespace
        self._selector = endpoint_selector
        self._api_client = api_client
        self._timing = timing
        self.objectives = objectives if objectives is not None else ObjectivePriorities()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._core: client.CoreV1Api | None = None
        self._spec: PoolSpec | None = (
            None if pool_name else PoolSpec(match_labels=None, target_ports=ports)
        )
        self._pods: dict[str, RawObject] = {}
        self._pods_listed = False
        self._published: dict[EndpointId, Endpoint] = {}
        self._pod_reflector: _Reflector | None = None
        self._reflectors: list[_Reflector] = []
        self._synced = asyncio.Event()
        self._last_error = ""
        self._stopping = False

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def pool_spec(self) -> PoolSpec | None:
        return self._spec

    def describe(self) -> str:
        if self._pool_name:
            return f"InferencePool {self._namespace}/{self._pool_name}"
        return f"pods {self._selector!r} in namespace {self._namespace}"

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        api = self._api_client or await asyncio.to_thread(load_api_client)
        self._core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        if self._pool_name:
            self._add_reflector(
                "inferencepool",
                functools.partial(
                    custom.list_namespaced_custom_object,
                    POOL_GROUP,
                    POOL_VERSION,
                    self._namespace,
                    POOL_PLURAL,
                ),
                self._on_pool,
                field_selector=f"metadata.name={self._pool_name}",
            )
        else:
            self._restart_pods()
        self._add_reflector(
            "inferenceobjectives",
            functools.partial(
                custom.list_namespaced_custom_object,
                OBJECTIVE_GROUP,
                OBJECTIVE_VERSION,
                self._namespace,
                OBJECTIVE_PLURAL,
            ),
            self._on_objective,
            critical=False,
        )
        try:
            await asyncio.wait_for(self._synced.wait(), self._timing.sync_timeout_s)
        except TimeoutError:
            await self.stop()
            reason = self._last_error or "no answer"
            raise DiscoveryError(
                f"{self.describe()}: no full list within {self._timing.sync_timeout_s:g}s "
                f"(last problem: {reason})"
            ) from None
        log.info("%s: synced, %d endpoints", self.describe(), len(self._published))

    async def stop(self) -> None:
        self._stopping = True
        reflectors = [*self._reflectors]
        if self._pod_reflector is not None:
            reflectors.append(self._pod_reflector)
        self._reflectors.clear()
        self._pod_reflector = None
        for r in reflectors:
            r.stop()
        timeout_s = self._timing.stop_timeout_s

        def join_all() -> None:
            for r in reflectors:
                if not r.join(timeout_s):
                    log.warning("reflector %s did not stop within %.1fs", r.name, timeout_s)

        await asyncio.to_thread(join_all)

    # --- plumbing ------------------------------------------------------------------------

    def _add_reflector(
        self,
        name: str,
        list_call: Callable[..., Any],
        handler: Callable[[_Delta], None],
        *,
        label_selector: str = "",
        field_selector: str = "",
        critical: bool = True,
        register: bool = True,
    ) -> _Reflector:
        reflector: _Reflector

        def deliver(delta: _Delta) -> None:
            self._post(apply, delta)

        def apply(delta: _Delta) -> None:
            # A restarted reflector's predecessor may still have deltas in flight.
            current = reflector is self._pod_reflector or reflector in self._reflectors
            if current and not self._stopping:
                handler(delta)

        def report_error(text: str) -> None:
            if critical:
                self._post(self._set_error, text)

        reflector = _Reflector(
            name=name,
            list_call=list_call,
            deliver=deliver,
            report_error=report_error,
            timing=self._timing,
            label_selector=label_selector,
            field_selector=field_selector,
        )
        if register:
            self._reflectors.append(reflector)
        reflector.start()
        return reflector

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed while a reflector finished
            loop.call_soon_threadsafe(fn, *args)

    def _set_error(self, text: str) -> None:
        self._last_error = text

    # --- pool ------------------------------------------------------------------------------

    def _on_pool(self, delta: _Delta) -> None:
        if isinstance(delta, _Listed):
            pool = next(
                (p for p in delta.items if p.get("metadata", {}).get("name") == self._pool_name),
                None,
            )
        else:
            pool = None if delta.type == "DELETED" else delta.object
        if pool is None:
            self._pool_gone()
            return
        try:
            spec = PoolSpec.from_pool(pool)
        except ValueError as exc:
            self._last_error = f"{self.describe()}: {exc}"
            log.error("%s; keeping the previous pool definition", self._last_error)
            return
        if spec == self._spec:
            return
        old, self._spec = self._spec, spec
        log.info(
            "%s: selector %s, target ports %s",
            self.describe(),
            spec.label_selector(),
            ",".join(map(str, spec.target_ports)),
        )
        if old is None or old.match_labels != spec.match_labels:
            self._restart_pods()
        self._publish()

    def _pool_gone(self) -> None:
        self._last_error = f"{self.describe()} not found"
        if self._spec is None:
            return
        log.warning("%s was deleted; the pool is empty until it comes back", self.describe())
        self._spec = None
        if self._pod_reflector is not None:
            self._pod_reflector.stop()
            self._pod_reflector = None
        self._pods.clear()
        self._pods_listed = False
        self._publish()

    # --- pods ------------------------------------------------------------------------------

    def _restart_pods(self) -> None:
        """Watch the pods the current spec selects; a new selector means a new watch."""
        assert self._core is not None and self._spec is not None
        if self._pod_reflector is not None:
            self._pod_reflector.stop()
        # Pods the new selector drops leave now; pods it adds arrive with the next list.
        spec = self._spec
        self._pods = {
            name: pod
            for name, pod in self._pods.items()
            if spec.selects((pod.get("metadata") or {}).get("labels") or {})
        }
        self._pod_reflector = None
        self._pod_reflector = self._add_reflector(
            "pods",
            functools.partial(self._core.list_namespaced_pod, self._namespace),
            self._on_pods,
            label_selector=self._selector or spec.label_selector(),
            register=False,
        )

    def _on_pods(self, delta: _Delta) -> None:
        if isinstance(delta, _Listed):
            self._pods = {p["metadata"]["name"]: p for p in delta.items}
            self._pods_listed = True
        else:
            name = delta.object["metadata"]["name"]
            if delta.type == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = delta.object
        self._publish()

    def _publish(self) -> None:
        """Bring the datastore to the endpoints the pods and the spec yield now."""
        spec = self._spec
        wanted: dict[EndpointId, Endpoint] = {}
        if spec is not None:
            for pod in self._pods.values():
                for ep in pod_endpoints(pod, spec):
                    wanted[ep.id] = ep
        if not self._synced.is_set():
            if spec is None or not self._pods_listed:
                return
            self._datastore.replace_all(wanted.values())
            self._published = wanted
            self._synced.set()
            return
        for eid in [eid for eid in self._published if eid not in wanted]:
            log.info("endpoint %s left the pool", eid)
            self._datastore.remove(eid)
        for eid, ep in wanted.items():
            if self._published.get(eid) != ep:
                if eid not in self._published:
                    log.info("endpoint %s joined the pool", eid)
                self._datastore.upsert(ep)
        self._published = wanted

    # --- objectives ----------------------------------------------------------------------

    def _objective_applies(self, objective: RawObject) -> bool:
        if not self._pool_name:
            return True
        ref = (objective.get("spec") or {}).get("poolRef") or {}
        return ref.get("name") == self._pool_name

    def _on_objective(self, delta: _Delta) -> None:
        if isinstance(delta, _Listed):
            self.objectives.replace(
                {
                    o["metadata"]["name"]: objective_priority(o)
                    for o in delta.items
                    if self._objective_applies(o)
                }
            )
            return
        name = delta.object["metadata"]["name"]
        if delta.type == "DELETED" or not self._objective_applies(delta.object):
            self.objectives.discard(name)
        else:
            self.objectives.set(name, objective_priority(delta.object))


# --- CLI wiring --------------------------------------------------------------------------


def _ports(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ports"
        ) from None


def add_kubernetes_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kubernetes discovery")
    group.add_argument(
        "--pool-name", help="InferencePool whose pods are the endpoints (enables discovery)"
    )
    group.add_argument(
        "--pool-namespace",
        default="default",
        help="namespace of the InferencePool, its pods and its InferenceObjectives",
    )
    group.add_argument(
        "--endpoint-selector",
        help="without a pool: label selector of the model server pods, e.g. app=vllm",
    )
    group.add_argument(
        "--endpoint-target-ports",
        type=_ports,
        default=[],
        help="with --endpoint-selector: comma-separated ports the pods serve on, e.g. 8000",
    )


def source_from_args(
    args: argparse.Namespace,
    datastore: Datastore,
    *,
    objectives: ObjectivePriorities | None = None,
) -> KubernetesSource | None:
    """The source the flags ask for, or None when they ask for no Kubernetes discovery."""
    if not args.pool_name and not args.endpoint_selector:
        if args.endpoint_target_ports:
            raise ConfigError("--endpoint-target-ports", "only with --endpoint-selector")
        return None
    return KubernetesSource(
        datastore,
        pool_name=args.pool_name,
        pool_namespace=args.pool_namespace,
        endpoint_selector=args.endpoint_selector,
        target_ports=args.endpoint_target_ports,
        objectives=objectives,
    )
