"""Composition root: the ``epp`` command. One module per command (``serve`` and its flag
groups ``serve_*``, ``envoy_config``, ``pd_sidecar``; ``dry-run`` is ``epp.dryrun``,
``model-router`` is ``epp.modelrouter.cli``) on the shared argument types of ``flags``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from epp import dryrun, package_version
from epp.cli import envoy_config, pd_sidecar, serve
from epp.cli.envoy_config import (
    EnvoyBootstrap,
    check_envoy_bootstrap,
    envoy_bootstrap,
    envoy_config_from_args,
    envoy_needs,
)
from epp.cli.envoy_config_flags import add_envoy_config
from epp.cli.flags import body_size, byte_size, number, port, port_or_off, seconds
from epp.cli.serve_sync import sync_options
from epp.clihelp import HelpFormatter, no_abbreviations
from epp.errors import ConfigError
from epp.observability.logging import setup_logging

__all__ = [
    "EnvoyBootstrap", "build_parser", "byte_size", "check_envoy_bootstrap", "envoy_bootstrap",
    "envoy_config_from_args", "envoy_needs", "main", "sync_options",
]  # fmt: skip

log = logging.getLogger("epp.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp", description="Prefix-cache-aware endpoint picker")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_serve(sub)
    add_envoy_config(sub)
    pd_sidecar.add_pd_sidecar(sub)
    dryrun.register(sub, HelpFormatter)
    from epp.modelrouter.cli import register

    register(sub, formatter=HelpFormatter, port=port, port_or_off=port_or_off, size=byte_size,
             body_size=body_size, number=number, seconds=seconds)
    no_abbreviations(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "envoy-config":
        return envoy_config.run(args)
    if args.command == "dry-run":
        setup_logging("warning", json_lines=False)
        return int(args.run(args))
    setup_logging(args.log_level, json_lines=args.log_format == "json")
    if args.command == "model-router":
        from epp.modelrouter.cli import run as run_model_router

        return run_model_router(args)
    if args.command == "pd-sidecar":
        return asyncio.run(pd_sidecar.run(args))
    if args.command == "serve":
        try:
            return asyncio.run(serve.run(args))
        except ConfigError as exc:
            log.error("bad configuration: %s", exc)
            print(f"epp: {exc}", file=sys.stderr)
            return 2
    return 1
