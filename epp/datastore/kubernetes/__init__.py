"""Kubernetes discovery: the pods of an InferencePool (or of a label selector) as endpoints.

``objects`` reads the API's objects (pool specs, pod membership, objective priorities);
``reflector`` keeps one collection in sync on its own thread (list, watch, re-list, back
off); ``source`` applies the changes to the datastore on the serving loop; ``flags`` wires
``epp serve``'s command line. The names below are the package's interface.
"""

from epp.datastore.kubernetes.flags import add_kubernetes_flags, source_from_args
from epp.datastore.kubernetes.objects import (
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
    pod_is_member,
)
from epp.datastore.kubernetes.reflector import describe_error
from epp.datastore.kubernetes.source import (
    KubernetesSource,
    api_client_for,
    load_api_client,
)

__all__ = [
    "OBJECTIVE_GROUP",
    "OBJECTIVE_PLURAL",
    "OBJECTIVE_VERSION",
    "POOL_GROUP",
    "POOL_PLURAL",
    "POOL_VERSION",
    "DiscoveryError",
    "KubernetesSource",
    "ObjectivePriorities",
    "PoolSpec",
    "RawObject",
    "WatchTiming",
    "add_kubernetes_flags",
    "api_client_for",
    "describe_error",
    "load_api_client",
    "objective_priority",
    "pod_endpoints",
    "pod_is_member",
    "source_from_args",
]
