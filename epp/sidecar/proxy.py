"""``epp pd-sidecar``: the decode-side proxy of disaggregated serving.

It runs next to a decoding vLLM server and takes the traffic the gateway routes to that
pod. A request that carries ``x-prefiller-host-port`` (set by epp's ``disagg-profile-handler``)
is prefilled there first, then decoded locally with the KV cache the prefill produced:

1. the prefill: the same body sent to the prefiller with ``max_tokens: 1``, ``stream: false``
   (and, for the NIXL connector, ``kv_transfer_params.do_remote_decode: true``);
2. the decode: the original body sent to the local server (for NIXL, with the
   ``kv_transfer_params`` the prefiller returned), its response streamed back as it comes.

This is the protocol of llm-d's routing sidecar, so either can run in front of a decoder:
``--connector nixlv2`` (vLLM's NixlConnector) or ``shared-storage`` (connectors that share KV
through storage: vLLM's ExampleConnector, LMCache; the prefill writes it, the decoder finds
it by the prompt's hash, no parameters pass).

Where a prefill may go: ``x-prefiller-host-port`` reaches the sidecar from whoever can send
to the decoder's pod, and epp strips a client's copy only when it routes the request (not when
it is down and the gateway fails open). So the sidecar takes only prefillers inside
``allowed_prefillers``, networks with an optional port (``10.0.0.0/8:8000``) that the
operator must give (the start fails without one): the networks and port the prefill pods run
on. Loopback, link-local (``169.254.169.254``, the cloud metadata service), unspecified and
multicast addresses are refused even inside a wide network such as ``0.0.0.0/0``; only an
entry wholly inside such a range (``127.0.0.1/32:8100`` for a stack on one host) allows
them. The list is logged at start, with a warning for an entry that allows every address.

The prefill leg asks for exactly one token: every field that constrains the output's length
or count is made consistent with that (``PREFILL_OVERRIDES``), or the server would refuse the
prefill (vLLM answers 400 to ``max_tokens: 1`` with ``min_tokens: 5``) and every such request
would silently be decoded locally.

A prefill that fails, times out or names a prefiller not allowed is never fatal: the request
is decoded locally in full, a warning is logged, ``epp_sidecar_prefill_total{outcome}``
counts why and ``epp_sidecar_requests_total{split="fallback"}`` that it happened (``yes``
counts the requests actually split, ``no`` those that asked for no split). Nor is a decode
the decoder refuses with the transferred KV (NIXL: HTTP 5xx to the body with the prefiller's
``kv_transfer_params``, as a first handshake under load can give): the original body is sent
to it again, decoded in full, and ``epp_sidecar_decode_retries_total`` counts it. Token-id
prompts pass through unchanged. A client that goes away cancels the
upstream request. Requests without the header, and every other path (``/metrics``,
``/health``, ``/v1/models``), are proxied to the decoder as they are. The sidecar's own
metrics are at ``/sidecar/metrics``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epp.framework.endpoint import parse_endpoint_id
from epp.observability.tracing import Tracing
from epp.request.parse import PREFILLER_HEADER

log = logging.getLogger(__name__)

CONNECTORS = ("shared-storage", "nixlv2")
PREFILL_OVERRIDES: dict[str, Any] = {
    "max_tokens": 1,  # OpenAI, vLLM, SGLang
    "max_completion_tokens": 1,  # OpenAI chat; vLLM takes it over max_tokens
    "max_new_tokens": 1,  # SGLang's sampling_params name
    "n": 1,
    "stream": False,
}
"""Fields the prefill leg sets (those of them the request carries, and ``max_tokens``,
``n`` and ``stream`` always)."""
PREFILL_DROPPED = ("min_tokens", "min_new_tokens", "best_of", "use_beam_search", "beam_width",
                   "length_penalty", "stream_options")  # fmt: skip
"""Fields the prefill leg removes: each would contradict one output token (vLLM checks
``min_tokens <= max_tokens``; ``best_of`` and beam search ask for several sequences) or only
makes sense with a stream."""
_SPECIAL_ADDRESS = ("is_loopback", "is_link_local", "is_unspecified", "is_multicast")
_SPLIT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                          "te", "trailers", "transfer-encoding", "upgrade", "host",
                          "content-length"})  # fmt: skip
_WARN_PERIOD_S = 30.0


@dataclass(slots=True, frozen=True)
class SidecarConfig:
    decoder: str = "http://127.0.0.1:8200"
    """The local (decoding) server's base URL."""
    connector: str = "shared-storage"
    prefill_timeout_s: float = 60.0
    """How long the prefill may take before the request is decoded locally instead."""
    allowed_prefillers: tuple[str, ...] = ()
    """``NETWORK[:PORT]`` entries (``parse_networks``) a prefiller address must match;
    required: an empty tuple refuses every prefill (``epp pd-sidecar`` will not start so)."""
    max_body_bytes: int = 16 << 20


class Sidecar:
    def __init__(self, cfg: SidecarConfig, tracing: Tracing | None = None) -> None:
        if cfg.connector not in CONNECTORS:
            raise ValueError(f"connector {cfg.connector!r}: expected one of {', '.join(CONNECTORS)}")
        self.cfg = cfg
        self._allowed = [_allowed_entry(n) for n in cfg.allowed_prefillers]
        self._tracing = tracing
        """With the OTEL_* variables: a span per request (``epp.pd_sidecar``) and one per leg
        (``prefill``, ``decode``), each leg's request carrying its own ``traceparent``."""
        self.registry = CollectorRegistry()
        self.prefills = Counter(
            "epp_sidecar_prefill", "Remote prefills by outcome: ok, or why the request was "
            "decoded locally instead (failed, timeout, bad-response, not-allowed, bad-request).",
            ["outcome"], registry=self.registry,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "epp_sidecar_prefill_seconds", "Time the remote prefill took (successful ones).",
            registry=self.registry,
        )  # fmt: skip
        self.requests = Counter(
            "epp_sidecar_requests", "Completion requests proxied to the decoder, by what "
            "happened: 'yes' (split: prefilled on the prefiller x-prefiller-host-port named, "
            "decoded here), 'fallback' (a split was asked for, but the request was decoded "
            "here in full: the prefiller not allowed, the prefill failed or timed out; "
            "epp_sidecar_prefill_total{outcome} says why), 'no' (no split asked for).",
            ["split"], registry=self.registry,
        )  # fmt: skip
        self._split, self._fallback, self._unsplit = (self.requests.labels(v)
                                                      for v in ("yes", "fallback", "no"))  # fmt: skip
        self.retries = Counter(
            "epp_sidecar_decode_retries", "Split requests the decoder refused with the "
            "transferred KV (HTTP 5xx to the body carrying the prefiller's kv_transfer_params, "
            "nixlv2) and that were sent to it again without them, decoded here in full.",
            registry=self.registry,
        )  # fmt: skip
        if tracing is not None:
            tracing.register_metrics(self.registry)
        self._session: aiohttp.ClientSession | None = None
        self._warned_s = -_WARN_PERIOD_S

    # --- app ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_get("/sidecar/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )  # fmt: skip

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

    # --- requests ----------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        prefiller = request.headers.get(PREFILLER_HEADER, "").strip()
        tracing = self._tracing
        span = None
        if tracing is not None and request.path in _SPLIT_PATHS:
            span = tracing.span("epp.pd_sidecar", headers=request.headers, kind="server",
                                attributes={"url.path": request.path, "epp.prefiller": prefiller})  # fmt: skip
        try:
            original = body
            if prefiller and request.method == "POST" and request.path in _SPLIT_PATHS:
                body = await self._prefill_then(request, prefiller, body, span)
            elif request.path in _SPLIT_PATHS:
                self._unsplit.inc()
            # the body carries transfer params (nixlv2): on a 5xx, decode the original in full
            return await self._forward(request, self.cfg.decoder, body, span,
                                       retry=original if body is not original else None)  # fmt: skip
        finally:
            if span is not None:
                span.end()

    def _leg(self, name: str, parent: Any, address: str) -> tuple[Any, dict[str, str]]:
        """A traced leg: its span (None untraced) and the headers carrying its context."""
        if self._tracing is None or parent is None:
            return None, {}
        host, _, port = address.rpartition(":")
        attributes: dict[str, Any] = {"server.address": host.strip("[]")}
        if port.isdigit():
            attributes["server.port"] = int(port)
        leg = self._tracing.span(f"epp.pd_sidecar.{name}", parent=parent, kind="client",
                                 attributes=attributes)  # fmt: skip
        return leg, self._tracing.headers_of(leg)

    async def _prefill_then(self, request: web.Request, prefiller: str, body: bytes,
                            span: Any = None) -> bytes:  # fmt: skip
        """Run the prefill on ``prefiller``; the body to decode with (the original when the
        prefill did not happen)."""
        why = self._refused(prefiller)
        if why:
            return self._local(request, "not-allowed", f"prefiller {prefiller!r} {why}", body)
        try:
            original = json.loads(body)
        except ValueError:
            original = None
        if not isinstance(original, dict):
            # not a JSON object: the decoder answers it with its own error
            return self._local(request, "bad-request", "request body is not a JSON object", body)
        request_id = request.headers.get("x-request-id") or str(uuid.uuid4())
        prefill_body = self._prefill_body(original)
        t0 = time.monotonic()
        assert self._session is not None
        leg, context = self._leg("prefill", span, prefiller)
        try:
            async with asyncio.timeout(self.cfg.prefill_timeout_s):
                async with self._session.post(
                    f"http://{prefiller}{request.path}", json=prefill_body,
                    headers=_forwarded_headers(request, {"x-request-id": request_id, **context}),
                ) as resp:  # fmt: skip
                    payload = await resp.read()
                    status = resp.status
                    if leg is not None:
                        leg.set_attribute("http.response.status_code", status)
        except TimeoutError:
            return self._local(request, "timeout",
                               f"prefill on {prefiller} took over {self.cfg.prefill_timeout_s:g} s",
                               body)  # fmt: skip
        except aiohttp.ClientError as exc:
            return self._local(request, "failed", f"prefill on {prefiller} failed: {exc}", body)
        finally:
            if leg is not None:
                leg.end()
        if not 200 <= status < 300:
            return self._local(request, "failed", f"prefill on {prefiller} answered HTTP {status}",
                               body)  # fmt: skip
        try:
            answer = json.loads(payload)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return self._local(request, "bad-response", f"prefill on {prefiller} returned no JSON "
                               "object", body)  # fmt: skip
        self.prefills.labels("ok").inc()
        self._split.inc()
        self.prefill_seconds.observe(time.monotonic() - t0)
        if self.cfg.connector == "nixlv2":
            params = answer.get("kv_transfer_params")
            if params is None:
                log.warning("prefill on %s returned no kv_transfer_params: the decoder will "
                            "compute the prompt itself", prefiller)  # fmt: skip
            decode = dict(original)
            decode["kv_transfer_params"] = params
            return json.dumps(decode).encode()
        return body

    def _prefill_body(self, original: dict[str, Any]) -> dict[str, Any]:
        out = prefill_fields(original)
        if self.cfg.connector == "nixlv2":
            out["kv_transfer_params"] = {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
            }  # fmt: skip
        return out

    def _refused(self, prefiller: str) -> str:
        try:
            host, port = parse_endpoint_id(prefiller)
            addr = ipaddress.ip_address(host)
        except ValueError:
            return "is not an ip:port"
        special = [name for name in _SPECIAL_ADDRESS if getattr(addr, name)]
        for net, allowed_port in self._allowed:
            if addr not in net or (allowed_port and port != allowed_port):
                continue
            # a loopback or link-local target only where the entry names that range itself
            if all(getattr(net.network_address, n) and getattr(net.broadcast_address, n)
                   for n in special):  # fmt: skip
                return ""
        return "is not in --allowed-prefillers"

    def _local(self, request: web.Request, outcome: str, why: str, body: bytes) -> bytes:
        self.prefills.labels(outcome).inc()
        self._fallback.inc()
        self._warn(request, f"{why}; decoding it locally (epp_sidecar_prefill_total{{outcome={outcome!r}}})")
        return body

    def _warn(self, request: web.Request, what: str) -> None:
        """A warning, at most one per ``_WARN_PERIOD_S`` (a failing prefiller fails every request)."""
        now = time.monotonic()
        if now - self._warned_s >= _WARN_PERIOD_S:
            self._warned_s = now
            log.warning("%s %s: %s", request.method, request.path, what)

    async def _forward(self, request: web.Request, base: str, body: bytes, span: Any = None,
                       retry: bytes | None = None) -> web.StreamResponse:  # fmt: skip
        """Send ``body`` to ``base`` and stream its answer back. With ``retry``: if the server
        answers 5xx, ``retry`` is sent instead (once) and that answer returned."""
        assert self._session is not None
        url = base.rstrip("/") + request.path_qs
        leg, context = self._leg("decode", span, base.split("://", 1)[-1].rstrip("/"))
        try:
            try:
                upstream = await self._session.request(
                    request.method, url, data=body, headers=_forwarded_headers(request, context),
                )  # fmt: skip
            except aiohttp.ClientError as exc:
                if leg is not None and self._tracing is not None:
                    self._tracing.failed(leg, str(exc))
                return web.json_response(
                    {"error": {"message": f"decoder {base} unreachable: {exc}", "type": "bad_gateway"}},
                    status=502,
                )  # fmt: skip
            if leg is not None:
                leg.set_attribute("http.response.status_code", upstream.status)
            if retry is not None and upstream.status >= 500:
                upstream.release()
                self.retries.inc()
                self._warn(request, f"the decoder answered HTTP {upstream.status} to the "
                           "transferred KV; decoding it again locally in full")  # fmt: skip
                return await self._forward(request, base, retry, span)
            async with upstream:
                resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_HEADERS:
                        resp.headers.add(key, value)
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            if leg is not None:
                leg.end()


def _forwarded_headers(request: web.Request, extra: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP_HEADERS and k.lower() != PREFILLER_HEADER}  # fmt: skip
    headers.update(extra)
    return headers


async def run(cfg: SidecarConfig, host: str, port: int, stop: asyncio.Event | None = None,
              tracing: Tracing | None = None) -> None:  # fmt: skip
    runner = web.AppRunner(Sidecar(cfg, tracing).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("pd-sidecar on %s:%d -> decoder %s (connector %s); prefills allowed to %s", host,
             port, cfg.decoder, cfg.connector, ", ".join(cfg.allowed_prefillers) or "nowhere")  # fmt: skip
    for entry in wide_entries(cfg.allowed_prefillers):
        log.warning("--allowed-prefillers %s allows every address (but loopback, link-local, "
                    "unspecified and multicast ones): a forged x-prefiller-host-port can send "
                    "the prompt to any host the pod reaches; name the prefill pods' network "
                    "instead (e.g. 10.0.0.0/8:8000)", entry)  # fmt: skip
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)


def prefill_fields(original: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: ``original`` asking for one token (``PREFILL_OVERRIDES``,
    ``PREFILL_DROPPED``), in SGLang's nested ``sampling_params`` too."""
    out = dict(original)
    for key in PREFILL_DROPPED:
        out.pop(key, None)
    for key in ("max_tokens", "n", "stream"):
        out[key] = PREFILL_OVERRIDES[key]
    for key in ("max_completion_tokens", "max_new_tokens"):
        if key in out:
            out[key] = 1
    nested = out.get("sampling_params")
    if isinstance(nested, dict):
        nested = {k: v for k, v in nested.items() if k not in PREFILL_DROPPED}
        for key in ("max_new_tokens", "max_tokens", "n"):
            if key in nested:
                nested[key] = 1
        out["sampling_params"] = nested
    return out


def _allowed_entry(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int]:
    """``NETWORK[:PORT]``: ``10.0.0.0/8``, ``10.1.2.3:8000``, ``[fd00::/8]:8000`` or
    ``fd00::/8`` (IPv6 takes brackets to carry a port); port 0 = any. Raises ValueError."""
    item = text.strip()
    port_text = ""
    if item.startswith("["):
        net_text, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: expected [IPv6 network]:port")
        port_text = rest[1:]
    elif item.count(":") == 1:
        net_text, _, port_text = item.partition(":")
    else:
        net_text = item
    net = ipaddress.ip_network(net_text, strict=False)
    port = 0
    if port_text or item.endswith(":"):
        if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5 \
                or not 0 < int(port_text) < 65536:
            raise ValueError(f"{text!r}: port must be 1..65535")
        port = int(port_text)
    return net, port


def wide_entries(entries: Sequence[str]) -> list[str]:
    """The ``--allowed-prefillers`` entries that match every address of their family
    (``0.0.0.0/0``, ``::/0``, with or without a port): warned about at start."""
    return [e for e in entries if _allowed_entry(e)[0].prefixlen == 0]


def parse_networks(text: str) -> tuple[str, ...]:
    """``10.0.0.0/8:8000,[fd00::/8]:8000`` -> the entries; raises ValueError naming a bad one."""
    nets: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if item:
            try:
                _allowed_entry(item)
            except ValueError as exc:
                raise ValueError(f"{item!r} is no NETWORK[:PORT] ({exc})") from None
            nets.append(item)
    return tuple(nets)


__all__: Sequence[str] = ("CONNECTORS", "PREFILL_DROPPED", "PREFILL_OVERRIDES", "Sidecar",
                          "SidecarConfig", "parse_networks", "prefill_fields", "run", "wide_entries")
