"""``epp serve``: its parser (ports, lifecycle; the other flag groups live beside it) and the
run: config, endpoint sources, then ``start_server`` until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from epp.cli import serve_endpoints, serve_requests, serve_sync
from epp.cli.flags import load, port, port_or_off, seconds
from epp.clihelp import HelpFormatter, stop_event
from epp.errors import ConfigError
from epp.observability.tracing import ENV_HELP as TRACING_ENV_HELP
from epp.observability.tracing import tracing_from_env
from epp.server.runner import ServerOptions, start_server

log = logging.getLogger("epp.cli")


def add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the Envoy ext_proc endpoint picker",
        description="Serve envoy.service.ext_proc.v3.ExternalProcessor: pick a model server "
        "for each request and tell Envoy through x-gateway-destination-endpoint.",
        epilog=TRACING_ENV_HELP,
        formatter_class=HelpFormatter,
    )
    g = serve.add_argument_group("ports")
    g.add_argument("--grpc-port", type=port, default=9002, help="ext_proc gRPC port (0 = any)")
    g.add_argument("--health-port", type=port_or_off, default=9003,
                   help="gRPC health port (grpc.health.v1; -1 = off, 0 = any free port; health is also on --grpc-port)")
    g.add_argument("--metrics-port", type=port_or_off, default=9090,
                   help="Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--cert", default="", help="TLS certificate (PEM) for the gRPC port")
    g.add_argument("--key", default="", help="TLS private key (PEM) for the gRPC port")

    serve_requests.add_request_flags(serve)
    serve_endpoints.add_endpoint_flags(serve)
    serve_sync.add_sync_flags(serve)

    g = serve.add_argument_group("lifecycle and logging")
    g.add_argument("--grace-s", type=seconds(strict=False), default=30.0,
                   help="on SIGTERM, how long open ext_proc streams may take to finish, in seconds")
    g.add_argument("--shutdown-delay-s", type=seconds(strict=False), default=0.0,
                   help="on SIGTERM, seconds to keep accepting streams after reporting "
                   "NOT_SERVING")
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log level (prompt text is only ever logged at debug)")
    g.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="JSON lines (production) or plain text")

    serve_endpoints.add_kubernetes_flags(serve)


def _check_tls_files(args: argparse.Namespace) -> None:
    if not (args.cert or args.key):
        return
    if not (args.cert and args.key):
        raise ConfigError("--cert" if not args.cert else "--key", "TLS needs both --cert and --key")
    for flag, path in (("--cert", args.cert), ("--key", args.key)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(flag, f"cannot read {path}")


async def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; raises ConfigError for bad flags or config."""
    cfg = load(args)
    found = serve_endpoints.endpoint_sources(args, cfg)
    _check_tls_files(args)
    tracing = tracing_from_env()  # the OTEL_* variables (docs/observability.md)
    from epp.envoyconfig import needs_from_config

    log.info("the Envoy in front of this epp needs: %s (epp envoy-config with the same "
             "--config and --max-body-bytes prints a bootstrap that has them; --check FILE "
             "checks one)", needs_from_config(cfg, args.max_body_bytes).describe())

    options = ServerOptions(
        host=args.host,
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        cert_file=args.cert,
        key_file=args.key,
        processing_mode=serve_requests.PROCESSING_MODES[args.processing_mode],
        scrape=not args.no_scrape,
        scraping=serve_endpoints.scrape_options(args, cfg),
        fallbacks=args.fallbacks,
        max_body_bytes=args.max_body_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        max_learning_bytes=args.max_learning_bytes,
        max_open_streams=args.max_open_streams,
        response_observer_wait_s=(
            args.response_observer_wait_s if args.response_observer else 0.0
        ),
        trust_control_headers=args.trust_control_headers,
        pool_name=getattr(args, "pool_name", "") or "static",
        response_limits=serve_requests.response_limits(args),
        grace_s=args.grace_s,
        shutdown_delay_s=args.shutdown_delay_s,
        sync=serve_sync.sync_options(args),
        tracing=tracing,
    )
    try:
        handle = await start_server(
            cfg, found.static, options, sources=found.sources,
            objective_lookup=found.objective_lookup,
        )
    except OSError as exc:  # a port in use, an address not on this host
        log.error("cannot start: %s", exc)
        print(f"epp: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = stop_event()
    await stop.wait()
    log.info("signal received")
    await handle.stop()
    return 0
