"""The chart wires prefix-index sync (docs/sync.md) when there is more than one replica: a
headless Service over the epp pods, --peer-dns naming it, the sync port and POD_IP."""

from __future__ import annotations

import subprocess

import pytest

from epp.cli import build_parser, sync_options
from tests.integration.test_deploy import (
    CHART,
    VALUES,
    by_kind,
    docs_of,
    one,
    run,
    tool,
    validate_schema,
)


def render(*args: str) -> list[dict]:  # type: ignore[type-arg]
    return docs_of(run(tool("helm"), "template", "llama", str(CHART), "-n", "models", *args))


def container(docs: list[dict]) -> dict:  # type: ignore[type-arg]
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def headless(docs: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]


@pytest.mark.parametrize(
    ("args", "on"),
    [
        ([], False),  # replicaCount 1: nobody to sync with
        (["--set", "replicaCount=3"], True),
        (VALUES["pool"], True),  # replicaCount 2
        (["--set", "replicaCount=3", "--set", "sync.enabled=false"], False),
        (["--set", "sync.enabled=true"], True),  # e.g. scaled later by an autoscaler
    ],
)
def test_sync_follows_replica_count_unless_forced(args: list[str], on: bool) -> None:
    docs = render(*args)
    flags = [a for a in container(docs)["args"] if a.startswith(("--peer-dns=", "--sync-port="))]
    assert bool(flags) == on
    assert bool(headless(docs)) == on


def test_peer_dns_names_the_headless_service_that_selects_the_epp_pods() -> None:
    docs = render("--set", "replicaCount=3")
    validate_schema(docs)
    (peers,) = headless(docs)
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]
    assert peers["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert peers["spec"]["publishNotReadyAddresses"] is True
    (port,) = peers["spec"]["ports"]
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert container_ports[port["targetPort"]] == port["port"] == 9004

    args = c["args"]
    assert "--sync-port=9004" in args
    assert f"--peer-dns={peers['metadata']['name']}.models.svc:9004" in args
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # the rendered flags are ones epp accepts
    opts = sync_options(build_parser().parse_args([*args, "--endpoints", "10.0.0.1:8000"]))
    assert opts is not None and opts.peer_dns is not None and opts.port == 9004


def test_helm_rejects_a_non_boolean_sync_enabled() -> None:
    done = subprocess.run(
        [tool("helm"), "template", "x", str(CHART), "--set-string", "sync.enabled=yes"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode != 0
    assert "sync.enabled" in done.stderr


def test_sync_tls_comes_from_a_secret_and_its_flags_are_accepted() -> None:
    docs = render("--set", "replicaCount=3", "--set", "sync.tls.secretName=epp-sync-tls")
    validate_schema(docs)
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "sync-tls"]
    assert vol["secret"]["secretName"] == "epp-sync-tls"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "sync-tls"]
    args = c["args"]
    for flag, key in (("--sync-cert", "tls.crt"), ("--sync-key", "tls.key"), ("--sync-ca", "ca.crt")):
        assert f"{flag}={mount['mountPath']}/{key}" in args
    opts = sync_options(build_parser().parse_args([*args, "--endpoints", "10.0.0.1:8000"]))
    assert opts is not None and opts.tls is not None and opts.tls.server_name == "epp-sync"
    assert opts.warm_timeout_s == 10 and opts.max_subscribers == 32
    plain = container(render("--set", "replicaCount=3"))
    assert not any(a.startswith("--sync-cert") for a in plain["args"])
