"""``epp pd-sidecar``: the decode-side proxy of prefill/decode disaggregation, next to vLLM
(``epp.sidecar.proxy``; docs/disaggregation.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from epp.cli.flags import byte_size, port, seconds
from epp.clihelp import HelpFormatter, stop_event
from epp.errors import ConfigError
from epp.observability.tracing import ENV_HELP as TRACING_ENV_HELP
from epp.observability.tracing import tracing_from_env


def add_pd_sidecar(sub: Any) -> None:
    from epp.sidecar.proxy import CONNECTORS

    p = sub.add_parser(
        "pd-sidecar",
        help="run the decode-side proxy of prefill/decode disaggregation, next to vLLM",
        description="Proxy a decoding model server: a request carrying x-prefiller-host-port "
        "(set by epp's disagg-profile-handler) is prefilled on that server first "
        "(max_tokens 1), then decoded locally with the KV cache the prefill produced; a "
        "prefill that fails or times out is decoded locally instead (counted). Speaks llm-d's "
        "routing-sidecar protocol. See docs/disaggregation.md.",
        epilog=TRACING_ENV_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--port", type=port, default=8000, help="port the gateway routes to")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--decoder", default="http://127.0.0.1:8200",
                   help="the local (decoding) server's base URL")
    p.add_argument("--connector", choices=CONNECTORS, default="shared-storage",
                   help="how KV moves from prefiller to decoder: 'shared-storage' (vLLM's "
                   "ExampleConnector, LMCache: nothing passes) or 'nixlv2' (vLLM's "
                   "NixlConnector: kv_transfer_params pass through the sidecar)")
    p.add_argument("--prefill-timeout-s", type=seconds(), default=60.0,
                   help="after this the request is decoded locally instead")
    p.add_argument("--allowed-prefillers", default="",
                   help="required: where prefills may go, comma-separated NETWORK[:PORT] "
                   "entries (10.0.0.0/8:8000, [fd00::/8]:8000): the networks and port your "
                   "prefill pods run on. x-prefiller-host-port can come from anyone who reaches "
                   "the pod, so any other target is refused (decoded locally, counted); "
                   "loopback and link-local targets only by an entry inside those ranges "
                   "(127.0.0.1/32:8100)")
    p.add_argument("--max-body-bytes", type=byte_size, default=16 << 20,
                   help="largest request body accepted")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level")
    p.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="JSON lines (production) or plain text")


async def run(args: argparse.Namespace) -> int:
    """Proxy until SIGTERM / SIGINT; 2 for bad flags."""
    from epp.sidecar.proxy import SidecarConfig, parse_networks, run

    try:
        nets = parse_networks(args.allowed_prefillers)
    except ValueError as exc:
        print(f"epp pd-sidecar: --allowed-prefillers: {exc}", file=sys.stderr)
        return 2
    if not nets:
        print("epp pd-sidecar: --allowed-prefillers is required: the networks (and port) your "
              "prefill pods run on, e.g. --allowed-prefillers 10.0.0.0/8:8000. Without it a "
              "forged x-prefiller-host-port could send the prompt anywhere the pod reaches.",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = SidecarConfig(decoder=args.decoder, connector=args.connector,
                        prefill_timeout_s=args.prefill_timeout_s, allowed_prefillers=nets,
                        max_body_bytes=args.max_body_bytes)  # fmt: skip
    try:
        tracing = tracing_from_env()  # the OTEL_* variables, as epp serve reads them
    except ConfigError as exc:
        print(f"epp pd-sidecar: {exc}", file=sys.stderr)
        return 2
    stop = stop_event()
    await run(cfg, args.host, args.port, stop, tracing)
    return 0
