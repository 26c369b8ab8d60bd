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

A prefill that fails, times out or names a prefiller not allowed is never fatal: the request
is decoded locally in full, a warning is logged and ``epp_sidecar_prefill_total{outcome}``
counts it. Token-id prompts pass through unchanged. A client that goes away cancels the
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
from epp.request.parse import PREFILLER_HEADER

log = logging.getLogger(__name__)

CONNECTORS = ("shared-storage", "nixlv2")
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
    """Networks (CIDR) a prefiller address must be in; empty: private addresses only
    (RFC 1918, loopback, link-local, unique-local), so the header cannot send prompts out."""
    max_body_bytes: int = 16 << 20


class Sidecar:
    def __init__(self, cfg: SidecarConfig) -> None:
        if cfg.connector not in CONNECTORS:
            raise ValueError(f"connector {cfg.connector!r}: expected one of {', '.join(CONNECTORS)}")
        self.cfg = cfg
        self._nets = [ipaddress.ip_network(n, strict=False) for n in cfg.allowed_prefillers]
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
            "epp_sidecar_requests", "Requests proxied to the decoder, by whether a remote "
            "prefill was asked for.", ["split"], registry=self.registry,
        )  # fmt: skip
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
        if prefiller and request.method == "POST" and request.path in _SPLIT_PATHS:
            self.requests.labels("yes").inc()
            body = await self._prefill_then(request, prefiller, body)
        elif request.path in _SPLIT_PATHS:
            self.requests.labels("no").inc()
        return await self._forward(request, self.cfg.decoder, body)

    async def _prefill_then(self, request: web.Request, prefiller: str, body: bytes) -> bytes:
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
        try:
            async with asyncio.timeout(self.cfg.prefill_timeout_s):
                async with self._session.post(
                    f"http://{prefiller}{request.path}", json=prefill_body,
                    headers=_forwarded_headers(request, {"x-request-id": request_id}),
                ) as resp:  # fmt: skip
                    payload = await resp.read()
                    status = resp.status
        except TimeoutError:
            return self._local(request, "timeout",
                               f"prefill on {prefiller} took over {self.cfg.prefill_timeout_s:g} s",
                               body)  # fmt: skip
        except aiohttp.ClientError as exc:
            return self._local(request, "failed", f"prefill on {prefiller} failed: {exc}", body)
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
        out = dict(original)
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["stream"] = False
        out.pop("stream_options", None)
        out["n"] = 1
        if self.cfg.connector == "nixlv2":
            out["kv_transfer_params"] = {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
            }  # fmt: skip
        return out

    def _refused(self, prefiller: str) -> str:
        try:
            host, _port = parse_endpoint_id(prefiller)
            addr = ipaddress.ip_address(host)
        except ValueError:
            return "is not an ip:port"
        if self._nets:
            if not any(addr in net for net in self._nets):
                return "is outside --allowed-prefillers"
        elif not (addr.is_private or addr.is_loopback or addr.is_link_local):
            return "is not a private address (set --allowed-prefillers to allow it)"
        return ""

    def _local(self, request: web.Request, outcome: str, why: str, body: bytes) -> bytes:
        self.prefills.labels(outcome).inc()
        now = time.monotonic()
        if now - self._warned_s >= _WARN_PERIOD_S:
            self._warned_s = now
            log.warning("%s %s: %s; decoding it locally (epp_sidecar_prefill_total{outcome=%r})",
                        request.method, request.path, why, outcome)  # fmt: skip
        return body

    async def _forward(self, request: web.Request, base: str, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        url = base.rstrip("/") + request.path_qs
        try:
            upstream = await self._session.request(
                request.method, url, data=body, headers=_forwarded_headers(request, {}),
            )  # fmt: skip
        except aiohttp.ClientError as exc:
            return web.json_response(
                {"error": {"message": f"decoder {base} unreachable: {exc}", "type": "bad_gateway"}},
                status=502,
            )  # fmt: skip
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


def _forwarded_headers(request: web.Request, extra: dict[str, str]) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items()
               if k.lower() not in _HOP_HEADERS and k.lower() != PREFILLER_HEADER}  # fmt: skip
    headers.update(extra)
    return headers


async def run(cfg: SidecarConfig, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    runner = web.AppRunner(Sidecar(cfg).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("pd-sidecar on %s:%d -> decoder %s (connector %s)", host, port, cfg.decoder, cfg.connector)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def parse_networks(text: str) -> tuple[str, ...]:
    """``10.0.0.0/8,fd00::/8`` -> the networks; raises ValueError naming a bad one."""
    nets: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if item:
            ipaddress.ip_network(item, strict=False)
            nets.append(item)
    return tuple(nets)


__all__: Sequence[str] = ("CONNECTORS", "Sidecar", "SidecarConfig", "parse_networks", "run")
