"""``epp-sim gateway``: run the development gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from simulator.clihelp import HelpFormatter, deprecated_alias, stop_event
from simulator.gateway.extproc import MODE_NAMES
from simulator.gateway.proxy import DEFAULT_BUFFER_LIMIT_BYTES, POLICIES, GatewayOptions
from simulator.gateway.server import start_gateway


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
    if envoy:
        p.add_argument(
            "--response-mode",
            default=None,
            metavar="MODE[,MODE...]",
            help="how responses reach epp: 'summary', real Envoy's unless set (epp reads a "
            "streamed answer's first bytes, Envoy's access log brings the usage and the end; "
            "epp envoy-config --response summary), or an ext_proc response_body_mode ("
            + ", ".join(sorted(MODE_NAMES)) + "; full-duplex with --gateway python). "
            "Several, comma-separated: the demo runs epp once per mode",
        )
    else:
        p.add_argument(
            "--response-mode",
            choices=sorted(MODE_NAMES),
            default=None,
            help="ext_proc response_body_mode (default: full-duplex)",
        )
    p.add_argument(
        "--response-observer",
        action="store_true",
        help="send each response to epp on a second ext_proc stream in observability_mode "
        "(send and go: chunks are not held for epp's reply), as a second Envoy ext_proc "
        "filter does; the routing stream then skips the response (epp serve "
        "--response-observer)",
    )


def modes_from_args(args: argparse.Namespace) -> tuple[int, int]:
    return MODE_NAMES[args.request_body], MODE_NAMES[args.response_mode or "full-duplex"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="HTTP front proxy that plays Envoy's ext_proc part for epp",
        description=(
            "Proxy HTTP requests to model servers the way Envoy with the ext_proc filter does: "
            "one ext_proc stream per request to epp, header/body mutations applied, the "
            "request sent to the endpoint epp named (x-gateway-destination-endpoint or "
            "envoy.lb metadata; later entries are fallbacks) and the response streamed back "
            "through ext_proc. --policy random|round-robin bypasses epp (the baseline). "
            'Prints one JSON line {"gateway_url": ...} once listening.'
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0 = any free port)")
    p.add_argument("--policy", choices=POLICIES, default="epp", help="who picks the endpoint")
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
    p.add_argument(
        "--buffer-limit-bytes",
        type=int,
        default=DEFAULT_BUFFER_LIMIT_BYTES,
        help="largest body held whole (a BUFFERED body; a request body kept for a retry): "
        "413 above it for a request, 500 for a response (Envoy's buffer limit)",
    )
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random policy (default: a new one each run)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    request, response = modes_from_args(args)
    endpoints = tuple(e.strip() for e in args.endpoints.split(",") if e.strip())
    try:
        options = GatewayOptions(
            host=args.host,
            port=args.port,
            policy=args.policy,
            extproc=args.epp,
            endpoints=endpoints,
            request_mode=request,
            response_mode=response,
            response_observer=args.response_observer,
            message_timeout_s=args.message_timeout_s,
            buffer_limit_bytes=args.buffer_limit_bytes,
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
