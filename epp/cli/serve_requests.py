"""``epp serve``'s "scheduling and requests" flags: the config, the body modes, and the bounds
on what requests and responses may make epp hold."""

from __future__ import annotations

import argparse

from epp.cli.flags import body_size, byte_size, number, seconds
from epp.config.loader import SHIPPED
from epp.extproc import convert
from epp.extproc.observer import DEFAULT_WAIT_S as OBSERVER_WAIT_S
from epp.extproc.service import DEFAULT_MAX_OPEN_STREAMS
from epp.extproc.stream import DEFAULT_MAX_BUFFERED_BYTES
from epp.request.parse import CONTROL_HEADER_EFFECTS
from epp.request.settings import DEFAULT_MAX_BODY_BYTES
from epp.requestcontrol.director import DEFAULT_MAX_LEARNING_BYTES
from epp.requestcontrol.response import (
    MAX_HELD_BYTES,
    MAX_JSON_BYTES,
    MAX_SSE_LINE_BYTES,
    ResponseLimits,
)

PROCESSING_MODES = {"full-duplex": convert.FULL_DUPLEX_STREAMED, "buffered": convert.BUFFERED}
"""``--processing-mode`` -> the body mode assumed when Envoy sends no protocol_config."""


def add_request_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("scheduling and requests")
    g.add_argument("--config", default="",
                   help="YAML config file, or a shipped profile name ("
                   + ", ".join(SHIPPED) + "; conformance carries the Inference Extension's test "
                   "hooks, never for production; docs/configuration.md); default: the shipped "
                   "'default' profile")
    g.add_argument("--processing-mode", choices=sorted(PROCESSING_MODES), default="full-duplex",
                   help="request/response body mode assumed when Envoy sends no protocol_config "
                   "(Envoy >= 1.33 sends it; it then wins)")
    g.add_argument("--fallbacks", type=number(0, strict=False, integer=True), default=None,
                   help="fallback endpoints appended to x-gateway-destination-endpoint "
                   "(default: config requestControl.fallbacks, else 0)")
    g.add_argument("--max-body-bytes", type=body_size, default=None,
                   help=f"request body cap, 413 above it (default: config, else "
                   f"{DEFAULT_MAX_BODY_BYTES // (1 << 20)}MiB; at most 1023MiB)")

    g.add_argument("--max-buffered-bytes", type=byte_size, default=DEFAULT_MAX_BUFFERED_BYTES,
                   help="request-body bytes all open streams may hold together; a request "
                   "that would pass it gets 503 (bounds memory under many slow uploads)")
    g.add_argument("--max-learning-bytes", type=byte_size, default=DEFAULT_MAX_LEARNING_BYTES,
                   help="prompt text and chain hashes all requests in flight keep to learn "
                   "from their replies (the parsed body goes at the pick); a request past it "
                   "keeps none, and its reply is not learnt from (it is routed as any other)")
    g.add_argument("--response-observer", action="store_true",
                   help="responses come on a second ext_proc filter's stream in Envoy's "
                   "observability_mode (send and go: Envoy does not wait for epp on each "
                   "response chunk); the routing filter then skips the response: the "
                   "bootstrap epp envoy-config --response observer prints (deploy/envoy/"
                   "envoy-observer.yaml). See docs/serve.md")
    g.add_argument("--response-observer-wait-s", type=seconds(),
                   default=OBSERVER_WAIT_S,
                   help="with --response-observer: how long a routed request waits for its "
                   "observer stream before it is released as unobserved")
    g.add_argument("--max-open-streams", type=number(1, strict=False, integer=True),
                   default=DEFAULT_MAX_OPEN_STREAMS,
                   help="ext_proc streams (HTTP requests in flight through Envoy) open at once; "
                   "a new one past it is answered 503 (each holds ~25 KB even idle)")
    g.add_argument("--max-sse-line-bytes", type=byte_size, default=MAX_SSE_LINE_BYTES,
                   help="longest line of a streamed (SSE) response epp holds to read usage "
                   "from; a longer one is forwarded as it comes, unread")
    g.add_argument("--max-response-json-bytes", type=byte_size, default=MAX_JSON_BYTES,
                   help="largest JSON response epp holds to read usage from (or to map a "
                   "rewritten model back); a larger one is forwarded unread, its model "
                   "rewritten in place")
    g.add_argument("--max-buffered-response-bytes", type=byte_size, default=MAX_HELD_BYTES,
                   help="response bytes all open streams may hold together (JSON bodies and "
                   "unfinished SSE lines being read); past it, responses are forwarded unread")
    g.add_argument("--trust-control-headers", action="store_true",
                   help="honour the headers that steer epp on requests: " + "; ".join(
                       f"{name} ({effect})" for name, effect in CONTROL_HEADER_EFFECTS.items())
                   + ". Only set this when a proxy in front sets or strips them: otherwise "
                   "clients choose their own model and priority, and learn the pool's "
                   "endpoints from the pick's reason. Without it they are ignored and removed "
                   "before the request reaches the model server")


def response_limits(args: argparse.Namespace) -> ResponseLimits:
    """What a model server's response may make epp hold while it reads usage from it."""
    return ResponseLimits(args.max_response_json_bytes, args.max_sse_line_bytes,
                          args.max_buffered_response_bytes)
