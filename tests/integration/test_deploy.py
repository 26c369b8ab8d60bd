"""deploy/: the Helm chart and kustomize overlays render to valid, consistent manifests; the
Envoy bootstrap parses into Envoy's own protos; the examples and the dashboard hold together.

helm and kubectl come from ``deploy/tools/fetch-tools.sh`` (``.tools/bin``) or PATH; without
them the tests that need them skip on a developer's machine and fail in CI (``CI`` set), where
``.ci/run`` fetches them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config.loader import loads_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "charts" / "epp"
OVERLAYS = sorted(
    p.parent for p in (DEPLOY / "kustomize" / "overlays").glob("*/kustomization.yaml")
)
KUBE_VERSION = "1.30.0"

Doc = dict[str, Any]

# Kinds without an upstream JSON schema in kubernetes-validate: checked structurally here.
CRD_KINDS = {
    "InferencePool",
    "HTTPRoute",
    "Gateway",
    "GatewayClass",
    "ServiceMonitor",
    "PodMonitor",
    "DestinationRule",
    "BackendTrafficPolicy",
    "EnvoyExtensionPolicy",
    "EnvoyFilter",
    "GatewayExtension",
    "TrafficPolicy",
}

def shipped_default() -> dict[str, Any]:
    """The shipped default profile's document: what the chart and kustomize install."""
    from importlib import resources

    text = resources.files("epp.config").joinpath("profiles/default.yaml").read_text()
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


EXPECTED_PLUGINS = [p["type"] for p in shipped_default()["plugins"]]


def tool(name: str) -> str:
    local = ROOT / ".tools" / "bin" / name
    found = str(local) if os.access(local, os.X_OK) else shutil.which(name)
    if found is None:
        if os.environ.get("CI"):  # CI fetches them: their absence there is a failure
            pytest.fail(f"{name} not installed in CI (deploy/tools/fetch-tools.sh failed?)")
        pytest.skip(f"{name} not installed (run deploy/tools/fetch-tools.sh)")
    return found


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stderr}{done.stdout}"
    return done.stdout


def docs_of(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: Iterable[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Iterable[Doc], kind: str) -> Doc:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def client_service(docs: Iterable[Doc]) -> Doc:
    """The Service Envoy and Prometheus reach epp through (with several replicas the chart
    adds a headless one for index sync between them: see test_deploy_sync.py)."""
    return one((d for d in docs if d["kind"] != "Service" or d["spec"].get("clusterIP") != "None"),
               "Service")


# --- validation --------------------------------------------------------------------------


NPM_MODELS = ROOT / ".tools" / "npm"
SCHEMA_KINDS = {"Gateway", "GatewayClass", "HTTPRoute", "DestinationRule", "ServiceMonitor",
                "PodMonitor", "BackendTrafficPolicy", "EnvoyExtensionPolicy", "EnvoyFilter"}  # fmt: skip
"""Custom resources validated against their CRDs' OpenAPI schemas (deploy/tools/
validate-crs.mjs over the @kubernetes-models packages); InferencePool and kgateway's
GatewayExtension and TrafficPolicy, which have no such package, only structurally."""


def validate_custom_resources(docs: list[Doc]) -> None:
    node = shutil.which("node")
    models = NPM_MODELS / "node_modules" / "@kubernetes-models"
    if node is None or not models.is_dir():
        if os.environ.get("CI"):
            pytest.fail("node or the CRD schemas missing in CI (deploy/tools/fetch-tools.sh failed?)")
        pytest.skip("CRD schemas not installed (run deploy/tools/fetch-tools.sh)")
    done = subprocess.run(
        [node, str(DEPLOY / "tools" / "validate-crs.mjs")], input=json.dumps(docs),
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "EPP_NPM_MODULES": str(NPM_MODELS)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for doc, error in zip(docs, json.loads(done.stdout), strict=True):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert error != "unknown", f"{where}: no schema for {doc['apiVersion']}"
        assert error is None, f"{where}: {error}"


def validate_schema(docs: list[Doc]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            validate_crd_structure(doc)
        else:
            kv.validate(doc, KUBE_VERSION, strict=True)
    custom = [d for d in docs if d["kind"] in SCHEMA_KINDS]
    if custom:
        validate_custom_resources(custom)


def _is_port(value: Any) -> bool:
    return isinstance(value, int) and 0 < value < 65536


def validate_crd_structure(doc: Doc) -> None:
    kind, spec, name = doc["kind"], doc.get("spec") or {}, doc["metadata"]["name"]
    where = f"{kind}/{name}"
    if kind == "InferencePool":
        assert doc["apiVersion"] == "inference.networking.k8s.io/v1", where
        labels = spec["selector"]["matchLabels"]
        assert labels and all(isinstance(v, str) for v in labels.values()), where
        ports = spec["targetPorts"]
        assert len(ports) == 1 and _is_port(ports[0]["number"]), where
        ref = spec["endpointPickerRef"]
        assert ref["name"] and _is_port(ref["port"]["number"]), where
        assert ref.get("kind", "Service") == "Service", where
        assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose"), where
    elif kind == "HTTPRoute":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1", where
        assert spec["parentRefs"], where
        for rule in spec["rules"]:
            for ref in rule["backendRefs"]:
                assert ref["group"] == "inference.networking.k8s.io", where
                assert ref["kind"] == "InferencePool", where
    elif kind == "Gateway":
        assert spec["gatewayClassName"] and spec["listeners"], where
    elif kind == "GatewayClass":
        assert "/" in spec["controllerName"], where
    elif kind == "DestinationRule":
        assert doc["apiVersion"] == "networking.istio.io/v1", where
        assert spec["host"].endswith(".svc.cluster.local"), where
        assert spec["trafficPolicy"]["tls"]["mode"] in ("DISABLE", "SIMPLE", "MUTUAL"), where
    elif kind in ("BackendTrafficPolicy", "EnvoyExtensionPolicy"):
        assert doc["apiVersion"] == "gateway.envoyproxy.io/v1alpha1", where
        assert spec["targetRefs"], where
    elif kind == "EnvoyFilter":
        assert doc["apiVersion"] == "networking.istio.io/v1alpha3", where
        assert spec["configPatches"], where
    elif kind == "GatewayExtension":
        assert doc["apiVersion"] == "gateway.kgateway.dev/v1alpha1", where
        assert spec["type"] == "ExtProc", where
        ref = spec["extProc"]["grpcService"]["backendRef"]
        assert ref["name"] and _is_port(ref["port"]), where
        mode = spec["extProc"]["processingMode"]
        assert mode["requestBodyMode"] in ("BUFFERED", "FULL_DUPLEX_STREAMED"), where
    elif kind == "TrafficPolicy":
        assert doc["apiVersion"] == "gateway.kgateway.dev/v1alpha1", where
        assert spec["targetRefs"] and spec["extProc"]["extensionRef"]["name"], where
    elif kind in ("ServiceMonitor", "PodMonitor"):
        assert doc["apiVersion"] == "monitoring.coreos.com/v1", where
        endpoints = spec.get("endpoints") or spec.get("podMetricsEndpoints")
        assert endpoints and all(e["port"] for e in endpoints), where
        assert spec["selector"]["matchLabels"], where


ROUTER_COMPONENT = "model-router"


def is_router(doc: Doc) -> bool:
    """An object of epp model-router (the chart's modelRouter, the models overlay)."""
    return bool((doc["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == ROUTER_COMPONENT)


def check_epp_manifests(docs: list[Doc], *, pool: bool, config: str = "") -> None:
    """What a cluster needs from epp's manifests, whichever tool rendered them; the
    scheduling config is the shipped default, or the file ``config`` when given. The model
    router's objects, when there are any, are checked by ``check_router_manifests``."""
    validate_schema(docs)
    router = [d for d in docs if is_router(d)]
    docs = [d for d in docs if not is_router(d)]
    if router:
        check_router_manifests(router, docs)
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "serve"
    for flag in ("--grpc-port=9002", "--health-port=9003", "--metrics-port=9090"):
        assert flag in args
    assert "--config=/etc/epp/config.yaml" in args

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert mounts["config"] == "/etc/epp"
    config_map = one(docs, "ConfigMap")
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    text = config_map["data"]["config.yaml"]
    loads_config(text)  # epp starts with it
    scheduling = yaml.safe_load(text)
    assert scheduling["kind"] == "EndpointPickerConfig"
    if config:
        assert scheduling == yaml.safe_load((ROOT / config).read_text())
    else:
        assert [p["type"] for p in scheduling["plugins"]] == EXPECTED_PLUGINS
        (profile,) = scheduling["schedulingProfiles"]
        (shipped,) = shipped_default()["schedulingProfiles"]
        assert profile["plugins"] == shipped["plugins"]  # the shipped default, weights and all

    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc.get("runAsNonRoot") or pod["securityContext"].get("runAsNonRoot")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 9003
    assert container["resources"]["requests"]

    service = client_service(docs)
    assert {p["port"] for p in service["spec"]["ports"]} == {9002, 9003, 9090}
    selector = service["spec"]["selector"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items(), "the Service selects no epp pod"
    account = one(docs, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]

    flags = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    if pool:
        assert "--endpoints" not in flags
        assert pod["automountServiceAccountToken"] is True
        role = one(docs, "Role")
        granted = {
            (group, resource): sorted(rule["verbs"])
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
        }
        assert granted == {
            ("", "pods"): ["get", "list", "watch"],
            ("inference.networking.k8s.io", "inferencepools"): ["get", "list", "watch"],
            ("inference.networking.x-k8s.io", "inferenceobjectives"): ["get", "list", "watch"],
        }
        binding = one(docs, "RoleBinding")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["name"] == account["metadata"]["name"]
        for pool_doc in by_kind(docs, "InferencePool"):
            assert flags["--pool-name"] == pool_doc["metadata"]["name"]
            ref = pool_doc["spec"]["endpointPickerRef"]
            assert ref["name"] == service["metadata"]["name"]
            assert ref["port"]["number"] == 9002
    else:
        assert "--pool-name" not in flags
        assert re.fullmatch(r"[\d.]+:\d+(,[\d.]+:\d+)*", flags["--endpoints"])
        assert not by_kind(docs, "Role") and not by_kind(docs, "InferencePool")
        assert pod["automountServiceAccountToken"] is False


def check_router_manifests(router: list[Doc], epp: list[Doc]) -> None:
    """epp model-router's objects: its args parse as epp's CLI reads them, its pools file
    loads, its Service selects its pods and no epp pod, and epp's Service none of its pods."""
    from epp.cli import build_parser
    from epp.modelrouter.pools import load_pools_file

    deployment = one(router, "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[0] == "model-router"
    parsed = build_parser().parse_args(args)
    assert parsed.pools.startswith("/etc/epp-model-router/")
    config_map = one(router, "ConfigMap")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "pools")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert parsed.pools == f"{mounts['pools']}/pools.yaml"
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(config_map["data"]["pools.yaml"])
        f.flush()
        pools = load_pools_file(f.name)
    assert len(pools.pools) >= 2
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == parsed.health_port
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    labels = pod["metadata"]["labels"]
    service = one(router, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in service["spec"]["ports"]} == {parsed.grpc_port, parsed.health_port,
                                                             parsed.metrics_port}  # fmt: skip
    epp_pod = one(epp, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= epp_pod.items()
    assert not client_service(epp)["spec"]["selector"].items() <= labels.items()
    if parsed.adapter_configmaps_namespace:
        role = one(router, "Role")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                                  "verbs": ["get", "list", "watch"]}]  # fmt: skip
        assert pod["spec"]["automountServiceAccountToken"] is True


# --- Helm --------------------------------------------------------------------------------


VALUES = {
    "default": [],
    "pool": ["-f", str(CHART / "ci" / "pool-values.yaml")],
    "static": ["-f", str(CHART / "ci" / "static-values.yaml")],
    "models": ["-f", str(DEPLOY / "examples" / "model-router-values.yaml")],
}


@pytest.mark.parametrize("values", sorted(VALUES))
def test_helm_lint(values: str) -> None:
    out = run(tool("helm"), "lint", "--strict", str(CHART), *VALUES[values])
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", sorted(VALUES))
def test_helm_template_renders_valid_manifests(values: str) -> None:
    docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), *VALUES[values]))
    check_epp_manifests(docs, pool=values != "static")


def test_helm_default_creates_the_pool_epp_watches() -> None:
    docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), "-n", "models"))
    pool = one(docs, "InferencePool")
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    assert "--pool-namespace=models" in args
    assert pool["metadata"]["namespace"] == "models"


def test_helm_pool_values_add_pdb_and_service_monitor() -> None:
    docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), *VALUES["pool"]))
    assert not by_kind(docs, "InferencePool")  # the pool exists already
    assert one(docs, "Role")["metadata"]["namespace"] == "models"
    pdb = one(docs, "PodDisruptionBudget")
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitor = one(docs, "ServiceMonitor")
    port_names = {p["name"] for p in client_service(docs)["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["port"] in port_names


def test_helm_precise_values_add_the_producer_epp_accepts_and_mount_tokenizers() -> None:
    from epp.config.loader import parse_config
    from epp.plugins.preciseprefix import PreciseIndexConfig

    values = ["-f", str(CHART / "ci" / "precise-values.yaml")]
    assert "0 chart(s) failed" in run(tool("helm"), "lint", "--strict", str(CHART), *values)
    docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), *values))
    validate_schema(docs)
    raw = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])
    cfg = parse_config(raw, "<helm>")
    assert cfg.producers == ("approx-prefix-cache-producer", "precise-prefix-cache-producer")
    params = cfg.plugins["precise-prefix-cache-producer"].params
    assert isinstance(params, PreciseIndexConfig)
    assert (params.events_mode, params.events_port, params.replay_port) == ("connect", 5557, 5558)
    assert params.tokenizer_dir == "/etc/epp/tokenizers"
    assert params.lora_paths == {"sql-lora": "/adapters/sql-lora"}
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["tokenizers"] == "/etc/epp/tokenizers"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tokenizers"]
    assert volume["persistentVolumeClaim"]["claimName"] == "tokenizers"


def test_helm_rejects_static_mode_without_endpoints() -> None:
    done = subprocess.run(
        [tool("helm"), "template", "x", str(CHART), "--set", "discovery.mode=static"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "discovery.static.endpoints" in done.stderr


# --- kustomize ---------------------------------------------------------------------------


def test_there_are_five_overlays() -> None:
    assert {p.name for p in OVERLAYS} == {"pool-discovery", "static-endpoints", "ha", "pd", "models"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_kustomize_overlay_renders_valid_manifests(overlay: Path) -> None:
    docs = docs_of(run(tool("kubectl"), "kustomize", str(overlay)))
    # the pd overlay installs the shipped pd profile (its copy must equal it)
    config = "epp/config/profiles/pd.yaml" if overlay.name == "pd" else ""
    check_epp_manifests(docs, pool=overlay.name in ("pool-discovery", "ha", "pd", "models"),
                        config=config)  # fmt: skip


def test_pd_overlay_watches_the_pd_example_pool() -> None:
    docs = docs_of(run(tool("kubectl"), "kustomize", str(DEPLOY / "kustomize/overlays/pd")))
    pool = one(docs, "InferencePool")
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--pool-name={pool['metadata']['name']}" in args
    example = by_kind(docs_of((DEPLOY / "examples/vllm-pd-deployment.yaml").read_text()), "Deployment")
    roles = set()
    for servers in example:
        labels = servers["spec"]["template"]["metadata"]["labels"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        roles.add(labels["llm-d.ai/role"])
    assert roles == {"prefill", "decode"}


def test_ha_overlay_wires_index_sync_between_replicas() -> None:
    docs = docs_of(run(tool("kubectl"), "kustomize", str(DEPLOY / "kustomize/overlays/ha")))
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--peer-dns=epp-peers.$(POD_NAMESPACE).svc:9004" in container["args"]
    # plaintext sync, chosen explicitly: epp parses these flags (it refuses it otherwise)
    from epp.cli import build_parser, sync_options

    flags = [a.replace("$(POD_NAMESPACE)", "models") for a in container["args"]]
    opts = sync_options(build_parser().parse_args([*flags, "--endpoints", "10.0.0.1:8000"]))
    assert "--sync-insecure" in container["args"] and opts is not None and opts.tls is None
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["POD_NAMESPACE"]  # expanded into --peer-dns by the kubelet
    assert {"name": "grpc-sync", "containerPort": 9004} in container["ports"]
    peers = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "epp-peers")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    assert peers["spec"]["ports"][0]["targetPort"] == "grpc-sync"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert peers["spec"]["selector"].items() <= pod_labels.items()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


# --- static examples ---------------------------------------------------------------------


STATIC_MANIFESTS = sorted(
    [*(DEPLOY / "gateways").glob("*/*.yaml"),
     *(p for p in (DEPLOY / "examples").glob("*.yaml") if not p.name.endswith("-values.yaml"))]
)


@pytest.mark.parametrize("path", STATIC_MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_example_manifests_are_valid(path: Path) -> None:
    validate_schema(docs_of(path.read_text()))


def test_every_gateway_routes_to_the_pool_the_overlay_creates() -> None:
    pool = docs_of((DEPLOY / "kustomize/overlays/pool-discovery/inferencepool.yaml").read_text())
    pool_name = pool[0]["metadata"]["name"]
    gateways = sorted(p for p in (DEPLOY / "gateways").glob("*/*.yaml")
                      if by_kind(docs_of(p.read_text()), "Gateway"))  # fmt: skip
    assert {p.parent.name for p in gateways} == {"istio", "envoy-gateway", "kgateway"}
    for path in gateways:
        docs = docs_of(path.read_text())
        gateway = one(docs, "Gateway")
        route = one(docs, "HTTPRoute")
        assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
        assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool_name, path


MODEL_ROUTES = sorted((DEPLOY / "gateways").glob("*/models.yaml"))


@pytest.mark.parametrize("path", MODEL_ROUTES, ids=lambda p: p.parent.name)
def test_each_gateways_models_example_routes_every_pool_by_the_routers_header(path: Path) -> None:
    """Every pool the router's values name has a rule matching its base model on
    X-Gateway-Base-Model-Name, to the InferencePool the walk-through installs for it; a last
    rule without the header; the router's ext_proc points at the Service the chart makes for
    the release llama, reads the whole body and fails closed."""
    assert {p.parent.name for p in MODEL_ROUTES} == {"istio", "envoy-gateway", "kgateway"}
    docs = docs_of(path.read_text())
    rules = one(docs, "HTTPRoute")["spec"]["rules"]
    values = yaml.safe_load((DEPLOY / "examples/model-router-values.yaml").read_text())
    pools = {"meta-llama/Llama-3.1-8B-Instruct": "vllm-llama3-8b-instruct",
             "Qwen/Qwen2.5-Coder-7B-Instruct": "vllm-qwen2-5-coder-7b-instruct"}  # fmt: skip
    assert {m for p in values["modelRouter"]["pools"] for m in p["models"]} == set(pools)
    matched = {}
    for rule in rules[:-1]:
        (match,) = rule["matches"]
        (header,) = match["headers"]
        assert header["name"].lower() == "x-gateway-base-model-name" and header["type"] == "Exact"
        matched[header["value"]] = rule["backendRefs"][0]["name"]
    assert matched == pools
    assert "headers" not in rules[-1]["matches"][0]
    router_docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), "-n", "default",
                              *VALUES["models"]))  # fmt: skip
    service = one([d for d in router_docs if is_router(d)], "Service")["metadata"]["name"]
    text = path.read_text()
    if path.parent.name == "istio":
        assert f"outbound|9005||{service}.default.svc.cluster.local" in text
        assert "request_body_mode: BUFFERED" in text and "failure_mode_allow: false" in text
    elif path.parent.name == "envoy-gateway":
        (ext,) = one(docs, "EnvoyExtensionPolicy")["spec"]["extProc"]
        assert ext["backendRefs"][0] == {"name": service, "port": 9005}
        assert ext["processingMode"]["request"]["body"] == "Buffered" and ext["failOpen"] is False
    else:
        ext = one(docs, "GatewayExtension")["spec"]["extProc"]
        assert ext["grpcService"]["backendRef"] == {"name": service, "port": 9005}
        assert ext["failOpen"] is False


def test_vllm_example_matches_the_pool_and_caches_prefixes() -> None:
    docs = docs_of((DEPLOY / "examples" / "vllm-deployment.yaml").read_text())
    pod = one(docs, "Deployment")["spec"]["template"]
    pool = docs_of((DEPLOY / "kustomize/overlays/pool-discovery/inferencepool.yaml").read_text())[0]
    labels = pod["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["inference.networking.k8s.io/engine-type"] == "vllm"
    (container,) = pod["spec"]["containers"]
    assert "--enable-prefix-caching" in container["args"]
    ports = {p["containerPort"] for p in container["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] in ports
    assert container["readinessProbe"]


def test_pd_example_has_both_roles_and_a_sidecar_on_the_pool_port() -> None:
    """The P/D example: prefillers serve vLLM on the pool's port; decoders put epp's
    pd-sidecar (the chart's image) there in front of vLLM; both share the pool's label."""
    docs = by_kind(docs_of((DEPLOY / "examples" / "vllm-pd-deployment.yaml").read_text()), "Deployment")
    pods = {d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]: d["spec"]["template"]
            for d in docs}  # fmt: skip
    assert set(pods) == {"prefill", "decode"}
    apps = {p["metadata"]["labels"]["app"] for p in pods.values()}
    assert apps == {"vllm-llama3-8b-instruct-pd"}
    (prefill,) = pods["prefill"]["spec"]["containers"]
    assert "--port=8000" in prefill["args"]
    sidecar, server = pods["decode"]["spec"]["containers"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert sidecar["image"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert sidecar["command"] == ["epp", "pd-sidecar"] and "--port=8000" in sidecar["args"]
    decoder = next(a for a in sidecar["args"] if a.startswith("--decoder="))
    assert decoder.endswith(":8200") and "--port=8200" in server["args"]
    allowed = next(a for a in sidecar["args"] if a.startswith("--allowed-prefillers="))
    assert allowed.endswith(":8000")  # the prefillers' port, nothing else on their pods
    from epp.cli import build_parser  # the sidecar's flags parse as written

    build_parser().parse_args(["pd-sidecar", *sidecar["args"]])


# --- Envoy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["envoy.yaml", "envoy-observer.yaml", "envoy-fail-closed.yaml"]
)
def test_envoy_bootstraps_parse_into_envoy_protos(name: str) -> None:
    """Every field of the shipped bootstraps is one of Envoy's (real Envoy validates them in
    tests/envoy); the routing filter, the observer and the clusters are where the rest of the
    suite expects them."""
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.extensions.access_loggers.grpc.v3 import als_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
    from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
    from envoy.extensions.filters.http.router.v3 import router_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
    from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
    from envoy.extensions.resource_monitors.downstream_connections.v3 import (
        downstream_connections_pb2,
    )
    from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
    from google.protobuf import json_format

    # ParseDict resolves each typed_config Any against the types imported so far, and
    # rejects unknown fields anywhere in the tree
    assert router_pb2.Router and http_protocol_options_pb2.HttpProtocolOptions
    assert header_mutation_pb2.HeaderMutation
    assert least_request_pb2 and override_host_pb2 and previous_hosts_pb2
    assert downstream_connections_pb2 and als_pb2.HttpGrpcAccessLogConfig

    raw = yaml.safe_load((DEPLOY / "envoy" / name).read_text())
    # xds-protos predates Envoy 1.40's ai_protocol_manager (the response summary's usage
    # reader); real Envoy validates it (tests/envoy/test_configs.py), here it is set aside
    listed = raw["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    usage = [f for f in listed["http_filters"] if f["name"] == "envoy.filters.http.ai_protocol_manager"]
    listed["http_filters"] = [f for f in listed["http_filters"] if f not in usage]
    assert len(usage) == (0 if name == "envoy-observer.yaml" else 1)
    bootstrap = json_format.ParseDict(raw, bootstrap_pb2.Bootstrap())
    hcm = hcm_pb2.HttpConnectionManager()
    assert bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    filters = {f.name: f for f in hcm.http_filters}
    strip = header_mutation_pb2.HeaderMutation()  # first: a client's epp-only headers go
    assert hcm.http_filters[0].typed_config.Unpack(strip)
    assert [m.remove for m in strip.mutations.request_mutations] == ["x-prefiller-host-port"]
    routing = ext_proc_pb2.ExternalProcessor()
    assert filters["envoy.filters.http.ext_proc"].typed_config.Unpack(routing)
    assert hcm.http_filters[-1].name == "envoy.filters.http.router"
    pm = processing_mode_pb2.ProcessingMode
    mode = routing.processing_mode
    assert mode.request_header_mode == pm.SEND
    assert not routing.allow_mode_override  # epp never sends mode_override
    assert routing.message_timeout.ToMilliseconds() > 0
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    assert routing.grpc_service.envoy_grpc.cluster_name == "epp" and "epp" in clusters
    assert hcm.route_config.virtual_hosts[0].routes[0].route.cluster == "pool"
    if name != "envoy-observer.yaml":  # the response summary (epp.extproc.summary)
        assert mode.response_body_mode == pm.STREAMED
        assert [(m.key, m.value) for m in routing.grpc_service.initial_metadata] == [("x-epp-response", "summary")]
        assert list(routing.metadata_options.receiving_namespaces.untyped) == ["epp"]
        log = als_pb2.HttpGrpcAccessLogConfig()
        assert hcm.access_log[0].typed_config.Unpack(log)
        assert log.common_config.grpc_service.envoy_grpc.cluster_name == "epp"
        # each entry goes to epp as it is written: a conversation's next turn, sent the
        # instant its answer ended, must not find that answer still counted in flight
        assert log.common_config.HasField("buffer_size_bytes")
        assert log.common_config.buffer_size_bytes.value == 0
    if name == "envoy-fail-closed.yaml":
        assert not routing.failure_mode_allow
        assert mode.request_body_mode == pm.FULL_DUPLEX_STREAMED
        pool = clusters["pool"]
        assert pool.original_dst_lb_config.http_header_name == "x-gateway-destination-endpoint"
        return
    assert routing.failure_mode_allow and mode.request_body_mode == pm.BUFFERED
    if name == "envoy-observer.yaml":
        observer = ext_proc_pb2.ExternalProcessor()
        assert filters["epp-response-observer"].typed_config.Unpack(observer)
        o = observer.processing_mode
        # the routing filter never sees the response; the observer sees nothing it could change
        assert (mode.response_header_mode, mode.response_body_mode) == (pm.SKIP, pm.NONE)
        assert observer.observability_mode and not routing.observability_mode
        assert (o.request_header_mode, o.request_body_mode) == (pm.SEND, pm.NONE)
        # observability_mode supports STREAMED bodies only; trailers end a response
        assert (o.response_header_mode, o.response_body_mode) == (pm.SEND, pm.STREAMED)
        assert o.response_trailer_mode == pm.SEND
    else:  # the response summary: headers and the first body bytes, no trailers to wait for
        assert mode.response_body_mode == pm.STREAMED
        assert mode.response_trailer_mode == pm.SKIP


# --- Grafana -----------------------------------------------------------------------------


EPP_METRICS = {
    "epp_requests_total",
    "epp_answered_requests_total",
    "epp_tracing_spans_exported_total",
    "epp_scheduling_duration_seconds",
    "epp_plugin_duration_seconds",
    "epp_event_loop_lag_seconds",
    "epp_prefix_index_entries",
    "epp_prefix_index_hit_ratio",
    "epp_pool_average_queue_size",
    "epp_pool_average_kv_cache_utilization",
    "epp_pool_ready_endpoints",
    "epp_endpoint_in_flight_requests",
    "epp_endpoint_queue_size",
    "epp_endpoint_kv_cache_utilization",
    "epp_kv_events_total",
    "epp_kv_events_dropped_total",
    "epp_kv_events_gaps_total",
    "epp_kv_events_resyncs_total",
    "epp_kv_events_restarts_total",
    "epp_kv_events_replays_total",
    "epp_precise_index_blocks",
    "epp_precise_unkeyed_requests_total",
    "epp_precise_tokenize_seconds",
    "epp_sync_peers",
    "epp_sync_peers_connected",
    "epp_sync_records_applied_total",
    "epp_sync_records_dropped_total",
    "epp_sync_peer_prefill_tokens",
}
INFERENCE_EXTENSION_METRICS = {
    "inference_objective_request_total",
    "inference_objective_request_error_total",
    "inference_objective_request_duration_seconds",
    "inference_objective_normalized_time_per_output_token_seconds",
    "inference_objective_request_sizes",
    "inference_objective_response_sizes",
    "inference_objective_input_tokens",
    "inference_objective_output_tokens",
    "inference_objective_running_requests",
    "inference_pool_average_kv_cache_utilization",
    "inference_pool_average_queue_size",
    "inference_pool_per_pod_queue_size",
    "inference_pool_ready_pods",
    "inference_extension_info",
    "inference_extension_scheduler_attempts_total",
    "inference_extension_flow_control_queue_size",
    "inference_extension_flow_control_queue_bytes",
    "inference_extension_flow_control_request_queue_duration_seconds",
    "inference_extension_flow_control_dispatch_cycle_duration_seconds",
    "inference_extension_flow_control_pool_saturation",
}
VLLM_METRICS = {
    "vllm:time_to_first_token_seconds",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
}
HISTOGRAMS = {
    "inference_objective_request_duration_seconds",
    "inference_objective_normalized_time_per_output_token_seconds",
    "inference_objective_request_sizes",
    "inference_objective_response_sizes",
    "inference_objective_input_tokens",
    "inference_objective_output_tokens",
    "epp_scheduling_duration_seconds",
    "epp_plugin_duration_seconds",
    "epp_event_loop_lag_seconds",
    "vllm:time_to_first_token_seconds",
    "inference_extension_flow_control_request_queue_duration_seconds",
    "inference_extension_flow_control_dispatch_cycle_duration_seconds",
}


def to_llmd(name: str) -> str:
    """The name the dashboard uses: llm-d's where epp exports one (epp/observability/llmd.py)."""
    from epp.observability.llmd import LLMD_NAMES

    total = name.endswith("_total")
    base = name.removesuffix("_total")
    return LLMD_NAMES.get(base, base) + ("_total" if total else "")


def test_grafana_dashboard_covers_every_metric_and_no_unknown_one() -> None:
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    known = {to_llmd(n) for n in EPP_METRICS | INFERENCE_EXTENSION_METRICS} | VLLM_METRICS
    histograms = {to_llmd(n) for n in HISTOGRAMS}
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:llm_d_epp_|epp_|vllm:|inference_)[a-z0-9_:]+)", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in known, f"unknown metric {name} in {expr} (llm-d's names: {to_llmd(base)})"
            if base in histograms:
                assert name.endswith("_bucket") and "histogram_quantile" in expr, expr
            used.add(base)
    assert used == known
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"


def test_the_chart_kustomize_and_the_image_build_agree_on_the_image_name() -> None:
    """What deploy/Containerfile and ./run image build (epp:<version>) is what both installs
    run by default."""
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None
    built = f"epp:{version.group(1)}"
    assert "IMAGE=${EPP_IMAGE:-epp:" in (ROOT / "scripts" / "build-image.sh").read_text()
    assert f"-t {built} ." in (DEPLOY / "Containerfile").read_text()
    chart = one(docs_of(run(tool("helm"), "template", "llama", str(CHART))), "Deployment")
    assert chart["spec"]["template"]["spec"]["containers"][0]["image"] == built
    kustomized = one(docs_of(run(tool("kubectl"), "kustomize", str(DEPLOY / "kustomize" / "base"))),
                     "Deployment")  # fmt: skip
    assert kustomized["spec"]["template"]["spec"]["containers"][0]["image"] == built


def test_the_readme_installs_the_image_it_builds_and_pushes() -> None:
    """README's Kubernetes commands build and push an image, and its helm install (rendered
    with real helm) runs that image: no registry publishes epp:<version>."""
    import shlex

    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "helm install" in b)
    lines = [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    build = next(c for c in lines if c[:2] == ["docker", "build"])
    tag = build[build.index("-t") + 1]
    assert ["docker", "push", tag] == next(c for c in lines if "push" in c)[-3:]
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None and tag.endswith(f":{version.group(1)}")
    helm = next(c for c in lines if c[:2] == ["helm", "install"])
    release, chart, *flags = helm[2:]
    docs = docs_of(run(tool("helm"), "template", release, str(ROOT / chart), *flags))
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] == tag


def test_the_istio_tls_rule_names_the_service_the_chart_makes() -> None:
    """deploy/gateways/istio/epp-tls.yaml is for a release named llama in default, as the
    walk-through installs it."""
    rule = one(docs_of((DEPLOY / "gateways/istio/epp-tls.yaml").read_text()), "DestinationRule")
    docs = docs_of(run(tool("helm"), "template", "llama", str(CHART), "-n", "default",
                       "--set", "extProc.tls.enabled=true"))  # fmt: skip
    service = client_service(docs)["metadata"]["name"]
    assert rule["spec"]["host"] == f"{service}.default.svc.cluster.local"


def test_a_custom_resource_breaking_its_crd_schema_is_caught() -> None:
    """The CRD-schema check is live: a Gateway listener port that is not a number, an
    HTTPRoute weight below zero, an unknown TLS mode in a DestinationRule and an idle timeout
    that is not a duration in a BackendTrafficPolicy fail it."""
    docs = docs_of((DEPLOY / "gateways/istio/gateway.yaml").read_text())
    docs += docs_of((DEPLOY / "gateways/istio/epp-tls.yaml").read_text())
    one(docs, "Gateway")["spec"]["listeners"][0]["port"] = "eighty"
    with pytest.raises(AssertionError, match="port must be integer"):
        validate_custom_resources([one(docs, "Gateway")])
    one(docs, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]["weight"] = -3
    with pytest.raises(AssertionError, match="weight must be >= 0"):
        validate_custom_resources([one(docs, "HTTPRoute")])
    one(docs, "DestinationRule")["spec"]["trafficPolicy"]["tls"]["mode"] = "SOMETIMES"
    with pytest.raises(AssertionError, match="DestinationRule"):
        validate_custom_resources([one(docs, "DestinationRule")])
    policy = one(docs_of((DEPLOY / "gateways/envoy-gateway/gateway.yaml").read_text()), "BackendTrafficPolicy")
    policy["spec"]["timeout"]["http"]["connectionIdleTimeout"] = "four seconds"
    with pytest.raises(AssertionError, match="connectionIdleTimeout must match pattern"):
        validate_custom_resources([policy])


def walkthrough_commands() -> list[list[str]]:
    """The shell commands of docs/kubernetes.md's code blocks, continuation lines joined."""
    import shlex

    text = (ROOT / "docs" / "kubernetes.md").read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for raw in block.replace("\\\n", " ").splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


def test_every_manifest_the_walkthrough_installs_renders_and_validates() -> None:
    """docs/kubernetes.md's helm installs render with real helm and validate against the
    Kubernetes and CRD schemas, and the files it applies validate; a pool it creates
    selects the example Deployment it names."""
    commands = walkthrough_commands()
    installs = [c for c in commands if c[:2] == ["helm", "install"] and "..." not in c]
    applied = [c[3] for c in commands if c[:3] == ["kubectl", "apply", "-f"] and c[3].startswith("deploy/")]
    assert len(installs) >= 2 and "deploy/examples/vllm-deployment.yaml" in applied
    for path in applied:
        validate_schema(docs_of((ROOT / path).read_text()))
    examples = {d["spec"]["template"]["metadata"]["labels"]["app"]: p
                for p in STATIC_MANIFESTS if p.parent.name == "examples"
                for d in by_kind(docs_of(p.read_text()), "Deployment")}  # fmt: skip
    for command in installs:
        release, chart, *flags = command[2:]
        assert (ROOT / chart).resolve() == CHART.resolve()
        docs = docs_of(run(tool("helm"), "template", release, str(CHART), *flags))
        files = [f.split("=", 1)[1] for f in flags if f.startswith("scheduling.config=")]
        check_epp_manifests(docs, pool=True, config=files[0] if files else "")
        pool = one(docs, "InferencePool")
        labels = pool["spec"]["selector"]["matchLabels"]
        for servers in by_kind(docs_of(examples[labels["app"]].read_text()), "Deployment"):
            assert labels.items() <= servers["spec"]["template"]["metadata"]["labels"].items()


def test_envoy_gateway_closes_idle_server_connections_as_the_standalone_bootstrap_does() -> None:
    """Below the servers' 5 s keep-alive (uvicorn's default in vLLM and SGLang), and the same
    as the bootstrap epp generates (tests/envoy/test_upstream_idle.py proves it there)."""
    from epp.envoyconfig import EnvoyOptions

    docs = docs_of((DEPLOY / "gateways/envoy-gateway/gateway.yaml").read_text())
    policy, route = one(docs, "BackendTrafficPolicy"), one(docs, "HTTPRoute")
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("HTTPRoute", route["metadata"]["name"])
    idle = policy["spec"]["timeout"]["http"]["connectionIdleTimeout"]
    assert idle.endswith("s") and float(idle[:-1]) == EnvoyOptions().upstream_idle_timeout_s < 5


def test_the_scaler_wiring_in_the_docs_names_the_waiting_demand_gauge_and_validates() -> None:
    """docs/kubernetes.md's KEDA ScaledObject and HPA scale the model servers on the gauge
    epp exports (epp_pool_waiting_requests); the HPA is a valid autoscaling/v2 object."""
    from prometheus_client import CollectorRegistry

    from epp.observability.metrics import EppMetrics

    text = (DEPLOY.parent / "docs" / "kubernetes.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    objects = {d["kind"]: d for b in blocks for d in docs_of(b) if isinstance(d, dict) and "kind" in d}
    keda, hpa = objects["ScaledObject"], objects["HorizontalPodAutoscaler"]
    registry = CollectorRegistry()
    EppMetrics(registry).pool_waiting.labels("vllm-llama3-8b-instruct").set(0)
    exported = {m.name for m in registry.collect()}
    (trigger,) = keda["spec"]["triggers"]
    assert "epp_pool_waiting_requests" in exported
    assert trigger["metadata"]["query"].startswith("sum(epp_pool_waiting_requests{")
    assert keda["spec"]["minReplicaCount"] == 0  # from zero
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "epp_pool_waiting_requests"
    validate_schema([hpa])


def _seconds(text: str) -> float:
    assert re.fullmatch(r"\d+(\.\d+)?s", text), text
    return float(text[:-1])


def test_gateway_timeouts_outlast_what_epp_may_hold_a_request_with_flow_control_on() -> None:
    """QA3 #14: the shipped gateway manifests' ext_proc message timeouts (the model router's)
    and HTTPRoute request timeouts cover what epp may hold a request with the chart's
    config and flow control on, as the chart README's scale-from-zero setup turns it on: the
    same figure ``epp envoy-config`` derives (``EppNeeds.message_timeout_s``)."""
    from epp.envoyconfig import needs_from_config

    raw = yaml.safe_load(yaml.safe_load((CHART / "values.yaml").read_text())["scheduling"]["config"])
    raw["flowControl"] = {"enabled": True}  # the README's scale-from-zero setup, its defaults
    need = needs_from_config(loads_config(yaml.safe_dump(raw))).message_timeout_s
    assert need >= 35  # maxQueueSeconds 30 + epp's own work
    message_timeouts = {}
    for path in sorted((DEPLOY / "gateways").glob("*/*.yaml")):
        text = path.read_text()
        for found in re.findall(r"(?:messageTimeout|message_timeout): *(\S+)", text):
            message_timeouts.setdefault(path.relative_to(DEPLOY).as_posix(), []).append(_seconds(found))
        for route in by_kind(docs_of(text), "HTTPRoute"):
            for rule in route["spec"]["rules"]:
                if "timeouts" in rule:
                    assert _seconds(rule["timeouts"]["request"]) >= need, (path, rule)
    assert set(message_timeouts) == {"gateways/envoy-gateway/models.yaml", "gateways/istio/models.yaml"}
    for where, values in message_timeouts.items():
        assert min(values) >= need, f"{where}: ext_proc message timeout {values} < {need} s"
