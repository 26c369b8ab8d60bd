"""Pure parts of Kubernetes discovery: pod membership, pool specs, flags, priorities."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from epp.datastore.kubernetes import (
    ObjectivePriorities,
    PoolSpec,
    add_kubernetes_flags,
    objective_priority,
    pod_endpoints,
    source_from_args,
)
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from tests.fake_k8s import objective, pod, pool

SPEC = PoolSpec(match_labels={"app": "vllm"}, target_ports=(8000,))


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (pod("a", "10.0.0.1"), ["10.0.0.1:8000"]),
        (pod("a", "10.0.0.1", ready=False), []),
        (pod("a", "10.0.0.1", terminating=True), []),
        (pod("a", None), []),
        (pod("a", "10.0.0.1", {"app": "other"}), []),
        (pod("a", "fd00::1"), ["[fd00::1]:8000"]),
        ({"metadata": {"name": "bare", "labels": {"app": "vllm"}}}, []),
    ],
    ids=["ready", "unready", "terminating", "no-ip", "other-labels", "ipv6", "no-status"],
)
def test_pod_membership(obj: dict[str, Any], expected: list[str]) -> None:
    assert [e.id for e in pod_endpoints(obj, SPEC)] == expected


def test_one_endpoint_per_target_port_with_labels_and_metrics_port() -> None:
    spec = PoolSpec(match_labels={"app": "vllm"}, target_ports=(8000, 8001))
    eps = pod_endpoints(pod("a", "10.0.0.1", {"app": "vllm", "zone": "b"}), spec)
    assert [(e.id, e.port, e.metrics_port, e.rank) for e in eps] == [
        ("10.0.0.1:8000", 8000, 8000, 0),
        ("10.0.0.1:8001", 8001, 8001, 1),  # a data-parallel rank per port, in order
    ]
    assert dict(eps[0].labels) == {"app": "vllm", "zone": "b"}


def test_pool_spec_from_v1_pool() -> None:
    spec = PoolSpec.from_pool(pool("p", {"app": "vllm", "model": "llama"}, [8000]))
    assert dict(spec.match_labels or {}) == {"app": "vllm", "model": "llama"}
    assert spec.target_ports == (8000,)
    assert spec.label_selector() == "app=vllm,model=llama"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["selector"].pop("matchLabels"), "spec.selector.matchLabels"),
        (lambda s: s.__setitem__("targetPorts", []), "spec.targetPorts"),
        (lambda s: s.__setitem__("targetPorts", [{"number": 0}]), r"spec.targetPorts\[0\].number"),
        (lambda s: s.__setitem__("targetPorts", [{"name": "x"}]), r"spec.targetPorts\[0\].number"),
    ],
)
def test_bad_pool_names_the_field(mutate: Any, field: str) -> None:
    obj = pool("p", {"app": "vllm"}, [8000])
    mutate(obj["spec"])
    with pytest.raises(ValueError, match=field):
        PoolSpec.from_pool(obj)


def test_objective_priority_defaults_to_zero() -> None:
    assert objective_priority(objective("a", "p", 7)) == 7
    assert objective_priority(objective("a", "p", None)) == 0


def test_objective_priorities_map() -> None:
    prios = ObjectivePriorities({"a": 1})
    prios.set("b", -3)
    assert (prios.priority_of("a"), prios.priority_of("b"), prios.priority_of("c")) == (1, -3, None)
    prios.discard("b")
    prios.replace({"z": 9})
    assert prios.snapshot() == {"a": 1, "z": 9}


def test_discovered_objectives_override_but_never_erase_configured_ones() -> None:
    prios = ObjectivePriorities({"chat": 1})
    prios.replace({"chat": 5})
    assert prios.priority_of("chat") == 5
    prios.replace({})  # the objective was deleted from the cluster
    assert prios.priority_of("chat") == 1


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kubernetes_flags(parser)
    return parser.parse_args(argv)


def test_flags_build_a_pool_source() -> None:
    source = source_from_args(parse("--pool-name", "llama", "--pool-namespace", "ml"), Datastore())
    assert source is not None and source.describe() == "InferencePool ml/llama"


def test_flags_build_a_selector_source() -> None:
    args = parse("--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000,8001")
    assert args.endpoint_target_ports == [8000, 8001]
    source = source_from_args(args, Datastore())
    assert source is not None and source.pool_spec == PoolSpec(None, (8000, 8001))


def test_no_discovery_flags_means_no_source() -> None:
    assert source_from_args(parse(), Datastore()) is None


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--pool-name", "p", "--endpoint-selector", "app=x"], "--endpoint-selector"),
        (["--endpoint-selector", "app=x"], "--endpoint-target-ports"),
        (["--pool-name", "p", "--endpoint-target-ports", "8000"], "--endpoint-target-ports"),
        (["--endpoint-target-ports", "8000"], "--endpoint-target-ports"),
        (
            ["--endpoint-selector", "app=x", "--endpoint-target-ports", "70000"],
            "--endpoint-target-ports",
        ),
    ],
)
def test_inconsistent_flags_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        source_from_args(parse(*argv), Datastore())
    assert info.value.field == field


def test_bad_port_list_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse("--endpoint-target-ports", "http")
