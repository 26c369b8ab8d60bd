"""What epp costs behind real Envoy: Envoy alone vs Envoy + a no-op ext_proc server vs Envoy +
epp, per processing mode, and what a streamed answer costs epp as it grows.

The front Envoy runs the bootstrap ``epp envoy-config`` makes (one worker, fresh for every run);
epp is ``epp serve`` scraping each upstream's real vLLM /metrics page; the no-op server
(bench/harness.py) answers what the mode needs with no parsing and no scheduling: the floor
of any Python processor. Configurations interleave round by round, the servers not measured
paused (SIGSTOP); medians, ratios paired round by round, CPU per request from /proc.

Parts (``--parts``): ``overhead``: wrk posting 16 KB prompts from 64 shared prefixes to 8
listeners of a second Envoy that answer at once, in each of ``--modes`` (``default``: the
shipped bootstrap; ``response-full-duplex``: every response chunk through epp;
``full-duplex``: both bodies streamed, fail-closed; ``request-only``: ``--response none``;
``observer``: the response on a second stream). ``router``: ``epp model-router`` in front of
two pools, Envoy alone vs with the router, epp vs the router + epp. ``streams``: answers of 8
tokens unstreamed, 8, 256 and 1,000 streamed (one SSE event per token every
``--token-interval-ms``) in three modes: epp's CPU per request and per token (less its idle
rate), the gaps between a stream's events. ``--tracing also`` (default) or ``only``: epp with
OpenTelemetry tracing off, sampled out and sampled in.

Writes docs/results/envoy-overhead.md when the three parts ran, envoy-tracing.md when tracing
did; otherwise it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import PAGE, ints, med, only, pct, prompts, spawn, start_noop, stop, table  # noqa: E402

UPSTREAMS = 8
PROMPT_BYTES = 16 * 1024
PARTS = ("overhead", "router", "streams")
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
TRACING = {
    "off": {},
    "sampled out": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    "sampled in": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 4000, "completion_tokens": 16, "total_tokens": 4016,
                               "prompt_tokens_details": {"cached_tokens": 3000}}})  # fmt: skip
SCRAPE_S = 1.0  # epp's scrape period in the streams part: its idle CPU, subtracted, stays small


# --- the wrk parts: overhead, router, tracing ----------------------------------------------


def upstream_config(ports: list[int], page: bytes) -> dict[str, Any]:
    """Listeners answering every request at once; /metrics is the real vLLM page, only the
    families asked for when the query names them (as vLLM's Prometheus client does)."""
    from urllib.parse import unquote

    from epp.datastore.metricsparse import VLLM, query_for
    from simulator.emulator.metrics import restrict_page

    wanted = {unquote(q.partition("=")[2]) for q in query_for(VLLM)[1:].split("&")}

    def route(body: str, kind: str, prefix: str = "/", query: bool = False) -> dict[str, Any]:
        match: dict[str, Any] = {"prefix": prefix}
        if query:
            match["query_parameters"] = [{"name": "name%5B%5D", "present_match": True}]
        return {"match": match, "direct_response": {"status": 200, "body": {"inline_string": body}},
                "response_headers_to_add": [{"header": {"key": "content-type", "value": kind}}]}  # fmt: skip

    text = "text/plain; version=0.0.4"
    routes = [route(restrict_page(page, wanted).decode(), text, "/metrics", True),
              route(page.decode(), text, "/metrics"), route(ANSWER, "application/json")]  # fmt: skip
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network."
                    "http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "up",
           "route_config": {"max_direct_response_body_size_bytes": 1 << 20,
                            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}  # fmt: skip
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [
                {"name": f"up{p}", "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}},
                 "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                 "typed_config": hcm}]}]} for p in ports]}}  # fmt: skip


def wrk_script(path: Path) -> Path:
    """A wrk Lua script posting 256 completions of 16 KB prompts from 64 shared prefixes."""
    bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": 16}) for p in prompts(256, PROMPT_BYTES)]
    lua = ["bodies = {", *(f"  [[{b}]]," for b in bodies), "}", "i = 0", "request = function()",
           "  i = i + 1", '  return wrk.format("POST", "/v1/completions", '
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
    if errors := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        bad += sum(int(x) for x in errors.groups())
    return rps, p50, bad


@dataclass(slots=True)
class Rig:
    """The upstream Envoy, the wrk script and the pool, shared by the wrk parts."""

    pool: tuple[str, ...]
    script: Path
    workdir: Path
    seconds: float
    rounds: int

    async def wrk(self, url: str, conc: int, seconds: float) -> str:
        done = await asyncio.to_thread(
            subprocess.run, ["wrk", "-t1", f"-c{conc}", f"-d{seconds:g}s", "--latency", "-s", str(self.script), url],
            capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return str(done.stdout)

    async def measure(self, options: Any, server_pid: int | None, conc: int) -> dict[str, float]:
        """One wrk run through a fresh front Envoy (after a second's warm-up)."""
        from simulator.envoy import start_envoy, with_ports
        from simulator.stack.cpu import cpu_s

        envoy = await start_envoy(with_ports(options), self.workdir, name="front")
        try:
            await self.wrk(envoy.url, conc, 1)
            before = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
            c0 = (cpu_s(envoy.proc.pid), cpu_s(server_pid) if server_pid else 0.0)
            out = await self.wrk(envoy.url, conc, self.seconds)
            c1 = (cpu_s(envoy.proc.pid), cpu_s(server_pid) if server_pid else 0.0)
            after = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
        finally:
            await envoy.stop()
        rps, p50, bad = parse_wrk(out)
        n = max(1.0, rps * self.seconds)
        return {"rps": rps, "p50_ms": p50, "bad": bad,
                "unrouted": sum(after.values()) - sum(before.values()),
                "envoy_cpu_ms": (c1[0] - c0[0]) * 1e3 / n, "server_cpu_ms": (c1[1] - c0[1]) * 1e3 / n}  # fmt: skip

    async def interleave(self, configs: dict[str, tuple[Any, list[int], int | None]], conc: int,
                         spans: Callable[[], int] | None = None) -> dict[str, list[dict[str, float]]]:  # fmt: skip
        """``configs``: name -> (Envoy options, the pids that run, the pid whose CPU counts);
        each round runs each once, in an order that turns round by round. ``spans``: the
        count of spans received, read before and after each run."""
        pids = {p for _, running, _ in configs.values() for p in running}
        names = list(configs)
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(self.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                options, running, measured = configs[name]
                only(running, pids)
                await asyncio.sleep(1.5 if running else 0.5)  # a resumed epp rescrapes
                before = spans() if spans else 0
                runs[name].append(await self.measure(options, measured, conc))
                if spans:
                    await asyncio.sleep(0.5)  # the batch of the run's last spans
                    runs[name][-1]["spans"] = spans() - before
        only(pids, pids)
        return runs


@contextlib.asynccontextmanager
async def rig(args: argparse.Namespace) -> AsyncIterator[Rig]:
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy
    from simulator.vllm import free_port

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-"))
    ports = [free_port() for _ in range(UPSTREAMS)]
    upstream = await start_envoy(EnvoyOptions(), workdir, name="upstreams",
                                 config=upstream_config(ports, PAGE.read_bytes()))  # fmt: skip
    try:
        yield Rig(tuple(f"127.0.0.1:{p}" for p in ports), wrk_script(workdir / "bodies.lua"), workdir,
                  args.seconds, args.rounds)  # fmt: skip
    finally:
        await upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def epp(rig: Rig, name: str, *extra: str, env: dict[str, str] | None = None) -> Any:
    from simulator.eppproc import EppProcess

    return EppProcess(list(rig.pool), rig.workdir / f"{name}.log", extra=("--log-level", "error", *extra),
                      env=env or {})  # fmt: skip


def row(key: list[object], runs: dict[str, list[dict[str, float]]], pairs: list[tuple[str, str]],
        extra: tuple[str, ...] = ()) -> list[object]:  # fmt: skip
    """Per configuration req/s and p50; per pair (a, b): a's throughput over b's (medians, and
    paired round by round) and a's p50 less b's; servers' CPU per request; unrouted, errors."""
    cells: list[object] = [*key, *(f"{med(r, 'rps'):,.0f}, {med(r, 'p50_ms'):.2f} ms" for r in runs.values())]
    for a, b in pairs:
        paired = statistics.median(x["rps"] / y["rps"] for x, y in zip(runs[a], runs[b], strict=True))
        cells.append(f"{med(runs[a], 'rps') / med(runs[b], 'rps'):.2f} (paired {paired:.2f}), "
                     f"{med(runs[a], 'p50_ms') - med(runs[b], 'p50_ms'):+.2f} ms")  # fmt: skip
    last = list(runs.values())[-1]
    cells.append(f"{med(last, 'envoy_cpu_ms'):.2f}; " + " / ".join(
        f"{med(r, 'server_cpu_ms'):.2f}" for n, r in runs.items() if n != "Envoy alone"))
    every = [x for r in runs.values() for x in r]
    return [*cells, *extra, f"{int(sum(x['unrouted'] for x in every))}, {int(sum(x['bad'] for x in every))}"]


def head(key: list[str], names: list[str], pairs: list[tuple[str, str]], extra: tuple[str, ...] = ()) -> list[str]:
    return [*key, *(f"{n}: req/s, p50" for n in names),
            *(f"{a} / {b}: throughput, p50" for a, b in pairs),
            f"CPU ms a request: Envoy ({names[-1]}); {' / '.join(n for n in names if n != 'Envoy alone')}",
            *extra, "unrouted, errors"]  # fmt: skip


async def overhead(rig: Rig, modes: list[str], concurrency: list[int]) -> dict[str, Any]:
    from epp.envoyconfig import EnvoyOptions

    noop, noop_port = start_noop(rig.pool)
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            e = epp(rig, mode, *(["--response-observer"] if mode == "observer" else []))
            await e.start()
            try:
                configs = {
                    "Envoy alone": (EnvoyOptions(routing="random", pool=rig.pool), [], None),
                    "+ no-op": (EnvoyOptions(epp=(f"127.0.0.1:{noop_port}",), pool=rig.pool, **MODES[mode]),
                                [noop.pid], noop.pid),
                    "+ epp": (EnvoyOptions(epp=(e.address,), pool=rig.pool, **MODES[mode]), [e.pid], e.pid),
                }  # fmt: skip
                for conc in concurrency:
                    runs = results[f"{mode}/{conc}"] = await rig.interleave(configs, conc)
                    print(table(OVERHEAD, [row([mode, conc], runs, OVERHEAD_PAIRS)]), flush=True)
            finally:
                await e.stop()
    finally:
        stop([noop])
    return results


OVERHEAD_PAIRS = [("+ epp", "+ no-op")]
OVERHEAD = head(["mode", "concurrency"], ["Envoy alone", "+ no-op", "+ epp"], OVERHEAD_PAIRS)


async def model_router(rig: Rig, concurrency: list[int]) -> dict[str, Any]:
    """Two pools behind the model router (every request names ``m``, the second pool gets none)."""
    from epp.envoyconfig import EnvoyOptions, PoolRoute
    from simulator.eppproc import RouterProcess

    e = epp(rig, "epp")
    router = RouterProcess([f"m=m@{','.join(rig.pool)}", f"other=other@{rig.pool[0]}"],
                           rig.workdir / "router.log", extra=("--models-refresh-s", "60", "--log-level", "error"))  # fmt: skip
    pools = (PoolRoute("m", ("m",), rig.pool, (e.address,)), PoolRoute("other", ("other",), rig.pool[:1], (e.address,)))
    routed = {"model_router": (router.address,), "pools": pools, **MODES["default"]}
    results: dict[str, Any] = {}
    try:
        await e.start()
        await router.start()
        configs = {
            "Envoy alone": (EnvoyOptions(routing="random", pool=rig.pool), [], None),
            "+ router": (EnvoyOptions(routing="random", **routed), [router.pid], router.pid),  # type: ignore[arg-type]
            "+ epp": (EnvoyOptions(epp=(e.address,), pool=rig.pool, **MODES["default"]), [e.pid], e.pid),
            "+ router + epp": (EnvoyOptions(routing="epp", **routed), [router.pid, e.pid], router.pid),  # type: ignore[arg-type]
        }
        for conc in concurrency:
            results[str(conc)] = await rig.interleave(configs, conc)
            print(table(ROUTER, [row([conc], results[str(conc)], ROUTER_PAIRS)]), flush=True)
    finally:
        await router.stop()
        await e.stop()
    return results


ROUTER_PAIRS = [("+ router", "Envoy alone"), ("+ router + epp", "+ epp")]
ROUTER = head(["concurrency"], ["Envoy alone", "+ router", "+ epp", "+ router + epp"], ROUTER_PAIRS)


async def tracing(rig: Rig, concurrency: list[int]) -> dict[str, Any]:
    from epp.envoyconfig import EnvoyOptions
    from simulator.otlp import OtlpReceiver

    receiver = await OtlpReceiver(max_spans=1000).start()
    epps = {v: epp(rig, v.replace(" ", "-"), env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **env}
                   if env else None) for v, env in TRACING.items()}  # fmt: skip
    results: dict[str, Any] = {}
    try:
        for e in epps.values():
            await e.start()
        configs = {v: (EnvoyOptions(epp=(e.address,), pool=rig.pool, **MODES["default"]), [e.pid], e.pid)
                   for v, e in epps.items()}  # fmt: skip
        for conc in concurrency:
            results[str(conc)] = await rig.interleave(configs, conc, lambda: receiver.received)
            print(table(TRACING_HEAD, [tracing_row(conc, results[str(conc)])]), flush=True)
    finally:
        for e in epps.values():
            await e.stop()
        await receiver.stop()
    return results


TRACING_PAIRS = [("sampled out", "off"), ("sampled in", "off")]
TRACING_HEAD = head(["concurrency"], list(TRACING), TRACING_PAIRS, ("spans received (sampled out, in)",))


def tracing_row(conc: int, runs: dict[str, list[dict[str, float]]]) -> list[object]:
    spans = ", ".join(f"{int(sum(r['spans'] for r in runs[v])):,}" for v in ("sampled out", "sampled in"))
    return row([conc], runs, TRACING_PAIRS, (spans,))


# --- streamed answers ----------------------------------------------------------------------


async def serve_sse(ports: list[int], interval_s: float) -> None:
    """The streams part's model servers: chat completions like vLLM's (one SSE event per token
    every ``interval_s``, ``usage`` with cached tokens last; or one JSON answer), and the real
    vLLM /metrics page epp scrapes."""
    from aiohttp import web

    def event(doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"id": "chatcmpl-bench", "created": 1, "model": "m", **doc}).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 8))
        prompt = sum(len(m.get("content", "")) for m in body.get("messages", [])) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-bench", "object": "chat.completion", "created": 1,
                                      "model": "m", "usage": usage, "choices": [{
                                          "index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": " word" * n}}]})  # fmt: skip
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(event({"object": "chat.completion.chunk", "choices": [{
                "index": 0, "delta": {"content": f" word{i}"}, "logprobs": None, "finish_reason": None}]}))
            await asyncio.sleep(interval_s)
        await resp.write(event({"object": "chat.completion.chunk", "choices": [], "usage": usage})
                         + b"data: [DONE]\n\n")  # fmt: skip
        await resp.write_eof()
        return resp

    page = PAGE.read_bytes()

    async def metrics(request: web.Request) -> web.Response:
        from simulator.emulator.metrics import restrict_page

        names = set(request.query.getall("name[]", []))
        return web.Response(body=restrict_page(page, names) if names else page, content_type="text/plain")

    app = web.Application(client_max_size=PROMPT_BYTES * 4)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def one_answer(http: Any, url: str, body: bytes, streamed: bool, gaps: list[float]) -> bool:
    """POST one request and read its answer; a streamed one's gaps between token events (after
    its first token) go to ``gaps``. True when it came whole."""
    async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200 or not streamed:
            await r.read()
            return bool(r.status == 200)
        last, done = -1.0, False
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: ") and b'"delta"' in line and b'"content":""' not in line:
                now = time.perf_counter()
                if last >= 0:
                    gaps.append(now - last)
                last = now
        return done


async def stream_cell(url: str, bodies: list[bytes], streamed: bool, conc: int, n: int,
                      epp_pid: int, envoy_pid: int, idle_s: float) -> dict[str, float]:  # fmt: skip
    """``n`` requests by ``conc`` clients; epp's and Envoy's CPU per request (less their idle
    rate over ``idle_s`` just before and just after), the answers' inter-event gaps."""
    import aiohttp

    from simulator.stack.cpu import cpu_ns

    def now() -> tuple[int, int, float]:
        return cpu_ns(epp_pid), cpu_ns(envoy_pid), time.monotonic()

    t0 = now()
    await asyncio.sleep(idle_s)
    t1 = now()
    gaps: list[float] = []
    left = iter(range(n))
    failed = 0

    async def client(http: Any) -> None:
        nonlocal failed
        for i in left:
            failed += not await one_answer(http, url, bodies[i % len(bodies)], streamed, gaps)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:  # fmt: skip
        await asyncio.gather(*(client(http) for _ in range(conc)))
    wall = time.monotonic() - t1[2]
    await asyncio.sleep(0.3)  # the access log's last entries reach epp (flushed every 5 ms)
    t2 = now()
    await asyncio.sleep(idle_s)
    t3 = now()
    idle = (t1[2] - t0[2]) + (t3[2] - t2[2])
    rate = [((t1[k] - t0[k]) + (t3[k] - t2[k])) / idle for k in (0, 1)]
    busy = [(t2[k] - t1[k] - rate[k] * (t2[2] - t1[2])) / n / 1e6 for k in (0, 1)]
    return {"epp_ms": busy[0], "envoy_ms": busy[1], "epp_idle_ms_per_s": rate[0] / 1e6, "rps": n / wall,
            "failed": failed, "gap_p50_ms": pct(gaps, 0.5) * 1e3, "gap_p99_ms": pct(gaps, 0.99) * 1e3,
            "gaps": len(gaps)}  # fmt: skip


async def streams(args: argparse.Namespace) -> dict[str, Any]:
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy, with_ports
    from simulator.eppproc import EppProcess
    from simulator.vllm import free_port

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-streams-"))
    ports = [free_port(), free_port()]
    pool = [f"127.0.0.1:{p}" for p in ports]
    sse, _ = spawn(__file__, "--serve-sse", ",".join(map(str, ports)), "--token-interval-ms",
                   str(args.token_interval_ms))  # fmt: skip
    (config := workdir / "epp.yaml").write_text(f"scraping:\n  intervalSeconds: {SCRAPE_S}\n")
    e = EppProcess(pool, workdir / "epp.log", extra=("--config", str(config), "--log-level", "error"))
    results: dict[str, Any] = {}
    bodies = {}
    for streamed, tokens in ANSWERS:
        docs = [{"model": "m", "max_tokens": tokens, "messages": [{"role": "user", "content": p}],
                 **({"stream": True, "stream_options": {"include_usage": True}} if streamed else {})}
                for p in prompts(64, PROMPT_BYTES, seed=5)]  # fmt: skip
        bodies[(streamed, tokens)] = [json.dumps(d).encode() for d in docs]
    try:
        await e.start()
        for r in range(args.rounds):
            for mode in STREAM_MODES[r % 3:] + STREAM_MODES[: r % 3]:
                options = EnvoyOptions(epp=(e.address,), pool=tuple(pool), **MODES[mode])
                envoy = await start_envoy(with_ports(options), workdir, name="front")
                try:
                    url = envoy.url + "/v1/chat/completions"
                    # warm-up: connections, scrapes, and the access log reaching epp
                    await stream_cell(url, bodies[(True, 8)], True, 4, 16, e.pid, envoy.proc.pid, 0.1)
                    for streamed, tokens in ANSWERS:
                        for conc in args.concurrency:
                            # about --seconds of answers, two a client and four in all at least
                            per = 0.01 + (tokens * args.token_interval_ms / 1e3 if streamed else 0.0)
                            n = max(4, 2 * conc, min(400, int(args.seconds / per) * conc))
                            cell = await stream_cell(url, bodies[(streamed, tokens)], streamed, conc, n,
                                                     e.pid, envoy.proc.pid, args.idle_s)  # fmt: skip
                            key = f"{mode}/{'sse' if streamed else 'json'}-{tokens}/{conc}"
                            results.setdefault(key, []).append(cell)
                            print(f"round {r + 1} {key}: n={n} epp {cell['epp_ms']:.2f} ms/request, "
                                  f"failed {cell['failed']}", file=sys.stderr, flush=True)  # fmt: skip
                finally:
                    await envoy.stop()
    finally:
        await e.stop()
        stop([sse])
        shutil.rmtree(workdir, ignore_errors=True)
    return results


STREAM_HEAD = ["mode", "answer", "streams", "epp CPU ms a request", "epp CPU us a token",
               "x the short unstreamed answer", "event gaps p50 / p99 (ms)", "Envoy CPU ms a request", "failed"]  # fmt: skip


def stream_rows(results: dict[str, Any], concurrency: list[int]) -> list[list[object]]:
    rows: list[list[object]] = []
    for mode in STREAM_MODES:
        for conc in concurrency:
            base = med(results[f"{mode}/json-8/{conc}"], "epp_ms")
            for streamed, tokens in ANSWERS:
                runs = results[f"{mode}/{'sse' if streamed else 'json'}-{tokens}/{conc}"]
                ms = med(runs, "epp_ms")
                gaps = f"{med(runs, 'gap_p50_ms'):.2f} / {med(runs, 'gap_p99_ms'):.2f}" if streamed and tokens > 8 else ""
                rows.append([mode, f"{tokens} tokens, {'streamed' if streamed else 'unstreamed'}", conc,
                             f"{ms:.2f}", f"{1e3 * ms / tokens:,.1f}", f"{ms / base:.2f}", gaps,
                             f"{med(runs, 'envoy_ms'):.2f}", int(sum(r["failed"] for r in runs))])  # fmt: skip
    return rows


def stream_verdict(results: dict[str, Any], concurrency: list[int]) -> str:
    """The issue's targets, read from the default mode's cells."""
    lines = []
    for conc in concurrency:
        def ms(answer: str, mode: str = "default", key: str = "epp_ms", conc: int = conc) -> float:
            return med(results[f"{mode}/{answer}/{conc}"], key)

        def slope(mode: str) -> float:  # epp's CPU per token past the 256th, us
            return 1e3 * (ms("sse-1000", mode) - ms("sse-256", mode)) / 744

        itl = "; ".join(f"{t} tokens: p50 {ms(f'sse-{t}', 'default', 'gap_p50_ms'):.2f} vs "
                        f"{ms(f'sse-{t}', 'request-only', 'gap_p50_ms'):.2f} ms, p99 "
                        f"{ms(f'sse-{t}', 'default', 'gap_p99_ms'):.2f} vs "
                        f"{ms(f'sse-{t}', 'request-only', 'gap_p99_ms'):.2f} ms" for t in (256, 1000))  # fmt: skip
        control = ms("sse-1000", "request-only") / ms("sse-256", "request-only")
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


# --- the pages -----------------------------------------------------------------------------

WRK_NOTES = (
    "Medians of interleaved rounds (each round one run of each configuration, a fresh front "
    "Envoy with one worker each; wrk, one thread, 16 KB prompts from 64 shared prefixes; 8 "
    "direct-response upstreams serving the real vLLM /metrics page, which epp scrapes). "
    "Throughput ratios: of the medians, and (paired) the median of the per-round ratios. CPU: "
    "the front Envoy's in the last configuration's runs, each ext_proc server's in its runs, per "
    "request. Unrouted: requests Envoy let through without a destination from the processor "
    "(failure_mode_allowed); errors: non-2xx and socket errors."
)


def overhead_page(args: argparse.Namespace, data: dict[str, Any]) -> str:
    modes = "; ".join(f"{k}: request {v['request_body']}, response {v['response']}, fail-{v['failure']}"
                      for k, v in MODES.items() if k in args.modes)  # fmt: skip
    over = [row(k.split("/"), runs, OVERHEAD_PAIRS) for k, runs in data["overhead"].items()]
    router = [row([k], runs, ROUTER_PAIRS) for k, runs in data["router"].items()]
    sections = [
        "## Short unstreamed requests: the ext_proc hop\n\n" + table(OVERHEAD, over) + "\n\n"
        + WRK_NOTES + f" Modes: {modes}.\n\n" + table(ROUTER, router) + "\n\nThe model router "
        "(epp model-router) in front of two pools, every request for the first, in the default "
        "mode: Envoy balancing the pool at random alone vs with the router choosing the pool by "
        "the body's model; Envoy + the pool's epp vs Envoy + the router + the pool's epp. The "
        "router's CPU: in its runs.",
        "## Streamed answers: what their length costs epp\n\n"
        + table(STREAM_HEAD, stream_rows(data["streams"], args.concurrency), 2) + "\n\n"
        + stream_verdict(data["streams"], args.concurrency) + f"\n\nMedians of {args.rounds} interleaved "
        f"rounds (a fresh front Envoy per mode and round; epp scraping every {SCRAPE_S:g} s; 2 Python servers "
        f"streaming one chat chunk per token every {args.token_interval_ms:g} ms; 16 KB prompts from 64 "
        "shared prefixes; an aiohttp client, closed loop). epp CPU: the scheduler's count of its threads, "
        "less its idle rate just before and after the cell. Event gaps: between an answer's token events "
        "as the client read them. Modes: default (the shipped bootstrap: epp reads the headers and a "
        "streamed answer's first bytes, Envoy's access log brings the usage and the end), "
        "response-full-duplex (every chunk through epp), request-only (--response none).",
    ]
    return "\n\n".join(sections)


TRACING_NOTES = (
    "\n\nThe default mode, three `epp serve` processes alike but for their OTEL_* variables: off "
    "(none), sampled out (OTEL_EXPORTER_OTLP_ENDPOINT set, OTEL_TRACES_SAMPLER="
    "parentbased_traceidratio, ARG 0: every request's spans started and dropped, its traceparent "
    "still sent upstream), sampled in (parentbased_always_on: five spans a request recorded and "
    "exported over OTLP/HTTP to a receiver in the benchmark's process; the SDK's batch queue "
    "drops what it cannot send in time, so spans received can be fewer than 5 a request). "
)


async def main_async(args: argparse.Namespace) -> None:
    from bench.results import write_result

    data: dict[str, Any] = {}
    async with rig(args) as r:
        if args.tracing != "off":
            data["tracing"] = await tracing(r, args.concurrency)
            rows = [tracing_row(int(k), runs) for k, runs in data["tracing"].items()]
            path = write_result("envoy-tracing", "The cost of epp's tracing through real Envoy",
                                table(TRACING_HEAD, rows) + TRACING_NOTES + WRK_NOTES, data["tracing"])  # fmt: skip
            print(f"wrote {path.relative_to(ROOT)}", flush=True)
        if "overhead" in args.parts:
            data["overhead"] = await overhead(r, args.modes, args.concurrency)
        if "router" in args.parts:
            data["router"] = await model_router(r, args.concurrency)
    if "streams" in args.parts:
        data["streams"] = await streams(args)
        print(table(STREAM_HEAD, stream_rows(data["streams"], args.concurrency), 2))
        print(stream_verdict(data["streams"], args.concurrency), flush=True)
    if set(args.parts) == set(PARTS):
        data.pop("tracing", None)
        path = write_result("envoy-overhead", "ext_proc overhead through real Envoy", overhead_page(args, data), data)
        print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0,
                   help="wrk's duration of one run; in the streams part, about how long a cell's answers take")
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "response-full-duplex"),
                   help=f"the overhead part's, of {', '.join(MODES)}")
    p.add_argument("--concurrency", type=ints, default=[1, 16])
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)} (default: all)")
    p.add_argument("--tracing", choices=("also", "only", "off"), default="also",
                   help="the tracing section (docs/results/envoy-tracing.md): also, only it, or not")
    p.add_argument("--token-interval-ms", type=float, default=5.0,
                   help="the streams part's servers: one event per token this often")
    p.add_argument("--idle-s", type=float, default=1.5,
                   help="the streams part: epp's idle CPU rate is read over this window before and after a cell")
    p.add_argument("--serve-sse", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_sse:
        asyncio.run(serve_sse(ints(args.serve_sse), args.token_interval_ms / 1e3))
        return
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.parts = [] if args.tracing == "only" else [x.strip() for x in args.parts.split(",") if x.strip()]
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if shutil.which("wrk") is None:
        sys.exit("bench_envoy: wrk is not installed (Debian: apt-get install wrk)")
    if not PAGE.exists():
        sys.exit(f"bench_envoy: the real vLLM page is missing ({PAGE})")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
