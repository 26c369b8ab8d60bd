"""Every Envoy config the project ships is the generator's output and real Envoy accepts it
(``envoy --mode validate``), as do the generator's other combinations."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml

from epp.envoyconfig import EnvoyOptions, PoolRoute, envoy_config, render_yaml
from tests.envoy.conftest import require_envoy

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "deploy" / "envoy").glob("*.yaml"))


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_envoy_configs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _validate(path: Path) -> None:
    done = subprocess.run(
        [str(require_envoy()), "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_every_shipped_config_is_listed_by_the_generator() -> None:
    assert {p.name for p in SHIPPED} == set(_generator().SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_config_is_the_generators_output_and_envoy_accepts_it(path: Path) -> None:
    assert path.read_text() == _generator().render(path.name), (
        "regenerate with: ./run python scripts/gen_envoy_configs.py"
    )
    _validate(path)


TWO_POOLS = (PoolRoute("chat", ("chat-base",), ("10.0.0.1:8000", "10.0.0.2:8000"), ("10.0.1.1:9002",)),
             PoolRoute("coder", ("coder-base", "coder-alias"), ("vllm-coder.ns.svc:8000",),
                       ("epp-coder.ns.svc:9002",)))  # fmt: skip
VARIANTS = {
    "two pools": EnvoyOptions(pools=TWO_POOLS, upstream_host_header=True),
    "two pools, observer": EnvoyOptions(pools=TWO_POOLS, response="observer"),
    "two pools, random baseline": EnvoyOptions(pools=TWO_POOLS, routing="random"),
    "two pools, fail-closed": EnvoyOptions(pools=TWO_POOLS, failure="closed", request_body="full-duplex"),
    "fail-open, the response summary": EnvoyOptions(pool=("10.0.0.1:8000", "10.0.0.2:8000")),
    "the response summary, batched": EnvoyOptions(pool=("10.0.0.1:8000",), summary_flush_s=0.05),
    "fail-open, full-duplex responses": EnvoyOptions(pool=("10.0.0.1:8000",),
                                                     response="full-duplex"),
    "observer": EnvoyOptions(pool=("10.0.0.1:8000",), response="observer"),
    "no response processing": EnvoyOptions(pool=("10.0.0.1:8000",), response="none"),
    "dns names": EnvoyOptions(epp=("epp.ns.svc.cluster.local:9002",),
                              pool=("vllm.ns.svc.cluster.local:8000",)),
    "fail-closed with a pool": EnvoyOptions(pool=("10.0.0.1:8000",), failure="closed",
                                            request_body="full-duplex"),
    "original-dst": EnvoyOptions(failure="closed"),
    "random baseline": EnvoyOptions(routing="random", pool=("10.0.0.1:8000",)),
    "round-robin baseline": EnvoyOptions(routing="round-robin", pool=("10.0.0.1:8000",)),
    "access log": EnvoyOptions(pool=("10.0.0.1:8000",), access_log="/tmp/envoy-access.jsonl"),
    "several epp replicas": EnvoyOptions(epp=("10.0.1.1:9002", "10.0.1.2:9002"),
                                         pool=("10.0.0.1:8000",), upstream_host_header=True),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_envoy_accepts_every_combination_of_the_generator(name: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(VARIANTS[name]))
    _validate(path)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (EnvoyOptions(), "needs the pool's servers"),
        (EnvoyOptions(pool=("10.0.0.1:8000",), request_body="full-duplex"), "buffered"),
        (EnvoyOptions(routing="random"), "list its servers"),
        (EnvoyOptions(pool=("10.0.0.1",)), "not host:port"),
        (EnvoyOptions(pool=("10.0.0.1:8000",), response="streamed"), "response must be"),
        (EnvoyOptions(pools=TWO_POOLS, pool=("10.0.0.1:8000",)), "each names its servers"),
        (EnvoyOptions(pools=(*TWO_POOLS, PoolRoute("x", ("chat-base",), ("10.0.0.9:8000",),
                                                    ("10.0.1.9:9002",)))), "in pools 'chat' and 'x'"),
        (EnvoyOptions(pools=(PoolRoute("chat", ("m",), ("10.0.0.1:8000",)),)), "epp's address"),
        (EnvoyOptions(pools=TWO_POOLS, request_body="full-duplex"), "pool 'chat': failing open"),
        (EnvoyOptions(pool=("10.0.0.1:8000",), max_request_bytes=1 << 32), "at most 4294967295"),
        (EnvoyOptions(pool=("10.0.0.1:8000",), message_timeout_s=float("nan")), "finite"),
        (EnvoyOptions(pool=("10.0.0.1:8000",), stream_idle_timeout_s=1e-6), ">= 0.001"),
        (EnvoyOptions(pools=TWO_POOLS, admin_port=-1), "admin_port: must be a port"),
    ],
)
def test_a_combination_that_cannot_work_is_refused_with_the_reason(
    options: EnvoyOptions, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        envoy_config(options)


@pytest.mark.parametrize("argv", [
    [],  # bare: fail-closed over an ORIGINAL_DST cluster, a comment says how to fail open
    ["--pool", "10.0.0.1:8000", "--message-timeout-s", "3600", "--stream-idle-timeout-s",
     "31536000", "--upstream-idle-timeout-s", "0.001", "--max-request-bytes", "8MiB"],
    ["--pool", "10.0.0.1:8000", "--max-body-bytes", "1023MiB", "--port", "65535"],
], ids=["bare", "longest and shortest timeouts", "largest buffer limit"])  # fmt: skip
def test_envoy_accepts_what_envoy_config_prints_at_the_limits_its_flags_allow(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each limit the flags enforce (QA3 item 1: NaN, Inf, 1e12 s, -1 ports, 100 GiB were
    printed and Envoy refused them) is one real Envoy takes; one past it is refused by epp
    (tests/unit/test_bad_numbers.py)."""
    from epp.cli import main

    assert main(["envoy-config", *argv]) == 0
    path = tmp_path / "envoy.yaml"
    path.write_text(capsys.readouterr().out)
    _validate(path)


def test_the_shipped_default_fails_open_over_an_override_host_pool() -> None:
    """What the rest of the tier relies on, read from the shipped file."""
    raw = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    hcm = raw["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    ext_proc = filters["envoy.filters.http.ext_proc"]
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    # the response summary: epp reads the first body bytes, the access log brings the rest
    assert ext_proc["processing_mode"]["response_body_mode"] == "STREAMED"
    names = [f["name"] for f in hcm["http_filters"]]
    # the usage reader sees the response after epp's filter (response filters run in reverse)
    assert names.index("envoy.filters.http.ai_protocol_manager") < names.index("envoy.filters.http.ext_proc")
    (log,) = hcm["access_log"]
    assert log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp"
    clusters = {c["name"]: c for c in raw["static_resources"]["clusters"]}
    policy = clusters["pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    epp = clusters["epp"]
    assert epp["health_checks"][0]["grpc_health_check"] == {}
    # Envoy's default circuit breaker caps a cluster at 1,024 concurrent requests: each HTTP
    # request holds one ext_proc stream, so the default would cap the gateway
    assert epp["circuit_breakers"]["thresholds"][0]["max_requests"] > 100_000


def test_the_models_bootstrap_routes_each_base_model_to_its_pool_through_its_epp() -> None:
    """deploy/envoy/envoy-models.yaml: the client's model headers removed first, the model
    router before the epp filter, a route per base model whose epp filter talks to that
    pool's epp, and a 503 for a request the router did not answer."""
    raw = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-models.yaml").read_text())
    hcm = raw["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[:3] == ["strip-epp-only-headers", "epp-model-router", "envoy.filters.http.ext_proc"]
    removed = [m["remove"] for m in hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]]
    assert {"x-gateway-model-name", "x-gateway-base-model-name"} <= set(removed)
    router = hcm["http_filters"][1]["typed_config"]
    assert router["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert router["processing_mode"]["response_body_mode"] == "NONE"
    *routes, last = hcm["route_config"]["virtual_hosts"][0]["routes"]
    clusters = {c["name"] for c in raw["static_resources"]["clusters"]}
    for route in routes:
        pool = route["route"]["cluster"].removeprefix("pool-")
        (header,) = route["match"]["headers"]
        assert header["name"] == "x-gateway-base-model-name"
        override = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
        assert override["grpc_service"]["envoy_grpc"]["cluster_name"] == f"epp-{pool}"
        assert {f"pool-{pool}", f"epp-{pool}"} <= clusters
    assert last["direct_response"]["status"] == 503
    assert last["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert {"model-router", "pool-llama", "pool-coder"} <= clusters and "pool" not in clusters
