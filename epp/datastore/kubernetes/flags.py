"""Kubernetes discovery, the command line: ``epp serve`` flags and the source they build."""

from __future__ import annotations

import argparse
import logging

from epp.datastore.kubernetes.objects import ObjectivePriorities
from epp.datastore.kubernetes.source import KubernetesSource
from epp.datastore.store import Datastore
from epp.errors import ConfigError

log = logging.getLogger(__name__)

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
