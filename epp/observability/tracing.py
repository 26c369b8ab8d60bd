"""OpenTelemetry tracing of the request path, with the OpenTelemetry SDK (``epp[tracing]``).

Configured by the standard variables alone (docs/observability.md): tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``) or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), and off with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. The SDK reads the rest itself:
the protocol (``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``: ``http/protobuf``, the default, or
``grpc``), headers, timeout and compression, the sampler (``OTEL_TRACES_SAMPLER`` and
``_ARG``; parent-based always-on by default), the propagators (``OTEL_PROPAGATORS``: W3C
trace context and baggage by default), the resource (``OTEL_SERVICE_NAME``, default ``epp``;
``OTEL_RESOURCE_ATTRIBUTES``) and the batch processor's bounds (``OTEL_BSP_*``: a full queue
drops spans, it never blocks a request). Values the SDK would only warn about and replace
(an unknown sampler, a sampler argument that is not a ratio in [0, 1], an ``OTEL_BSP_*``
that is not a positive integer, an OTLP endpoint that is not a URL) stop start-up with a
``ConfigError`` naming the variable instead (:func:`check_env`). Each span's export is counted by outcome
(``epp_tracing_spans_exported_total{exporter, outcome}``): a receiver that refuses or cannot
be reached shows as ``failed`` there, not only in a log line.

One span tree per request, continuing the client's ``traceparent``::

    epp.request            SERVER  request headers -> end of the response (or epp's answer)
    |- epp.parse                   the body read into a request (model, API, sizes)
    |- epp.prepare                 tokenizing, when the config's producers tokenize
    |- epp.flow_control.wait       the wait in flow control's queue, when it is on
    |- epp.schedule                producers and profiles; names the pick
    |  `- epp.profile NAME         per profile run: candidates, each scorer's scores, totals
    `- epp.upstream        CLIENT  the routed request -> end of the response: the server,
                                   usage, first-token time; its context is the ``traceparent``
                                   epp sets on the request Envoy sends to the model server

A request the sampler drops still gets a ``traceparent`` (its sampled flag off) so the model
server follows the decision. No span carries prompt text: ids, sizes, names and numbers.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp import package_version
from epp.errors import ConfigError
from epp.framework.types import PickResult, ProfileRun, ResponseInfo

log = logging.getLogger(__name__)

MAX_TRACED_CANDIDATES = 16
"""Candidates a profile span lists (the best by total; ``epp.candidates.count`` says how many
there were): attribute arrays stay bounded however large the pool."""
INSTRUMENTATION = "epp"
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


ENV_HELP = (
    "Tracing: the standard OpenTelemetry variables turn it on, nothing else: "
    "OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) exports spans there over OTLP, "
    "OTEL_TRACES_EXPORTER=otlp|console|none chooses, OTEL_SDK_DISABLED=true turns it off; the "
    "sampler, propagators, resource and batching follow the other OTEL_* variables. When they "
    "ask for what cannot work (an unknown exporter, protocol, propagator or sampler, a "
    "sampler argument outside [0, 1], an OTEL_BSP_* that is not a positive integer, an "
    "endpoint that is not a URL, OTLP without the SDK installed: pip install "
    "'epp[tracing]'), start-up stops with an error naming the "
    "variable. See docs/observability.md."
)
"""The ``epilog`` of the commands that read the variables (``epp serve``, ``epp pd-sidecar``)."""


SAMPLERS = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off",
            "traceidratio", "parentbased_traceidratio")  # fmt: skip
"""The ``OTEL_TRACES_SAMPLER`` values the SDK's ``TracerProvider`` knows (its
``sampling._KNOWN_SAMPLERS``); the ratio ones read ``OTEL_TRACES_SAMPLER_ARG``."""
_BSP = {"OTEL_BSP_SCHEDULE_DELAY": 5000, "OTEL_BSP_EXPORT_TIMEOUT": 30000,
        "OTEL_BSP_MAX_QUEUE_SIZE": 2048, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512}  # fmt: skip
"""The batch processor's variables and the SDK's defaults (milliseconds, spans)."""


def check_env(env: Mapping[str, str], protocol: str = "http/protobuf") -> None:
    """Raise ConfigError naming the first ``OTEL_*`` variable (sampler, batch processor,
    endpoint) whose value the SDK would only warn about and replace, or fail on later."""
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in SAMPLERS:
        raise ConfigError("OTEL_TRACES_SAMPLER", f"unknown sampler {sampler!r} (known: "
                          f"{', '.join(SAMPLERS)})")  # fmt: skip
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if sampler.endswith("traceidratio") and arg:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:  # NaN fails too
            raise ConfigError("OTEL_TRACES_SAMPLER_ARG", f"{arg!r} is not a sampling ratio in "
                              f"[0, 1] (for {sampler})")  # fmt: skip
    values = dict(_BSP)
    for var in _BSP:
        text = env.get(var, "").strip()
        if not text:
            continue
        try:
            values[var] = int(text)
        except ValueError:
            values[var] = -1
        low = 0 if var == "OTEL_BSP_EXPORT_TIMEOUT" else 1
        if values[var] < low:
            raise ConfigError(var, f"{text!r} is not an integer >= {low}")
    if values["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] > values["OTEL_BSP_MAX_QUEUE_SIZE"]:
        raise ConfigError("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "must not exceed "
                          f"OTEL_BSP_MAX_QUEUE_SIZE ({values['OTEL_BSP_MAX_QUEUE_SIZE']})")
    for var in _ENDPOINT_VARS:
        url = env.get(var, "").strip()
        if url and not _is_endpoint(url, grpc=protocol == "grpc"):
            form = "http(s)://HOST:PORT or HOST:PORT" if protocol == "grpc" else \
                "http(s)://HOST:PORT[/PATH]"
            raise ConfigError(var, f"{url!r} is not a URL like {form}")


def _is_endpoint(url: str, *, grpc: bool) -> bool:
    """An http(s) URL with a host (and a valid port); with ``grpc``, HOST:PORT too."""
    try:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme in ("http", "https"):
            return bool(parsed.hostname) and (parsed.port is None or parsed.port > 0)
        if grpc and "//" not in url:
            bare = urllib.parse.urlsplit(f"//{url}")
            return bool(bare.hostname) and bare.port is not None and bare.port > 0
    except ValueError:  # a port outside 0-65535, a bad IPv6 literal
        return False
    return False


def _exporters(environ: Mapping[str, str]) -> list[str]:
    """The exporters the variables ask for; [] when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if named:
        return [] if named == ["none"] else named
    return ["otlp"] if any(environ.get(v, "").strip() for v in _ENDPOINT_VARS) else []


def tracing_from_env(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The tracing the ``OTEL_*`` variables ask for (module docstring), or None when off.

    Raises ConfigError naming the variable when they ask for what cannot work: an exporter
    or protocol the SDK does not have, or tracing without the SDK installed.
    """
    env = os.environ if environ is None else environ
    exporters = _exporters(env)
    if not exporters:
        return None
    unknown = [e for e in exporters if e not in ("otlp", "console")]
    if unknown:
        raise ConfigError("OTEL_TRACES_EXPORTER", f"unknown exporter {unknown[0]!r} (epp has "
                          "otlp and console; none turns tracing off)")  # fmt: skip
    protocol_var = next((v for v in _PROTOCOL_VARS if env.get(v)), "")
    check_env(env, env.get(protocol_var, "http/protobuf").strip().lower())
    try:
        from opentelemetry import propagate
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        var = next((v for v in ("OTEL_TRACES_EXPORTER", *_ENDPOINT_VARS) if env.get(v)), "OTEL_*")
        raise ConfigError(var, "asks for traces, but the OpenTelemetry SDK is not installed: "
                          "pip install 'epp[tracing]'") from None  # fmt: skip
    except ValueError as exc:  # the SDK reads OTEL_PROPAGATORS when propagate is imported
        raise ConfigError("OTEL_PROPAGATORS", str(exc)) from None
    attributes = {"service.version": package_version()}
    if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = "epp"
    provider = TracerProvider(resource=Resource.create(attributes))
    counts = []
    for name in exporters:
        exporter = ConsoleSpanExporter() if name == "console" else _otlp_exporter(env)
        counts.append(ExportCounts(name))
        provider.add_span_processor(BatchSpanProcessor(_counted(exporter, counts[-1])))
    where = next((env[v] for v in _ENDPOINT_VARS if env.get(v)), "the default endpoint")
    log.info("tracing on: %s", ", ".join(
        f"OTLP to {where}" if name == "otlp" else "console (standard output)" for name in exporters))
    return Tracing(provider.get_tracer(INSTRUMENTATION, package_version()),
                   propagate.get_global_textmap(), provider, counts)  # fmt: skip


@dataclass(slots=True)
class ExportCounts:
    """Spans whose export finished, by outcome, for one exporter: written by its batch
    processor's thread only, read when Prometheus scrapes (``epp_tracing_spans_exported_total``)."""

    exporter: str
    ok: int = 0
    failed: int = 0


def _counted(exporter: Any, counts: ExportCounts) -> Any:
    """``exporter`` with each batch's spans counted by outcome: a batch the exporter gave up
    on (an error status, a receiver down past its retries and timeout, an exception) is lost,
    and the SDK says so only in a log line; an operator alerts on the count
    (``EppTraceExportFailing``)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountedExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> Any:
            try:
                result = exporter.export(spans)
            except Exception:
                counts.failed += len(spans)
                raise
            if result == SpanExportResult.SUCCESS:
                counts.ok += len(spans)
            else:
                counts.failed += len(spans)
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    return CountedExporter()


class ExportCollector:
    """``epp_tracing_spans_exported_total{exporter, outcome}`` (``ok``, ``failed``) from the
    exporters' counts, read at scrape time."""

    NAME = "epp_tracing_spans_exported"
    HELP = ("Spans whose export finished, by exporter (otlp, console) and outcome: ok, or "
            "failed (the receiver refused them, was unreachable past the exporter's retries "
            "and timeout, or the exporter raised): failed spans are lost.")  # fmt: skip

    def __init__(self, counts: Sequence[ExportCounts]) -> None:
        self._counts = counts

    def describe(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily

        return [CounterMetricFamily(self.NAME, self.HELP, labels=("exporter", "outcome"))]

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.NAME, self.HELP, labels=("exporter", "outcome"))
        for c in self._counts:
            family.add_metric([c.exporter, "ok"], c.ok)
            family.add_metric([c.exporter, "failed"], c.failed)
        yield family


STALE_OTLP_PROTOS_FIX = "pip install --force-reinstall --no-deps opentelemetry-proto"


def _check_otlp_protos(var: str) -> None:
    """xds-protos (Envoy's protos, which epp needs) ships an old copy of OpenTelemetry's
    ``opentelemetry/proto`` modules (grpc/grpc#42926); installed after opentelemetry-proto in
    one pip run, it overwrites them and every OTLP exporter fails to import. ``./run`` and the
    container image reinstall opentelemetry-proto after the rest; anyone else is told how."""
    try:
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
    except ImportError:
        raise ConfigError(var or "OTEL_EXPORTER_OTLP_ENDPOINT", "asks for OTLP, but the "
                          "installed opentelemetry-proto modules were overwritten by xds-protos' "
                          f"older copy (grpc/grpc#42926); repair them with: {STALE_OTLP_PROTOS_FIX}"
                          ) from None  # fmt: skip


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    _check_otlp_protos(next((v for v in _ENDPOINT_VARS if env.get(v)), ""))
    var = next((v for v in _PROTOCOL_VARS if env.get(v)), "")
    protocol = env.get(var, "http/protobuf").strip().lower() if var else "http/protobuf"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ConfigError(var, "grpc needs opentelemetry-exporter-otlp-proto-grpc: "
                              "pip install 'epp[tracing]'") from None  # fmt: skip
        return GrpcExporter()
    raise ConfigError(var, f"protocol {protocol!r}: epp exports http/protobuf or grpc")


class Tracing:
    """Starts a :class:`RequestTrace` per request (``begin``); ``shutdown`` flushes."""

    def __init__(self, tracer: Any, propagator: Any, provider: Any = None,
                 export_counts: Sequence[ExportCounts] = ()) -> None:  # fmt: skip
        from opentelemetry import trace

        self._tracer = tracer
        self._propagator = propagator
        self._provider = provider
        self._trace = trace
        self.export_counts = export_counts
        """Per exporter, the spans exported and failed (``register_metrics``)."""

    def register_metrics(self, registry: Any) -> None:
        """Export ``epp_tracing_spans_exported_total`` in ``registry`` (a CollectorRegistry)."""
        if self.export_counts:
            registry.register(ExportCollector(self.export_counts))

    def begin(self, headers: Mapping[str, str], request_id: str, path: str, method: str) -> RequestTrace:
        """The request's trace, its root span a child of the client's ``traceparent`` (if
        any); started now."""
        parent = self._propagator.extract(headers)
        attributes = {"http.request.method": method, "url.path": path.partition("?")[0],
                      "epp.request_id": request_id}  # fmt: skip
        span = self._tracer.start_span("epp.request", parent, kind=self._trace.SpanKind.SERVER,
                                       attributes=attributes)  # fmt: skip
        return RequestTrace(self, span)

    def span(self, name: str, *, headers: Mapping[str, str] | None = None, parent: Any = None,
             kind: str = "internal", attributes: Mapping[str, Any] | None = None) -> Any:  # fmt: skip
        """Start a span (end it with ``.end()``): a child of ``parent`` (a span), else of the
        context in ``headers`` (a ``traceparent``), else a new trace's root. ``kind``:
        internal, server or client."""
        trace = self._trace
        if parent is not None:
            ctx = trace.set_span_in_context(parent)
        else:
            ctx = self._propagator.extract(headers) if headers is not None else None
        span_kind = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}.get(
            kind, trace.SpanKind.INTERNAL)  # fmt: skip
        return self._tracer.start_span(name, ctx, kind=span_kind, attributes=attributes)

    def headers_of(self, span: Any) -> dict[str, str]:
        """The headers that carry ``span``'s context to the next hop (``traceparent``...)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def failed(self, span: Any, why: str) -> None:
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, why))

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocks up to the exporter's timeout)."""
        if self._provider is not None:
            self._provider.shutdown()


class RequestTrace:
    """One request's spans (module docstring). Every method is cheap when the sampler left
    the request out (``recording`` False): it only carries the ``traceparent`` to inject."""

    __slots__ = ("_ctx", "_ended", "_span", "_tracing", "_upstream", "recording")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self._tracing = tracing
        self._span = span
        self.recording: bool = span.is_recording()
        self._ctx = tracing._trace.set_span_in_context(span)
        self._upstream: Any = None
        self._ended = False

    def child(self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
              error: str = "") -> None:  # fmt: skip
        """A finished step of the request (``epp.parse``, ``epp.flow_control.wait``)."""
        if not self.recording:
            return
        span = self._tracing._tracer.start_span(name, self._ctx, attributes=attributes,
                                                start_time=start_ns)  # fmt: skip
        if error:
            span.set_status(self._tracing._trace.Status(self._tracing._trace.StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def request(self, model: str, api: str, stream: bool, priority: int, body_bytes: int,
                prompt_chars: int) -> None:  # fmt: skip
        """What the parsed request is (never its text)."""
        if self.recording:
            self._span.set_attributes({
                "gen_ai.request.model": model, "epp.api": api, "epp.stream": stream,
                "epp.priority": priority, "http.request.body.size": body_bytes,
                "epp.prompt_chars": prompt_chars,
            })  # fmt: skip

    def scheduled(self, result: PickResult, destination: str, start_ns: int, end_ns: int) -> None:
        """The scheduling cycle (``epp.schedule``) and its profile runs (``epp.profile``)."""
        if not self.recording:
            return
        t = self._tracing
        attributes: dict[str, Any] = {"epp.pick.endpoint": result.target.id,
                                      "epp.pick.destination": destination}  # fmt: skip
        if result.prefiller is not None:
            attributes["epp.pick.prefiller"] = result.prefiller.id
        if result.decision:
            attributes["epp.pick.decision"] = result.decision
        span = t._tracer.start_span("epp.schedule", self._ctx, attributes=attributes,
                                    start_time=start_ns)  # fmt: skip
        ctx = t._trace.set_span_in_context(span)
        for run in result.state.runs or ():
            child = t._tracer.start_span(f"epp.profile {run.profile}", ctx,
                                         attributes=profile_attributes(run), start_time=run.start_ns)  # fmt: skip
            child.end(end_time=run.end_ns)
        span.end(end_time=end_ns)
        self._span.set_attribute("epp.pick.endpoint", result.target.id)

    def upstream(self, endpoint: str) -> dict[str, str]:
        """Start ``epp.upstream`` (the request on its way to ``endpoint``); the headers that
        carry its context (``traceparent``, and ``tracestate`` / ``baggage`` when there are
        any): set them on the request Envoy sends."""
        t = self._tracing
        ctx = self._ctx
        if self.recording:
            host, _, port = endpoint.rpartition(":")
            attributes: dict[str, Any] = {"server.address": host.strip("[]")}
            if port.isdigit():
                attributes["server.port"] = int(port)
            self._upstream = t._tracer.start_span("epp.upstream", ctx, kind=t._trace.SpanKind.CLIENT,
                                                  attributes=attributes)  # fmt: skip
            ctx = t._trace.set_span_in_context(self._upstream)
        carrier: dict[str, str] = {}
        t._propagator.inject(carrier, context=ctx)
        return carrier

    def first_token(self, ttft_s: float) -> None:
        """The response's first body bytes arrived ``ttft_s`` after the pick."""
        if self.recording and self._upstream is not None:
            self._upstream.add_event("first_token", {"epp.ttft_s": ttft_s})
            self._upstream.set_attribute("epp.ttft_s", ttft_s)

    def finished(self, info: ResponseInfo) -> None:
        """The response ended: its status, usage and first-token time; the trace ends."""
        if not self.recording or self._ended:
            self._ended = True
            return
        attributes: dict[str, Any] = {"http.response.status_code": info.status,
                                      "http.response.body.size": info.response_bytes}  # fmt: skip
        if info.prompt_tokens or info.completion_tokens:
            attributes["gen_ai.usage.input_tokens"] = info.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = info.completion_tokens
        if info.cached_tokens is not None:
            attributes["gen_ai.usage.cache_read.input_tokens"] = info.cached_tokens
        if info.ttft_s is not None:
            attributes["epp.ttft_s"] = info.ttft_s
        self._end(attributes, f"HTTP {info.status}" if info.status >= 500 else "")

    def answered(self, status: int, error_type: str, reason: str) -> None:
        """epp answered the request itself (an error status): the trace ends."""
        if not self.recording or self._ended:
            self._ended = True
            return
        self._end({"http.response.status_code": status, "error.type": error_type,
                   "epp.answered_by": "epp"}, reason)  # fmt: skip

    def ended(self, why: str) -> None:
        """The stream ended without a complete response (``cancelled``); no-op once ended."""
        if not self.recording or self._ended:
            self._ended = True
            return
        self._end({"epp.outcome": why}, "")

    def _end(self, attributes: Mapping[str, Any], error: str) -> None:
        """The response's attributes on ``epp.upstream`` (on ``epp.request`` when the request
        was never routed), its status on both; then both end."""
        self._ended = True
        t = self._tracing
        status = t._trace.Status(t._trace.StatusCode.ERROR, error) if error else None
        upstream = self._upstream
        if upstream is not None:
            upstream.set_attributes(attributes)
            if status is not None:
                upstream.set_status(status)
            upstream.end()
            code = attributes.get("http.response.status_code")
            if code is not None:
                self._span.set_attribute("http.response.status_code", code)
        else:
            self._span.set_attributes(attributes)
        if status is not None:
            self._span.set_status(status)
        self._span.end()


def profile_attributes(run: ProfileRun) -> dict[str, Any]:
    """A profile run as span attributes: the candidates (the best ``MAX_TRACED_CANDIDATES``
    by total, best first), each filter's survivor count, each scorer's weight and scores
    aligned with ``epp.candidates``, the totals and the picks."""
    order = sorted(range(len(run.candidates)), key=lambda k: -run.totals[k])[:MAX_TRACED_CANDIDATES]
    out: dict[str, Any] = {
        "epp.profile": run.profile,
        "epp.endpoints.count": len(run.endpoints),
        "epp.candidates.count": len(run.candidates),
        "epp.candidates": [run.candidates[k] for k in order],
        "epp.totals": [run.totals[k] for k in order],
        "epp.picker": run.picker,
        "epp.picked": list(run.picked),
    }
    for step in run.filters:
        out[f"epp.filter.{step.name}.survivors"] = len(step.survivors)
    for column in run.scorers:
        out[f"epp.scorer.{column.name}.weight"] = column.weight
        out[f"epp.scorer.{column.name}.scores"] = [column.scores[k] for k in order]
    return out


def now_ns() -> int:
    return time.time_ns()


__all__: Sequence[str] = ("ExportCounts", "RequestTrace", "Tracing", "profile_attributes",
                          "tracing_from_env")
