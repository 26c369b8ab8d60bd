"""The chart wires prefix-index sync (docs/sync.md) when there is more than one replica: a
headless Service over the epp pods, --peer-dns naming it, the sync port and POD_IP."""

from __future__ import annotations

import base64
import dataclasses
import subprocess
from pathlib import Path

import grpc
import pytest

from epp.cli import build_parser, sync_options
from epp.sync.gen import sync_pb2, sync_pb2_grpc
from tests.integration.extproc_fixtures import pool, start_epp, stop_epp
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
from tests.integration.test_sync import connect, connected, until
from tests.integration.test_sync import sync_options as fast_sync
from tests.integration.test_sync_security import make_pki, needs_openssl


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
    plain = container(render("--set", "replicaCount=3", "--set", "sync.tls.generate=false"))
    assert not any(a.startswith("--sync-cert") for a in plain["args"])
    # plaintext is chosen explicitly, or epp would refuse to start its sync
    assert "--sync-insecure" in plain["args"] and "--sync-insecure" not in args
    opts = sync_options(build_parser().parse_args([*plain["args"], "--endpoints", "10.0.0.1:8000"]))
    assert opts is not None and opts.tls is None


def test_the_network_policy_admits_the_gateway_epp_and_monitoring_each_to_its_port() -> None:
    docs = render("--set", "replicaCount=2")
    validate_schema(docs)
    policy = one(docs, "NetworkPolicy")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    rules = {tuple(p["port"] for p in r["ports"]): r["from"] for r in policy["spec"]["ingress"]}
    gateway = rules[(9002, 9003)]
    assert gateway[0]["podSelector"]["matchExpressions"][0]["key"] == (
        "gateway.networking.k8s.io/gateway-name")
    (peers,) = rules[(9004,)]  # sync: epp's own pods only
    assert peers == {"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}
    assert (9090,) in rules
    assert not by_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy")


@needs_openssl
async def test_the_default_chart_authenticates_sync_refusing_strangers_and_fake_peers(
    tmp_path: Path,
) -> None:
    """Installed with defaults and two replicas, the chart generates a CA and a certificate
    and gives every pod --sync-cert/--sync-key/--sync-ca: epp started with exactly those
    settings serves its peer, and refuses a plaintext subscriber, a subscriber with another
    CA's certificate, and a peer that cannot show a certificate from the chart's CA."""
    docs = render("--set", "replicaCount=2")
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("sync-tls")]
    assert secret["type"] == "kubernetes.io/tls"
    files = {}
    for key in ("tls.crt", "tls.key", "ca.crt"):
        files[key] = tmp_path / key
        files[key].write_bytes(base64.b64decode(secret["data"][key]))
    c = container(docs)
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "sync-tls")
    args = [a.replace(mount, str(tmp_path)) for a in c["args"]]
    opts = sync_options(build_parser().parse_args([*args, "--endpoints", "10.0.0.1:8000"]))
    assert opts is not None and opts.tls is not None
    tls = opts.tls
    a = await start_epp(pool(4), sync=dataclasses.replace(fast_sync(), tls=tls))
    b = await start_epp(pool(4), sync=dataclasses.replace(fast_sync(), tls=tls))
    fake = await start_epp(pool(4), sync=dataclasses.replace(
        fast_sync(), tls=make_pki(tmp_path, "stranger")))  # fmt: skip
    try:
        connect([a, b])
        await until(lambda: connected(b, [a]), "b follows a with the chart's certificate")
        target = f"127.0.0.1:{a.handle.sync_port}"
        async with grpc.aio.insecure_channel(target) as ch:  # an unauthenticated subscriber
            call = sync_pb2_grpc.IndexSyncStub(ch).Subscribe(sync_pb2.SubscribeRequest(replica_id="x"))
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        # a fake peer: b is pointed at it and never accepts its stream
        assert b.handle.sync is not None and fake.handle.sync is not None
        fake_target = f"127.0.0.1:{fake.handle.sync_port}"
        b.handle.sync.peers.update([target, fake_target])
        fake.handle.sync.peers.update([target])  # nor does a accept it as a subscriber
        b_sync, fake_sync = b.handle.sync, fake.handle.sync
        await until(lambda: b_sync.follow_failures[fake_target] >= 3
                    and fake_sync.follow_failures[target] >= 3,
                    "three refused attempts each way")  # fmt: skip
        assert not connected(b, [fake]) and connected(b, [a])
        assert not connected(fake, [a])
    finally:
        for r in (a, b, fake):
            await stop_epp(r)


async def test_ext_proc_tls_from_the_chart_serves_with_the_generated_certificate(
    tmp_path: Path,
) -> None:
    """extProc.tls.enabled: the chart generates a CA and a certificate for the Service's DNS
    names and passes --cert/--key; epp started with exactly those flags serves ext_proc over
    TLS that verifies against the CA under the Service's name, and refuses plaintext."""
    assert not [d for d in by_kind(render(), "Secret") if "extproc" in d["metadata"]["name"]]
    docs = render("--set", "extProc.tls.enabled=true")
    validate_schema(docs)
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("extproc-tls")]
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    c = container(docs)
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "extproc-tls")
    args = build_parser().parse_args(
        [a.replace(mount, str(tmp_path)) for a in c["args"] if a.startswith(("serve", "--cert", "--key"))]
    )
    epp = await start_epp(cert_file=args.cert, key_file=args.key)
    service = one(docs, "Service")["metadata"]["name"]
    creds = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "ca.crt").read_bytes())
    target = f"127.0.0.1:{epp.handle.grpc_port}"
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        name = ("grpc.ssl_target_name_override", f"{service}.models.svc")
        async with grpc.aio.secure_channel(target, creds, options=[name]) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(target) as ch:  # plaintext is refused
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    finally:
        await stop_epp(epp)
