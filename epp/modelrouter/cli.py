"""``epp model-router``: the command line of the body-based router, and the several-pools
flags of ``epp envoy-config`` (both read ``--pool NAME=MODEL[,MODEL...]@ADDR,...`` and
``--pools FILE``: ``epp.modelrouter.pools``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from epp.clihelp import stop_event
from epp.envoyconfig import PoolRoute
from epp.errors import ConfigError
from epp.modelrouter.listing import ListingOptions
from epp.modelrouter.pools import Pools, from_flags
from epp.modelrouter.server import (
    DEFAULT_GRPC_PORT,
    DEFAULT_METRICS_PORT,
    AdapterSource,
    RouterOptions,
    start_router,
)

log = logging.getLogger("epp.cli")

POOL_HELP = (
    "a pool: NAME=MODEL[,MODEL...]@HOST:PORT[,HOST:PORT...], its base models (requests for "
    "them and their LoRA adapters go to it) and its model servers (a DNS name stands for all "
    "its addresses); repeat per pool"
)


def register(
    sub: Any, *, formatter: type[argparse.HelpFormatter], port: Callable[[str], int],
    port_or_off: Callable[[str], int], size: Callable[[str], int],
    body_size: Callable[[str], int], number: Callable[..., Any], seconds: Callable[..., Any],
) -> None:  # fmt: skip
    """Add ``model-router`` to ``epp``'s subcommands (the argument types are epp.cli's)."""
    p = sub.add_parser(
        "model-router",
        help="run the body-based router in front of several pools (one gateway, many models)",
        description="Serve envoy.service.ext_proc.v3.ExternalProcessor as the gateway's first "
        "processor: read each request's model from its body (every API epp parses), set "
        "x-gateway-model-name and x-gateway-base-model-name (a LoRA adapter's base model) so "
        "the gateway's routes send it to the pool serving that model, where the pool's epp "
        "picks the server. A model no pool serves gets a 404 (Anthropic-shaped on /v1/messages); GET /v1/models "
        "lists every model and adapter of every pool once. The bootstrap: epp envoy-config "
        "--pool NAME=MODEL@SERVERS ... (docs/envoy.md, docs/kubernetes.md).",
        formatter_class=formatter,
    )
    g = p.add_argument_group("pools and models")
    g.add_argument("--pool", action="append", default=[], metavar="NAME=MODEL[,MODEL...]@ADDR,...",
                   help=POOL_HELP)
    g.add_argument("--pools", default="", metavar="FILE",
                   help="the pools and adapters as YAML instead (docs/envoy.md, 'Several models')")
    g.add_argument("--adapters", action="append", default=[], metavar="BASE=ADAPTER[,ADAPTER...]",
                   help="LoRA adapters of a base model, routed to its pool; repeatable")
    g.add_argument("--no-learn-adapters", action="store_true",
                   help="route only the configured adapters, not those the pools' servers "
                   "list on GET /v1/models (vLLM names an adapter's base model as its parent)")
    g.add_argument("--default-model", default="",
                   help="the model of a request that names none (an API whose 'model' is "
                   "optional); default: a 400, unless the pools serve one base model")
    g.add_argument("--max-models", type=number(1, strict=False, integer=True), default=10_000,
                   help="most models and adapters known; more are ignored (logged)")
    g.add_argument("--models-refresh-s", type=seconds(), default=10.0,
                   help="seconds between two rounds of GET /v1/models over every pool's servers")
    g.add_argument("--models-timeout-s", type=seconds(), default=2.0,
                   help="timeout of one server's GET /v1/models")
    g.add_argument("--models-max-bytes", type=size, default=1 << 20,
                   help="largest GET /v1/models answer read from one server")
    g.add_argument("--trust-control-headers", action="store_true",
                   help="route by x-gateway-model-name-rewrite when a request carries it (as "
                   "epp serve --trust-control-headers, which then serves that model: give "
                   "both the same setting). Without it the body's model decides; a client's "
                   "x-gateway-model-name and x-gateway-base-model-name are always overwritten")

    g = p.add_argument_group("serving")
    g.add_argument("--grpc-port", type=port, default=DEFAULT_GRPC_PORT,
                   help="ext_proc gRPC port, also answering grpc.health.v1 (0 = any)")
    g.add_argument("--health-port", type=port_or_off, default=-1,
                   help="a second port answering only grpc.health.v1 (-1 = off)")
    g.add_argument("--metrics-port", type=port_or_off, default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics HTTP port (-1 = off)")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--cert", default="", help="TLS certificate (PEM) for the gRPC port")
    g.add_argument("--key", default="", help="TLS private key (PEM) for the gRPC port")
    g.add_argument("--max-body-bytes", type=body_size, default=None,
                   help="request body cap, 413 above it (default 8MiB, at most 1023MiB, as epp serve)")
    g.add_argument("--max-open-streams", type=number(1, strict=False, integer=True),
                   default=20_000, help="ext_proc streams open at once; past it 503")
    g.add_argument("--grace-s", type=seconds(strict=False), default=30.0,
                   help="on SIGTERM, how long open streams may take to finish")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level")
    g.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="JSON lines (production) or plain text")
    try:
        from epp.modelrouter import kubernetes as k8s
    except ImportError:  # pragma: no cover - the kubernetes client is not installed
        return
    k8s.add_flags(p)


def pools_from_args(args: argparse.Namespace) -> Pools:
    pools = from_flags(args.pool, args.adapters, pools_file=args.pools)
    if pools is None:
        raise ConfigError("--pool", "name the pools: --pool NAME=MODEL[,MODEL...]@HOST:PORT,... "
                          "(repeated) or --pools FILE")  # fmt: skip
    return pools


def options_from_args(args: argparse.Namespace) -> RouterOptions:
    from epp.request.settings import DEFAULT_MAX_BODY_BYTES

    return RouterOptions(
        host=args.host, grpc_port=args.grpc_port, health_port=args.health_port,
        metrics_port=args.metrics_port, cert_file=args.cert, key_file=args.key,
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        max_open_streams=args.max_open_streams, trust_control_headers=args.trust_control_headers,
        default_model=args.default_model, max_models=args.max_models,
        listing=ListingOptions(refresh_s=args.models_refresh_s, timeout_s=args.models_timeout_s,
                               max_bytes=args.models_max_bytes,
                               learn_adapters=not args.no_learn_adapters),
        grace_s=args.grace_s,
    )  # fmt: skip


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM / SIGINT."""
    pools = pools_from_args(args)
    options = options_from_args(args)
    sources: list[AdapterSource] = []
    try:
        from epp.modelrouter import kubernetes as k8s
    except ImportError:  # pragma: no cover
        k8s = None  # type: ignore[assignment]
    if k8s is not None and (source := k8s.source_from_args(args)) is not None:
        sources.append(source)
    try:
        handle = await start_router(pools, options, sources=sources)
    except (OSError, RuntimeError) as exc:  # a port in use; no ConfigMap list (DiscoveryError)
        log.error("cannot start: %s", exc)
        print(f"epp model-router: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = stop_event()
    await stop.wait()
    await handle.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(serve(args))
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        print(f"epp model-router: {exc}", file=sys.stderr)
        return 2


# --- epp envoy-config with several pools ----------------------------------------------


def envoy_pools(pool_flags: list[str], epp_flags: list[str], pools_file: str) -> tuple[PoolRoute, ...]:
    """``epp envoy-config``'s pools: ``--pool NAME=...`` flags (each with ``--epp NAME=...``)
    or ``--pools FILE``; () for the single-pool form (``--pool HOST:PORT,...``)."""
    named = [t for t in pool_flags if "=" in t]
    if not named and not pools_file:
        if len(pool_flags) > 1:
            raise ConfigError("--pool", "one server list, or one NAME=MODEL@SERVERS per pool")
        return ()
    if len(named) != len(pool_flags):
        raise ConfigError("--pool", "either one server list (one pool) or NAME=MODEL@SERVERS "
                          "for every pool, not both")  # fmt: skip
    epps = [t for t in epp_flags if "=" in t]
    if len(epps) != len(epp_flags):
        raise ConfigError("--epp", "with several pools, name each pool's epp: --epp NAME=HOST:PORT")
    pools = from_flags(named, (), epps, pools_file=pools_file)
    assert pools is not None
    return pools.pools
