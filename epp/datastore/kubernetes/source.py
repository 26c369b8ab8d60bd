"""Kubernetes discovery, the source: an InferencePool's pods (or a selector's) as endpoints.

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

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes import client, config

from epp.datastore.kubernetes.objects import (
    DEFAULT_TIMING,
    OBJECTIVE_GROUP,
    OBJECTIVE_PLURAL,
    OBJECTIVE_VERSION,
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    DiscoveryError,
    ObjectivePriorities,
    PoolSpec,
    RawObject,
    WatchTiming,
    objective_priority,
    pod_endpoints,
)
from epp.datastore.kubernetes.reflector import _Delta, _Listed, _Reflector
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.endpoint import Endpoint, EndpointId

log = logging.getLogger(__name__)

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
        timing: WatchTiming = DEFAULT_TIMING,
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
