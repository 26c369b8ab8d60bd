"""The Envoy bootstrap epp is made for: one generator for what ``deploy/envoy/`` ships, what
``epp envoy-config`` prints and what the local stack and the real-Envoy tests run.

The request path (docs/envoy.md)::

    client -> listener -> ext_proc (epp) -> router -> pool cluster -> the model server epp named

* **The pool cluster** lists the model servers (``ip:port``, or a DNS name whose A records are
  the servers, e.g. a headless Service). Its load balancer is Envoy's ``override_host``
  policy: the host comes from epp's ``x-gateway-destination-endpoint`` (header, or the
  ``envoy.lb`` metadata epp also sets; a comma-separated list's later entries are fallbacks
  tried on retries), and without one, from the fallback policy (least-request by default).
  A client can only ever name a host of the pool. Without a pool (``pool=()``) the cluster is
  ``ORIGINAL_DST`` on that header, as the Inference Extension's standalone example does: any
  ``ip:port`` epp names, but nothing to fall back to.
* **Fail open** (``failure="open"``, the default): when no epp answers (all down, refused,
  timed out), Envoy skips ext_proc and the request goes to the fallback policy; routing by epp
  resumes on the next request that reaches one. Envoy can only fail open before it has sent
  the request body to ext_proc, and in ``FULL_DUPLEX_STREAMED`` it sends the body at once,
  before it learns that the stream failed, so fail-open needs ``BUFFERED`` request bodies
  (Envoy sends the body after epp answered the headers). epp reads the whole body before it
  picks in either mode. ``failure="closed"`` answers 500 instead (any request mode).
* **The epp cluster**: HTTP/2, gRPC health checks every second and outlier detection, so a
  dead replica leaves the rotation within ~1-2 s; circuit breakers far above Envoy's default
  of 1,024 concurrent requests (each HTTP request holds one ext_proc stream).
* **The response** (``response="summary"``, the default): epp reads the response headers
  and, of a streamed (SSE) answer, only its first body bytes (the first-token time), then
  ends its ext_proc stream so that Envoy passes the rest without it; Envoy's
  ``ai_protocol_manager`` filter reads the answer's ``usage`` as it streams by, and one entry
  of Envoy's gRPC access log per request (batched) brings epp the end of the exchange: its
  status, usage with cached tokens, and bytes. epp's cost for an answer does not grow with
  its length (docs/envoy.md). ``full-duplex`` sends every chunk through epp (it also reads
  the reply text), ``observer`` to a second stream Envoy never waits for, ``none`` nothing.
* **Baselines** (``routing`` random / round-robin / least-request): no ext_proc at all, the
  pool cluster balanced by that policy: what "without epp" means in the demo.
* **Settings that span Envoy and epp** (:class:`EppNeeds`, from epp's config): Envoy's
  per-message timeout must outlast the longest time epp may hold a request (flow control's
  queue wait, its own work: precise keying of a long prompt, the P/D decision), or Envoy
  gives up on a queued request and, failing open, sends it to a server epp did not choose;
  the stream idle timeout must outlast it too (a queued request is silent); Envoy's buffer
  limit must not exceed epp's body cap (above epp's gRPC message limit the stream fails and
  Envoy fails open). :func:`derive` fills the settings a user did not give from those needs
  and :func:`mismatches` names each one that contradicts them.
* **Several pools** (``pools``: one model, or several, per pool, one epp per pool): see
  :func:`add_pools`.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epp.config.loader import EppConfig

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
"""Dynamic metadata namespace whose ``x-gateway-destination-endpoint-subset`` list bounds
epp's choice (the Inference Extension's subset hint), forwarded to epp when present."""
UPSTREAM_HOST_HEADER = "x-upstream-host"
"""Response header naming the server that answered (``%UPSTREAM_HOST%``), when asked for."""
EPP_ONLY_REQUEST_HEADERS = ("x-prefiller-host-port",)
"""Request headers only epp sets (its P/D handler: where the decoder's sidecar prefills);
the bootstrap removes a client's copy before ext_proc (``_strip_filter``)."""
FAIL_OPEN_HEADER = "x-epp-fail-open"
"""Set on every response by the route and removed by epp from the responses it routed
(``epp.extproc.convert.FAIL_OPEN_HEADER``): a response that still carries it was served
without epp (fail-open). Only where epp sees the response headers (``response`` summary or
full-duplex)."""
ROUTINGS = ("epp", "random", "round-robin", "least-request")
REQUEST_BODY_MODES = ("buffered", "full-duplex")
RESPONSE_MODES = ("summary", "full-duplex", "observer", "none")
SUMMARY_DECLARATION = ("x-epp-response", "summary")
"""gRPC metadata on the routing filter's ext_proc streams (``grpc_service.initial_metadata``):
this proxy sends epp a summary of each response in its access log, so epp may stop reading a
streamed answer after its first bytes (``epp.extproc.summary``)."""
TOKEN_NAMESPACE = "epp"
"""Dynamic metadata namespace where epp's routing reply leaves the request's token
(``token``): the access log entry carries it back to epp."""
USAGE_NAMESPACE = "envoy.ai.token_usage"
"""Where Envoy's ``ai_protocol_manager`` filter publishes an answer's usage (typed metadata,
``envoy.data.ai.v3.TokenUsage``)."""
SUMMARY_LOG_NAME = "epp-response-summary"
DEFAULT_SUMMARY_FLUSH_S = 0.0
"""How long Envoy batches the access log entries of the responses that ended before it sends
them to epp (one batch a worker); 0 sends each entry as it is written (``buffer_size_bytes``
0). The end must come at once: the load scores read the requests in flight, and a
conversation's next turn, sent the instant its answer ended, found its own server still
charged with that answer and moved (batched every 50 ms, then 5 ms, the demo on real vLLM
fell behind reading every chunk; unbatched, level:
docs/research/2026-11-29-streamed-answers-through-envoy.md)."""
FAILURE_MODES = ("open", "closed")
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
"""The listener's buffer limit: Envoy answers 413 to a buffered request body above it. The
same as ``epp serve --max-body-bytes``'s default."""
DEFAULT_MESSAGE_TIMEOUT_S = 5.0
"""Envoy's wait for each epp reply when epp holds no request (flow control off)."""
DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
"""Envoy resets a request whose stream is silent this long (the route's ``idle_timeout``): a
streamed answer may pause for minutes before its first token (a long prefill in a busy
server's queue)."""
EPP_WORK_S = 5.0
"""What epp's own work on one message may take beyond any queue wait: parsing, scheduling,
the P/D decision (milliseconds on an idle host: docs/results/long_prompts.md), with room for
a loaded one."""

_LB_EXTENSIONS = {
    "random": ("envoy.load_balancing_policies.random", "random.v3.Random"),
    "round-robin": ("envoy.load_balancing_policies.round_robin", "round_robin.v3.RoundRobin"),
    "least-request": (
        "envoy.load_balancing_policies.least_request",
        "least_request.v3.LeastRequest",
    ),
}
ACCESS_LOG_FIELDS = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "upstream": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    # microseconds from the first byte Envoy received from the client
    "request_end_us": "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%",
    "upstream_sent_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "upstream_headers_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    "upstream_first_body_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    "client_first_byte_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%",
    "upstream_end_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_END:us)%",
    "client_end_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
}
"""The access log's fields (``access_log``). The durations are Envoy's own clock, from the
request's first byte: ``upstream_sent_us`` is when the request left for the server (epp's
pick and the body exchange before it), ``upstream_first_body_us`` the server's first body
bytes (a streamed completion's first token), ``client_first_byte_us`` when the response's
first byte went to the client (after epp saw the headers)."""
_TYPE = "type.googleapis.com/envoy.extensions."
_HUGE = 1_000_000
"""Circuit-breaker thresholds: no limit of Envoy's own below what the servers can take."""


MODEL_HEADER = "x-gateway-model-name"
"""The request's model as the body names it (set by ``epp model-router``)."""
BASE_MODEL_HEADER = "x-gateway-base-model-name"
"""The base model of the request's model (itself, or a LoRA adapter's base): what the routes
match to pick the pool (the Inference Extension's body-based router's header)."""
POOL_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(slots=True, frozen=True)
class PoolRoute:
    """One pool behind a multi-pool Envoy: the base models routed to it, its model servers
    and its epp."""

    name: str
    """A DNS label (``chat``): its clusters are ``pool-NAME`` and ``epp-NAME``."""
    models: tuple[str, ...]
    """Base models whose requests (and their adapters') go to this pool."""
    servers: tuple[str, ...]
    """The pool's model servers, ``host:port`` (a DNS name stands for all its records)."""
    epp: tuple[str, ...] = ()
    """The pool's epp replicas, ``host:port``."""


@dataclass(slots=True, frozen=True)
class EnvoyOptions:
    listen_address: str = "0.0.0.0"
    listen_port: int = 8081
    admin_port: int = 19000
    """Envoy's admin interface, on 127.0.0.1 only (0 = any free port)."""
    epp: tuple[str, ...] = ("127.0.0.1:9002",)
    """epp's ext_proc address(es), ``host:port``; a DNS name is resolved (all its records)."""
    pool: tuple[str, ...] = ()
    """The model servers, ``host:port``. Empty: an ``ORIGINAL_DST`` cluster (fail-closed)."""
    routing: str = "epp"
    failure: str = "open"
    request_body: str = "buffered"
    response: str = "summary"
    fallback_lb: str = "least-request"
    """Who picks a server when epp named none (fail-open) or named servers that all failed."""
    retries: int = 2
    """Retries on a refused or reset connection (the next name in epp's list, else another
    server from the fallback policy)."""
    message_timeout_s: float = 5.0
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    """Envoy resets a request silent this long (the route's ``idle_timeout``): above the
    longest gap of a streamed answer and the longest time epp may hold a request."""
    upstream_idle_timeout_s: float = 4.0
    """Envoy closes a connection to a model server idle this long. It must be below the
    servers' own keep-alive (vLLM's and SGLang's uvicorn: 5 s), so that Envoy, not the
    server, closes an idle connection: otherwise a request Envoy writes onto a connection the
    server is closing fails with a 503 ("upstream connect error or disconnect/reset before
    headers. reset reason: connection termination"), which no retry covers once the request
    was sent."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    upstream_host_header: bool = False
    """Add ``x-upstream-host: ip:port`` to responses (the stack and tests read it)."""
    epp_health_interval_s: float = 1.0
    access_log: str = ""
    """A file Envoy appends one JSON line per request to (``ACCESS_LOG_FIELDS``): where the
    time went between the client, Envoy, epp and the server. Empty: no access log."""
    pools: tuple[PoolRoute, ...] = ()
    """Several pools behind this listener (``add_pools``); ``epp`` and ``pool`` are then
    unused: each pool names its own."""
    model_router: tuple[str, ...] = ("127.0.0.1:9005",)
    """With ``pools``: ``epp model-router``'s ext_proc address(es), ``host:port``."""
    summary_flush_s: float = DEFAULT_SUMMARY_FLUSH_S
    """``response="summary"``: the access log's flush interval towards epp."""

    def validate(self) -> None:
        """Raise ValueError naming the setting that cannot work."""
        _check_envoy_values(self)
        if self.pools:
            _validate_pools(self)
            return
        _choice("routing", self.routing, ROUTINGS)
        _choice("failure", self.failure, FAILURE_MODES)
        _choice("request_body", self.request_body, REQUEST_BODY_MODES)
        _choice("response", self.response, RESPONSE_MODES)
        _choice("fallback_lb", self.fallback_lb, tuple(_LB_EXTENSIONS))
        for name, addrs in (("epp", self.epp), ("pool", self.pool)):
            for a in addrs:
                split_host_port(a, name)
        if self.routing == "epp" and not self.epp:
            raise ValueError("routing through epp needs its address (epp)")
        if self.routing != "epp" and not self.pool:
            raise ValueError(f"routing {self.routing!r} balances over the pool: list its servers")
        if self.routing == "epp" and self.failure == "open":
            if not self.pool:
                raise ValueError(
                    "failing open needs the pool's servers: with epp down Envoy balances over "
                    "them itself (or choose failure 'closed')"
                )
            if self.request_body == "full-duplex":
                raise ValueError(
                    "failing open needs buffered request bodies: in full-duplex Envoy has "
                    "already streamed the body to ext_proc when it learns epp is down, and "
                    "then answers 500 (choose request body 'buffered' or failure 'closed')"
                )
        if self.retries < 0 or self.message_timeout_s <= 0 or self.max_request_bytes < 1:
            raise ValueError("retries >= 0, message timeout > 0 and max request bytes >= 1")
        if self.upstream_idle_timeout_s <= 0:
            raise ValueError("upstream idle timeout must be > 0 (below the servers' keep-alive)")
        if self.stream_idle_timeout_s <= 0:
            raise ValueError("stream idle timeout must be > 0")
        if self.summary_flush_s < 0:
            raise ValueError("the summary flush interval must be >= 0")


ENVOY_MAX_BYTES = (1 << 32) - 1
"""Envoy's byte limits (``per_connection_buffer_limit_bytes``) are uint32."""
ENVOY_MAX_SECONDS = 315_576_000_000
"""A protobuf Duration's largest seconds (10,000 years)."""
ENVOY_MAX_MESSAGE_TIMEOUT_S = 3600.0
"""ext_proc's ``message_timeout`` is at most an hour (its proto's validation rule)."""


def _check_envoy_values(o: EnvoyOptions) -> None:
    """Raise ValueError naming a value real Envoy rejects: a NaN, infinite or oversized
    duration, a port outside 0-65535, a buffer limit past uint32."""
    for name in ("message_timeout_s", "stream_idle_timeout_s", "upstream_idle_timeout_s",
                 "epp_health_interval_s"):  # fmt: skip
        v = getattr(o, name)
        if not (math.isfinite(v) and 0.001 <= v <= ENVOY_MAX_SECONDS):
            raise ValueError(f"{name}: must be a finite number of seconds >= 0.001 (Envoy's "
                             f"timeouts count milliseconds) and <= {ENVOY_MAX_SECONDS}, got "
                             f"{v!r}")  # fmt: skip
    if o.message_timeout_s > ENVOY_MAX_MESSAGE_TIMEOUT_S:
        raise ValueError(f"message_timeout_s: Envoy's ext_proc message_timeout is at most "
                         f"{ENVOY_MAX_MESSAGE_TIMEOUT_S:g} s, got {o.message_timeout_s:g}")
    for name in ("listen_port", "admin_port"):
        if not 0 <= getattr(o, name) <= 65535:
            raise ValueError(f"{name}: must be a port 1-65535 (0 = any free port), "
                             f"got {getattr(o, name)}")  # fmt: skip
    if o.max_request_bytes > ENVOY_MAX_BYTES:
        raise ValueError(
            f"max request bytes {o.max_request_bytes} (listener per_connection_buffer_limit_"
            f"bytes, from epp's body cap unless --max-request-bytes is given): Envoy takes at "
            f"most {ENVOY_MAX_BYTES} (a uint32)"
        )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


def split_host_port(address: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {address!r} is not host:port")
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _duration(seconds: float) -> str:
    """A protobuf Duration as Envoy's JSON/YAML takes it: ``300s``, ``0.2s`` (never an
    exponent: ``3.1536e+07s`` is refused)."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def _lb_policy(name: str) -> dict[str, Any]:
    extension, message = _LB_EXTENSIONS[name]
    typed = {"@type": f"{_TYPE}load_balancing_policies.{message}"}
    return {"policies": [{"typed_extension_config": {"name": extension, "typed_config": typed}}]}


def _endpoints(name: str, addresses: tuple[str, ...]) -> dict[str, Any]:
    hosts = [split_host_port(a) for a in addresses]
    lb_endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
        for h, p in hosts
    ]
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def _discovery(addresses: tuple[str, ...]) -> str:
    """STATIC when every address is an IP, else STRICT_DNS (every record is a host)."""
    return "STATIC" if all(_is_ip(split_host_port(a)[0]) for a in addresses) else "STRICT_DNS"


def _breakers() -> dict[str, Any]:
    return {"thresholds": [{"max_connections": _HUGE, "max_pending_requests": _HUGE,
                            "max_requests": _HUGE, "max_retries": _HUGE}]}  # fmt: skip


def _pool_protocol(o: EnvoyOptions) -> dict[str, Any]:
    """HTTP/1.1 to the model servers, idle connections closed by Envoy before the servers'
    keep-alive closes them (``EnvoyOptions.upstream_idle_timeout_s``)."""
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": f"{_TYPE}upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": {"idle_timeout": _duration(o.upstream_idle_timeout_s)},
        "explicit_http_config": {"http_protocol_options": {}},
    }}  # fmt: skip


def pool_cluster(o: EnvoyOptions) -> dict[str, Any]:
    if not o.pool:
        return {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "typed_extension_protocol_options": _pool_protocol(o),
            "original_dst_lb_config": {"use_http_header": True,
                                       "http_header_name": DESTINATION_HEADER},
            "circuit_breakers": _breakers(),
        }
    if o.routing == "epp":
        override = {
            "@type": f"{_TYPE}load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}},
            ],
            "fallback_policy": _lb_policy(o.fallback_lb),
        }
        policy = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host", "typed_config": override}}]}  # fmt: skip
    else:
        policy = _lb_policy(o.routing)
    return {
        "name": "pool",
        "type": _discovery(o.pool),
        "connect_timeout": "5s",
        "typed_extension_protocol_options": _pool_protocol(o),
        "load_balancing_policy": policy,
        "circuit_breakers": _breakers(),
        "load_assignment": _endpoints("pool", o.pool),
    }


def epp_cluster(o: EnvoyOptions) -> dict[str, Any]:
    interval = _duration(o.epp_health_interval_s)
    return {
        "name": "epp",
        "type": _discovery(o.epp),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPE}upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "connection_keepalive": {"interval": "30s", "timeout": "5s"}}},
            }
        },
        # epp answers grpc.health.v1 for "" on its ext_proc port: NOT_SERVING while it drains
        "health_checks": [{
            "timeout": "1s", "interval": interval, "no_traffic_interval": interval,
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "grpc_health_check": {},
        }],
        # a replica whose streams fail to connect leaves the rotation before its health check
        "outlier_detection": {
            "consecutive_local_origin_failure": 2,
            "split_external_local_origin_errors": True,
            "interval": "1s", "base_ejection_time": "2s", "max_ejection_percent": 100,
        },
        "circuit_breakers": _breakers(),
        "load_assignment": _endpoints("epp", o.epp),
    }


def _ext_proc_filter(o: EnvoyOptions) -> dict[str, Any]:
    request_body = "BUFFERED" if o.request_body == "buffered" else "FULL_DUPLEX_STREAMED"
    response_body, response_trailers = {
        # headers and the first body bytes; epp then ends the stream (epp.extproc.summary)
        "summary": ("STREAMED", "SKIP"),
        "full-duplex": ("FULL_DUPLEX_STREAMED", "SEND"),
    }.get(o.response, ("NONE", "SKIP"))
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"}
    metadata: dict[str, Any] = {
        # a subset of the pool set by an earlier filter (e.g. a gateway's) reaches epp
        "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]},
    }
    if o.response == "summary":
        key, value = SUMMARY_DECLARATION
        grpc_service["initial_metadata"] = [{"key": key, "value": value}]
        metadata["receiving_namespaces"] = {"untyped": [TOKEN_NAMESPACE]}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPE}filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": grpc_service,
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": request_body,
                # Envoy requires trailers sent in full-duplex
                "request_trailer_mode": "SEND" if request_body != "BUFFERED" else "SKIP",
                "response_header_mode": "SKIP" if response_body == "NONE" else "SEND",
                "response_body_mode": response_body,
                "response_trailer_mode": response_trailers,
            },
            "failure_mode_allow": o.failure == "open",
            "message_timeout": _duration(o.message_timeout_s),
            "metadata_options": metadata,
            "mutation_rules": {"allow_all_routing": True},
        },
    }


def _strip_filter() -> dict[str, Any]:
    """First in the chain: the client's copy of a header only epp may set goes before any
    other filter sees it, so it cannot reach a server when epp does not answer (fail-open).
    ``x-prefiller-host-port`` tells a decoder's P/D sidecar where to send the prompt."""
    return {
        "name": "strip-epp-only-headers",
        "typed_config": {
            "@type": f"{_TYPE}filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [
                {"remove": name} for name in EPP_ONLY_REQUEST_HEADERS]},
        },
    }


def _usage_filter() -> dict[str, Any]:
    """Envoy's own reader of LLM answers (``response="summary"``): it finds ``usage`` in JSON
    and SSE responses as they pass, without holding or changing them, and publishes it as
    ``USAGE_NAMESPACE`` metadata for the access log. Listed before the routing filter, so it
    sees the response after it (Envoy runs response filters in reverse)."""
    return {
        "name": "envoy.filters.http.ai_protocol_manager",
        "typed_config": {
            "@type": f"{_TYPE}filters.http.ai_protocol_manager.v3.AiProtocolManager",
            "response_handling": {"token_usage": {
                "include_unconfigured_routes": True, "metadata_namespace": USAGE_NAMESPACE}},
        },
    }  # fmt: skip


def _summary_log(o: EnvoyOptions) -> dict[str, Any]:
    """One gRPC access log entry per request epp routed (its token in the metadata), to epp's
    ``envoy.service.accesslog.v3.AccessLogService``: the end of each exchange, batched."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"metadata_filter": {
            "matcher": {"filter": TOKEN_NAMESPACE, "path": [{"key": "token"}],
                        "value": {"present_match": True}},
            "match_if_key_not_found": False}},
        "typed_config": {
            "@type": f"{_TYPE}access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": SUMMARY_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
                # 0: no batching, each entry sent as written (the interval is then moot)
                "buffer_size_bytes": 0 if o.summary_flush_s == 0 else 16384,
                "buffer_flush_interval": _duration(o.summary_flush_s or 1.0),
            },
        },
    }  # fmt: skip


def _observer_filter() -> dict[str, Any]:
    """The response goes to epp on a second stream that Envoy never waits for
    (``epp serve --response-observer``)."""
    return {
        "name": "epp-response-observer",
        "typed_config": {
            "@type": f"{_TYPE}filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "observability_mode": True,
            "deferred_close_timeout": "5s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "response_trailer_mode": "SEND",
            },
            "failure_mode_allow": True,
        },
    }


def _route(o: EnvoyOptions) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "pool", "timeout": "0s",
                             "idle_timeout": _duration(o.stream_idle_timeout_s)}  # fmt: skip
    if o.retries and o.pool:
        route["retry_policy"] = {
            "retry_on": "connect-failure,reset-before-request",
            "num_retries": o.retries,
            "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": f"{_TYPE}retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }],
        }
    vhost: dict[str, Any] = {"name": "all", "domains": ["*"],
                             "routes": [{"match": {"prefix": "/"}, "route": route}]}  # fmt: skip
    added = []
    if o.upstream_host_header:
        added.append({
            "header": {"key": UPSTREAM_HOST_HEADER, "value": "%UPSTREAM_HOST%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        })  # fmt: skip
    if o.routing == "epp" and o.failure == "open" and o.response in ("summary", "full-duplex"):
        added.append({
            "header": {"key": FAIL_OPEN_HEADER, "value": "true"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        })  # fmt: skip
    if added:
        vhost["response_headers_to_add"] = added
    return {"name": "inference", "virtual_hosts": [vhost]}


def envoy_config(o: EnvoyOptions) -> dict[str, Any]:
    """The Envoy bootstrap for ``o`` (a plain dict; dump it as YAML or JSON)."""
    if o.pools:
        if o.response == "summary":  # its access log goes to one epp: each pool's reads its own
            o = dataclasses.replace(o, response="full-duplex")
        o.validate()
        return add_pools(envoy_config(pool_options(o, o.pools[0])), o)
    o.validate()
    filters: list[dict[str, Any]] = [_strip_filter()]
    clusters = [pool_cluster(o)]
    access_logs: list[dict[str, Any]] = []
    if o.routing == "epp":
        if o.response == "summary":
            filters.append(_usage_filter())
            access_logs.append(_summary_log(o))
        filters.append(_ext_proc_filter(o))
        if o.response == "observer":
            filters.append(_observer_filter())
        clusters.append(epp_cluster(o))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": f"{_TYPE}filters.http.router.v3.Router"}})  # fmt: skip
    hcm = {
        "@type": f"{_TYPE}filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        # LLM responses stream for minutes: no idle or whole-request deadline of Envoy's own
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        # one x-request-id from the client (or made up here) to epp, the server and back
        "preserve_external_request_id": True,
        "always_set_request_id_in_response": True,
        "route_config": _route(o),
        "http_filters": filters,
    }
    if o.access_log:
        access_logs.append({
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": f"{_TYPE}access_loggers.file.v3.FileAccessLog",
                "path": o.access_log,
                "log_format": {"json_format": ACCESS_LOG_FIELDS},
            },
        })
    if access_logs:
        hcm["access_log"] = access_logs
    listener = {
        "name": "inference",
        "address": {"socket_address": {"address": o.listen_address, "port_value": o.listen_port}},
        "per_connection_buffer_limit_bytes": o.max_request_bytes,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": hcm}]}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": o.admin_port}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        # no cap of Envoy's own on downstream connections (silences its start-up warning)
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": f"{_TYPE}resource_monitors.downstream_connections.v3."
                "DownstreamConnectionsConfig",
                "max_active_downstream_connections": _HUGE,
            },
        }]},
    }


# --- several pools behind one listener -------------------------------------------------

MODEL_ROUTER_FILTER = "epp-model-router"
_PER_ROUTE = f"{_TYPE}filters.http.ext_proc.v3.ExtProcPerRoute"
NO_MODEL_ROUTER_BODY = (
    '{"error": {"message": "no model router answered: the gateway cannot tell which pool '
    'serves the request\'s model; retry shortly", "type": "service_unavailable", "code": 503}}'
)
"""What a request gets when ``epp model-router`` did not answer (all replicas down): it alone
knows which pool serves the body's model."""


def extproc_clusters(o: EnvoyOptions) -> tuple[str, ...]:
    """The clusters of the ext_proc servers of ``o``'s bootstrap (each pool's epp, the model
    router), which must pass their health checks before Envoy routes through them."""
    if not o.pools:
        return ("epp",) if o.routing == "epp" else ()
    epps = tuple(f"epp-{p.name}" for p in o.pools) if o.routing == "epp" else ()
    return (*epps, "model-router")


def pool_options(o: EnvoyOptions, p: PoolRoute) -> EnvoyOptions:
    """The single-pool options of pool ``p`` (its servers and its epp, the rest of ``o``)."""
    epp = p.epp if o.routing == "epp" else o.epp
    return dataclasses.replace(o, pools=(), pool=p.servers, epp=epp)


def _validate_pools(o: EnvoyOptions) -> None:
    if o.pool:
        raise ValueError("with several pools each names its servers (pool NAME=MODEL@SERVER,...)"
                         ", not a plain server list")  # fmt: skip
    if not o.model_router:
        raise ValueError("several pools need the model router's address (model router)")
    for a in o.model_router:
        split_host_port(a, "model router")
    names: set[str] = set()
    models: dict[str, str] = {}
    for p in o.pools:
        if not POOL_NAME.match(p.name):
            raise ValueError(f"pool name {p.name!r}: lower-case letters, digits and '-' (a DNS label)")
        if p.name in names:
            raise ValueError(f"pool {p.name!r} is named twice")
        names.add(p.name)
        if not p.models:
            raise ValueError(f"pool {p.name!r}: name the base models it serves")
        for m in p.models:
            if m in models:
                raise ValueError(f"model {m!r} is in pools {models[m]!r} and {p.name!r}: a "
                                 "request for it must have one pool")  # fmt: skip
            models[m] = p.name
        if o.routing == "epp" and not p.epp:
            raise ValueError(f"pool {p.name!r}: give its epp's address (epp NAME=HOST:PORT)")
        try:
            pool_options(o, p).validate()
        except ValueError as exc:
            raise ValueError(f"pool {p.name!r}: {exc}") from None


def _named(cluster: dict[str, Any], name: str) -> dict[str, Any]:
    cluster["name"] = name
    if "load_assignment" in cluster:
        cluster["load_assignment"]["cluster_name"] = name
    return cluster


def _model_router_filter(o: EnvoyOptions) -> dict[str, Any]:
    """The body-based router: reads the whole request body (BUFFERED), sets the model headers
    and clears the route cache, so the route is chosen by ``BASE_MODEL_HEADER``; never sees
    the response. Failing open: a request it did not answer matches no pool's route and gets
    ``NO_MODEL_ROUTER_BODY``."""
    return {
        "name": MODEL_ROUTER_FILTER,
        "typed_config": {
            "@type": f"{_TYPE}filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "model-router"}, "timeout": "10s"},
            "stat_prefix": "model_router",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
            "failure_mode_allow": True,
            "message_timeout": _duration(o.message_timeout_s),
        },
    }


def add_pools(config: dict[str, Any], o: EnvoyOptions) -> dict[str, Any]:
    """Turn the bootstrap of ``o``'s first pool into the bootstrap of all of ``o.pools``::

        client -> strip -> epp-model-router (ext_proc: sets x-gateway-base-model-name)
               -> ext_proc (epp: its gRPC service chosen per route, one epp per pool)
               -> router: route "x-gateway-base-model-name: MODEL" -> cluster pool-NAME

    One route per base model matches ``BASE_MODEL_HEADER`` and sends the request to its
    pool's cluster; on that route the epp filters' gRPC service is the pool's epp
    (``ExtProcPerRoute.overrides``), so each pool fails open on its own: with its epp down,
    its requests go to the fallback policy over its servers, the other pools' through their
    epps. A request that matches no route (the model router did not answer) gets a 503
    direct response. The client's copies of the model headers are removed first (the strip
    filter), so a client cannot choose its pool, even while the model router is down.
    """
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    strip = filters[0]["typed_config"]["mutations"]["request_mutations"]
    strip += [{"remove": h} for h in (MODEL_HEADER, BASE_MODEL_HEADER)]
    filters.insert(1, _model_router_filter(o))
    picked = [f for f in filters if f["typed_config"].get("grpc_service", {})
              .get("envoy_grpc", {}).get("cluster_name") == "epp"]  # fmt: skip
    first = o.pools[0].name
    for f in picked:
        f["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = f"epp-{first}"

    clusters = [c for c in config["static_resources"]["clusters"] if c["name"] not in ("pool", "epp")]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    base_route = vhost["routes"][0]["route"]
    routes: list[dict[str, Any]] = []
    for p in o.pools:
        po = pool_options(o, p)
        clusters.append(_named(pool_cluster(po), f"pool-{p.name}"))
        per_filter: dict[str, Any] = {}
        if picked:
            clusters.append(_named(epp_cluster(po), f"epp-{p.name}"))
            for f in picked:
                service = copy.deepcopy(f["typed_config"]["grpc_service"])
                service["envoy_grpc"]["cluster_name"] = f"epp-{p.name}"
                per_filter[f["name"]] = {"@type": _PER_ROUTE, "overrides": {"grpc_service": service}}
        for model in p.models:
            route = copy.deepcopy(base_route)
            route["cluster"] = f"pool-{p.name}"
            entry: dict[str, Any] = {
                "name": f"{p.name}/{model}",
                "match": {"prefix": "/", "headers": [
                    {"name": BASE_MODEL_HEADER, "string_match": {"exact": model}}]},
                "route": route,
            }  # fmt: skip
            if per_filter:
                entry["typed_per_filter_config"] = copy.deepcopy(per_filter)
            routes.append(entry)
    unmatched: dict[str, Any] = {
        "name": "no-model-router",
        "match": {"prefix": "/"},
        "direct_response": {"status": 503, "body": {"inline_string": NO_MODEL_ROUTER_BODY}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }  # fmt: skip
    if picked:
        unmatched["typed_per_filter_config"] = {
            f["name"]: {"@type": _PER_ROUTE, "disabled": True} for f in picked
        }
    vhost["routes"] = [*routes, unmatched]
    router = dataclasses.replace(o, pools=(), epp=o.model_router)
    clusters.append(_named(epp_cluster(router), "model-router"))
    config["static_resources"]["clusters"] = clusters
    return config


def render_yaml(o: EnvoyOptions, header: str = "") -> str:
    """``envoy_config(o)`` as YAML, after ``header`` (comment lines)."""
    import yaml

    body = yaml.safe_dump(envoy_config(o), sort_keys=False, width=100)
    return header + body


# --- settings that span Envoy and epp ---------------------------------------------------


@dataclass(slots=True, frozen=True)
class EppNeeds:
    """What the Envoy in front of an epp must allow for, derived from epp's config
    (:func:`needs_from_config`); each figure names the epp setting it comes from."""

    hold_s: float = 0.0
    """The longest a request may wait in epp before epp answers its body (flow control's
    queue: the longest of ``maxQueueSeconds``, the band and objective limits and the
    scale-from-zero wait); 0 without flow control."""
    hold_from: str = ""
    work_s: float = EPP_WORK_S
    """epp's own work on one message (``EPP_WORK_S``, plus what its plugins do before
    scheduling a body at the cap: precise keying, ``PluginType.prepare_s_per_body_byte``)."""
    work_from: str = "parsing and scheduling"
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_from: str = "requestControl.maxBodyBytes"
    flow_control: bool = False

    @property
    def message_timeout_s(self) -> float:
        """Envoy's per-message timeout: never below the hold plus epp's work (whole seconds)."""
        return max(DEFAULT_MESSAGE_TIMEOUT_S, float(math.ceil(self.hold_s + self.work_s)))

    @property
    def stream_idle_timeout_s(self) -> float:
        """The stream idle timeout: the default, or more than the message timeout."""
        return max(DEFAULT_STREAM_IDLE_TIMEOUT_S, self.message_timeout_s + EPP_WORK_S)

    def why_timeout(self) -> str:
        """Where the message timeout comes from, in words."""
        parts = [f"{self.hold_s:g} s of queue wait ({self.hold_from})"] if self.hold_s else []
        parts.append(f"{self.work_s:g} s of epp's own work ({self.work_from})")
        return " + ".join(parts)

    def describe(self) -> str:
        """One line: what epp's Envoy needs (logged by ``epp serve`` at start)."""
        text = (
            f"ext_proc message_timeout >= {self.message_timeout_s:g}s ({self.why_timeout()}); "
            f"route idle_timeout >= {self.stream_idle_timeout_s:g}s; listener "
            f"per_connection_buffer_limit_bytes <= {self.max_body_bytes} ({self.body_from})"
        )
        if self.flow_control:
            text += ("; with failure_mode_allow (fail-open), requests Envoy sends while no epp "
                     "answers skip flow control's queue")  # fmt: skip
        return text


def needs_from_config(cfg: EppConfig, max_body_bytes: int | None = None) -> EppNeeds:
    """What ``cfg`` (with ``epp serve --max-body-bytes`` when given) asks of Envoy."""
    from epp.plugins.registry import PLUGIN_TYPES

    body = cfg.request_control.max_body_bytes if max_body_bytes is None else max_body_bytes
    body_from = "requestControl.maxBodyBytes" if max_body_bytes is None else "--max-body-bytes"
    hold_s, hold_from = 0.0, ""
    fc = cfg.flow_control
    if fc.enabled:
        candidates = [(fc.max_queue_seconds, "flowControl.maxQueueSeconds"),
                      (fc.cold_seconds, "flowControl.scaleFromZeroSeconds")]  # fmt: skip
        candidates += [(v, f"flowControl.bandMaxQueueSeconds.{k}")
                       for k, v in fc.band_max_queue_seconds.items()]  # fmt: skip
        candidates += [(v, f"flowControl.objectiveMaxQueueSeconds.{k}")
                       for k, v in fc.objective_max_queue_seconds.items()]  # fmt: skip
        hold_s, hold_from = max(candidates, key=lambda c: c[0])
        if hold_from.endswith("scaleFromZeroSeconds") and fc.scale_from_zero_seconds is None:
            hold_from = "flowControl.maxQueueSeconds"
    work_s, work_from = EPP_WORK_S, "parsing and scheduling"
    for spec in cfg.plugins.values():
        per_byte = PLUGIN_TYPES[spec.type].prepare_s_per_body_byte
        if per_byte:
            keying = round(body * per_byte, 1)
            work_s += keying
            work_from += f", {spec.name} preparing a {body}-byte body (~{keying:g} s)"
    return EppNeeds(hold_s, hold_from, work_s, work_from, body, body_from, fc.enabled)


@dataclass(slots=True, frozen=True)
class Mismatch:
    """An Envoy setting that contradicts epp's config."""

    envoy: str
    """The Envoy setting, as ``epp envoy-config`` names it and as the bootstrap spells it."""
    epp: str
    """The epp setting it must agree with."""
    problem: str
    fatal: bool = True
    """False: a consequence worth knowing, not a contradiction (printed as a warning)."""

    def __str__(self) -> str:
        return f"{self.envoy} vs {self.epp}: {self.problem}"


def mismatches(o: EnvoyOptions, needs: EppNeeds) -> list[Mismatch]:
    """Every setting of ``o`` that does not agree with ``needs`` (empty: they agree)."""
    if o.routing != "epp":
        return []  # a baseline without epp
    out: list[Mismatch] = []
    timeout = needs.message_timeout_s
    if timeout > ENVOY_MAX_MESSAGE_TIMEOUT_S:
        out.append(Mismatch(
            "ext_proc message_timeout", needs.hold_from or needs.work_from,
            f"epp may hold a request {timeout:g} s before it answers ({needs.why_timeout()}); "
            f"Envoy's ext_proc message_timeout is at most {ENVOY_MAX_MESSAGE_TIMEOUT_S:g} s. "
            "Lower the epp setting",
        ))  # fmt: skip
    if o.message_timeout_s < timeout:
        then = ("fails open and sends it to a server epp did not choose" if o.failure == "open"
                else "answers 500")  # fmt: skip
        out.append(Mismatch(
            f"--message-timeout-s {o.message_timeout_s:g} (ext_proc message_timeout)",
            needs.hold_from or needs.work_from,
            f"epp may hold a request {timeout:g} s before it answers ({needs.why_timeout()}); "
            f"Envoy gives up after {o.message_timeout_s:g} s and {then}. Set it to at least "
            f"{timeout:g} (or lower the epp setting)",
        ))  # fmt: skip
    if o.stream_idle_timeout_s < timeout:
        out.append(Mismatch(
            f"--stream-idle-timeout-s {o.stream_idle_timeout_s:g} (route idle_timeout)",
            needs.hold_from or needs.work_from,
            f"a request epp holds is silent for up to {timeout:g} s and Envoy resets it after "
            f"{o.stream_idle_timeout_s:g} s. Set it to at least {needs.stream_idle_timeout_s:g}",
        ))  # fmt: skip
    elif o.stream_idle_timeout_s < needs.stream_idle_timeout_s:
        out.append(Mismatch(
            f"--stream-idle-timeout-s {o.stream_idle_timeout_s:g} (route idle_timeout)",
            "streamed answers",
            f"a streamed answer may pause for minutes before its first token (a long prefill "
            f"in a busy server's queue) and Envoy resets it after {o.stream_idle_timeout_s:g} "
            f"s. Set it to at least {needs.stream_idle_timeout_s:g}", fatal=False,
        ))  # fmt: skip
    if o.max_request_bytes > needs.max_body_bytes:
        out.append(Mismatch(
            f"--max-request-bytes {o.max_request_bytes} (listener "
            "per_connection_buffer_limit_bytes)",
            f"{needs.body_from} {needs.max_body_bytes}",
            "Envoy buffers bodies epp refuses, and one above epp's gRPC message limit fails "
            "the stream, which Envoy fails open on: the request reaches a server unrouted. "
            f"Set it to at most {needs.max_body_bytes} (or raise epp's cap)",
        ))  # fmt: skip
    if needs.flow_control and o.failure == "open":
        out.append(Mismatch(
            "--failure open (ext_proc failure_mode_allow)", "flowControl.enabled",
            "while no epp answers (all replicas down or unreachable), Envoy sends requests "
            "straight to the pool, past flow control's queue; --failure closed answers 500 "
            "instead", fatal=False,
        ))  # fmt: skip
    return out


DERIVED = ("message_timeout_s", "stream_idle_timeout_s", "max_request_bytes")
"""The ``EnvoyOptions`` fields :func:`derive` fills from epp's needs when not given."""


def derive(o: EnvoyOptions, needs: EppNeeds, given: frozenset[str] = frozenset()) -> EnvoyOptions:
    """``o`` with each of ``DERIVED`` not in ``given`` set from ``needs``."""
    values: dict[str, Any] = {"message_timeout_s": needs.message_timeout_s,
                              "stream_idle_timeout_s": needs.stream_idle_timeout_s,
                              "max_request_bytes": needs.max_body_bytes}  # fmt: skip
    return replace(o, **{k: v for k, v in values.items() if k not in given})


def _seconds(text: Any, default: float) -> float:
    """An Envoy duration (``"5s"``, ``"0.2s"``, ``"1.5s"``), or ``default`` when absent."""
    if text is None:
        return default
    value = str(text).strip()
    try:
        seconds = float(value[:-1]) if value.endswith("s") else math.nan
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not an Envoy duration like 5s")
    return math.inf if seconds == 0 else seconds  # 0s: no timeout


def options_of_bootstrap(doc: Any) -> EnvoyOptions:
    """The settings :func:`mismatches` reads, from an Envoy bootstrap (a parsed YAML/JSON
    document, e.g. one ``epp envoy-config`` printed earlier); Envoy's defaults where the
    bootstrap sets nothing. Raises ValueError when it has no listener with an ext_proc filter
    routing through epp."""
    try:
        return _options_of_bootstrap(doc)
    except (AttributeError, TypeError) as exc:  # a list where a mapping belongs, ...
        raise ValueError(f"not an Envoy bootstrap ({exc})") from None


def _options_of_bootstrap(doc: Any) -> EnvoyOptions:
    listeners = ((doc or {}).get("static_resources") or {}).get("listeners") or []
    for listener in listeners:
        for chain in listener.get("filter_chains") or []:
            for f in chain.get("filters") or []:
                hcm = f.get("typed_config") or {}
                filters = hcm.get("http_filters") or []
                ext = [h.get("typed_config") or {} for h in filters
                       if h.get("name") == "envoy.filters.http.ext_proc"]  # fmt: skip
                if not ext:
                    continue
                proc = ext[0]
                mode = (proc.get("processing_mode") or {}).get("request_body_mode", "NONE")
                idle = _seconds(hcm.get("stream_idle_timeout"), DEFAULT_STREAM_IDLE_TIMEOUT_S)
                for vhost in (hcm.get("route_config") or {}).get("virtual_hosts") or []:
                    for route in vhost.get("routes") or []:
                        r = route.get("route") or {}
                        if "idle_timeout" in r:
                            idle = _seconds(r["idle_timeout"], idle)
                return EnvoyOptions(
                    failure="open" if proc.get("failure_mode_allow") else "closed",
                    request_body="buffered" if mode == "BUFFERED" else "full-duplex",
                    message_timeout_s=_seconds(proc.get("message_timeout"), 0.2),
                    stream_idle_timeout_s=idle,
                    max_request_bytes=int(listener.get("per_connection_buffer_limit_bytes",
                                                       1 << 20)),
                )  # fmt: skip
    raise ValueError("no listener with an envoy.filters.http.ext_proc filter (not a bootstrap "
                     "that routes through epp)")
