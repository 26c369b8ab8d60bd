"""``epp-sim gateway``: run the development gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from epp.cli.flags import envoy_byte_size
from simulator.clihelp import HelpFormatter, deprecated_alias, stop_event
from simulator.gateway.extproc import MODE_NAMES
from simulator.gateway.proxy import DEFAULT_BUFFER_LIMIT_BYTES, POLICIES, GatewayOptions
from simulator.gateway.server import start_gateway

OBSERVER = "observer"
"""``--response observer``: the response goes to epp on a second stream (epp envoy-config's
name)."""


def add_mode_flags(
    p: argparse.ArgumentParser, default_mode: str = "full-duplex", envoy: bool = False
) -> None:
    """``envoy``: the flags of a stack whose gateway may be real Envoy, which adds the
    bootstrap's response ``summary`` (its default there)."""
    request_body = p.add_argument(
        "--request-body",
        choices=["buffered", "full-duplex"],
        default=default_mode,
        help="ext_proc request_body_mode (Envoy's processing_mode; epp envoy-config "
        "--request-body)",
    )
    deprecated_alias(p, "--mode", request_body)
    observer = (f"'{OBSERVER}' every chunk on a second ext_proc stream in observability_mode "
                "(send and go: chunks are not held for epp's reply), as a second Envoy ext_proc "
                "filter does, the routing stream skipping the response (epp serve "
                "--response-observer)")  # fmt: skip
    modes = ", ".join(sorted(MODE_NAMES))
    if envoy:
        response = p.add_argument(
            "--response",
            default=None,
            metavar="MODE[,MODE...]",
            help="how responses reach epp (epp envoy-config --response): 'summary', real "
            "Envoy's unless set (epp reads a streamed answer's first bytes, Envoy's access "
            f"log brings the usage and the end), {observer}, or an ext_proc "
            f"response_body_mode ({modes}; full-duplex with --gateway python). "
            "Several, comma-separated: the demo runs epp once per mode",
        )
    else:
        response = p.add_argument(
            "--response",
            choices=sorted([*MODE_NAMES, OBSERVER]),
            default=None,
            help="how responses reach epp (epp envoy-config --response): an ext_proc "
            f"response_body_mode ({modes}; default: full-duplex) or {observer}",
        )
    deprecated_alias(p, "--response-mode", response)
    deprecated_alias(p, "--response-observer", response, const=OBSERVER)


def response_from_args(response: str | None) -> tuple[str | None, bool]:
    """``--response`` as the gateway takes it: the routing stream's response_body_mode (None:
    the default) and whether an observer stream gets the response instead."""
    if response == OBSERVER:
        return None, True
    return response, False


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="HTTP front proxy that plays Envoy's ext_proc part for epp",
        description=(
            "Proxy HTTP requests to model servers the way Envoy with the ext_proc filter does: "
            "one ext_proc stream per request to epp, header/body mutations applied, the "
            "request sent to the endpoint epp named (x-gateway-destination-endpoint or "
            "envoy.lb metadata; later entries are fallbacks) and the response streamed back "
            "through ext_proc. --routing random|round-robin bypasses epp (the baseline). "
            'Prints one JSON line {"gateway_url": ...} once listening.'
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0 = any free port)")
    routing = p.add_argument("--routing", choices=POLICIES, default="epp",
                             help="who picks the endpoint: 'epp', or a baseline without epp "
                             "(epp envoy-config --routing)")
    deprecated_alias(p, "--policy", routing)
    epp = p.add_argument(
        "--epp",
        default="127.0.0.1:9002",
        help="epp's ext_proc gRPC address; several comma-separated (epp replicas): one stream "
        "per request, round-robin over them, as Envoy's ext_proc cluster does (epp "
        "envoy-config --epp)",
    )
    deprecated_alias(p, "--extproc", epp)
    p.add_argument(
        "--endpoints",
        default="",
        help="comma-separated ip:port of model servers (random / round-robin)",
    )
    add_mode_flags(p)
    p.add_argument(
        "--message-timeout-s",
        type=float,
        default=10.0,
        help="how long to wait for each ext_proc reply (Envoy's message_timeout)",
    )
    limit = p.add_argument(
        "--max-request-bytes",
        type=envoy_byte_size,
        default=DEFAULT_BUFFER_LIMIT_BYTES,
        help="Envoy's buffer limit (epp envoy-config --max-request-bytes): the largest body "
        "held whole (a BUFFERED body; a request body kept for a retry), 413 above it for a "
        "request, 500 for a response",
    )
    deprecated_alias(p, "--buffer-limit-bytes", limit)
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random policy (default: a new one each run)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    response_mode, observer = response_from_args(args.response)
    request, response = MODE_NAMES[args.request_body], MODE_NAMES[response_mode or "full-duplex"]
    endpoints = tuple(e.strip() for e in args.endpoints.split(",") if e.strip())
    try:
        options = GatewayOptions(
            host=args.host,
            port=args.port,
            policy=args.routing,
            extproc=args.epp,
            endpoints=endpoints,
            request_mode=request,
            response_mode=response,
            response_observer=observer,
            message_timeout_s=args.message_timeout_s,
            buffer_limit_bytes=args.max_request_bytes,
            seed=args.seed,
        )
        asyncio.run(_serve(options))
    except ValueError as exc:
        print(f"epp-sim gateway: {exc}", file=sys.stderr)
        return 2
    return 0


async def _serve(options: GatewayOptions) -> None:
    handle = await start_gateway(options)
    print(json.dumps({"gateway_url": handle.url, "policy": options.policy}), flush=True)
    stop = stop_event()
    try:
        await stop.wait()
    finally:
        await handle.stop()
