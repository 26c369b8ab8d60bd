"""An OTLP/HTTP trace receiver: what an OpenTelemetry collector does with traces, minus
forwarding them. The tracing tests, the tracing benchmark and ``epp-sim otlp`` run it.

It serves ``POST /v1/traces`` as the OTLP specification says (protobuf
``ExportTraceServiceRequest``, gzip or not; the answer an ``ExportTraceServiceResponse``) and
keeps what arrives as :class:`ReceivedSpan` values, at most ``max_spans`` (the oldest go).
``tree`` prints one trace as an indented tree, each span with its service and the
attributes asked for. Point any exporter at ``http://HOST:PORT`` (``OTEL_EXPORTER_OTLP_ENDPOINT``)
or ``http://HOST:PORT/v1/traces`` (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, vLLM's
``--otlp-traces-endpoint`` with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gzip
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from simulator.clihelp import HelpFormatter

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
KINDS = {0: "", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(slots=True, frozen=True)
class ReceivedSpan:
    trace_id: str
    """32 hex digits, as in a ``traceparent``."""
    span_id: str
    parent_span_id: str
    """'' for a root span."""
    name: str
    kind: str
    service: str
    """The exporter's resource ``service.name``."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    error: str = ""
    """The status message of a span whose status is ERROR."""


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of an ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                error = s.status.message or "error" if s.status.code == 2 else ""
                out.append(ReceivedSpan(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                    KINDS.get(s.kind, str(s.kind)), service, s.start_time_unix_nano,
                    s.end_time_unix_nano, {kv.key: _value(kv.value) for kv in s.attributes},
                    tuple(e.name for e in s.events), error,
                ))  # fmt: skip
    return out


class OtlpReceiver:
    """``start`` on a port (0: any free one), ``spans``, ``wait_for``, ``stop``."""

    def __init__(self, max_spans: int = 100_000) -> None:
        self.spans: collections.deque[ReceivedSpan] = collections.deque(maxlen=max_spans)
        self.exports = 0
        self.received = 0
        """Spans received in all (``spans`` keeps the last ``max_spans``)."""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._arrived = asyncio.Event()
        self.on_spans: Callable[[list[ReceivedSpan]], None] | None = None

    @property
    def endpoint(self) -> str:
        """The base URL exporters take as ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> OtlpReceiver:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        if "protobuf" not in request.headers.get("Content-Type", ""):
            return web.Response(status=415, text="only application/x-protobuf is served")
        try:
            spans = decode(body)
        except Exception as exc:  # a malformed export: the sender hears of it
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {exc}")
        self.spans.extend(spans)
        self.exports += 1
        self.received += len(spans)
        self._arrived.set()
        if self.on_spans is not None:
            self.on_spans(spans)
        ok = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=ok, content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, done: Callable[[Sequence[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Wait until ``done(spans received so far)``; raises TimeoutError with what came."""
        deadline = time.monotonic() + timeout_s
        while not done(list(self.spans)):
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted({f"{s.service}:{s.name}" for s in self.spans})
                raise TimeoutError(f"spans after {timeout_s:g} s: {len(self.spans)} ({', '.join(names)})")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(left, 0.5))
        return list(self.spans)


def tree(spans: Iterable[ReceivedSpan], attributes: Sequence[str] = ()) -> str:
    """The spans of one trace as an indented tree in start order: ``service: name [kind]
    +start ms, duration ms`` and the ``attributes`` each has; a span whose parent is not
    among them (the client's) is a root."""
    spans = sorted(spans, key=lambda s: s.start_ns)
    if not spans:
        return "(no spans)\n"
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = collections.defaultdict(list)
    for s in spans:
        children[s.parent_span_id if s.parent_span_id in ids else ""].append(s)
    t0 = spans[0].start_ns
    lines = [f"trace {spans[0].trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            shown = [f"{k}={_short(s.attributes[k])}" for k in attributes if k in s.attributes]
            kind = f" [{s.kind}]" if s.kind not in ("", "internal") else ""
            error = f" ERROR {s.error}" if s.error else ""
            lines.append(f"{'  ' * depth}{s.service}: {s.name}{kind} +{(s.start_ns - t0) / 1e6:.1f} ms, "
                         f"{(s.end_ns - s.start_ns) / 1e6:.1f} ms{error}"
                         + (f"  {' '.join(shown)}" if shown else ""))  # fmt: skip
            walk(s.span_id, depth + 1)

    walk("", 1)
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value[:6]) + (",..." if len(value) > 6 else "") + "]"
    return str(value)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "otlp", help="receive OpenTelemetry traces (OTLP/HTTP) and print each trace's tree",
        description="An OTLP/HTTP trace receiver for looking at epp's (and vLLM's) spans without "
        "a collector: point OTEL_EXPORTER_OTLP_ENDPOINT at http://HOST:PORT; each trace is "
        "printed as a tree once no span of it came for --quiet-s seconds.",
        formatter_class=HelpFormatter,
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: from other machines too)")
    p.add_argument("--port", type=int, default=4318, help="port (4318 is OTLP/HTTP's)")
    p.add_argument("--quiet-s", type=float, default=2.0,
                   help="print a trace once it received no span for this many seconds")
    p.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    from simulator.clihelp import stop_event

    async def main() -> None:
        receiver = await OtlpReceiver().start(args.host, args.port)
        last: dict[str, float] = {}
        receiver.on_spans = lambda spans: last.update({s.trace_id: time.monotonic() for s in spans})
        print(f"receiving OTLP/HTTP traces on {receiver.endpoint}/v1/traces", flush=True)
        stop = stop_event()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            now = time.monotonic()
            for trace_id in [t for t, at in last.items() if now - at >= args.quiet_s]:
                del last[trace_id]
                print(tree(receiver.trace(trace_id), PRINTED), flush=True)
        await receiver.stop()

    asyncio.run(main())
    return 0


PRINTED = ("epp.pick.endpoint", "http.response.status_code", "gen_ai.usage.input_tokens",
           "gen_ai.usage.output_tokens", "epp.ttft_s", "gen_ai.request.id", "epp.candidates",
           "epp.totals")  # fmt: skip
"""The attributes ``epp-sim otlp`` and the tracing tools print."""
