"""What epp costs behind real Envoy: the ext_proc hop per mode, streamed answers, tracing.

- ``overhead``: wrk posts 16 KB prompts (64 shared prefixes) through a front Envoy to 8
  direct-response upstreams serving the real vLLM /metrics page: Envoy alone vs + a no-op
  ext_proc server (bench/harness.py: the floor of any Python processor) vs + ``epp serve``.
- ``streams``: answers of 8 tokens unstreamed, 8, 256 and 1,000 streamed (an SSE event per
  token every 5 ms), three modes: epp's CPU per request and token, the gaps between events.
- ``router`` (asked by name; printed, not on the page): ``epp model-router`` in front of two
  pools: Envoy alone vs + the router, + epp vs + the router + epp (the body router's cost).
- tracing (``--tracing also|only``): the default mode, epp's tracing off, sampled out, in.

The front Envoy runs ``epp envoy-config``'s bootstrap (one worker, fresh every run); the
configurations interleave round by round, the servers not measured paused (SIGSTOP). Writes
docs/results/envoy-overhead.md when both ``--parts`` ran, envoy-tracing.md when tracing did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import PAGE, ints, med, only, pct, prompts, spawn, start_noop, stop  # noqa: E402
from bench.results import table, write_result  # noqa: E402
from simulator.stack.demo import rotated  # noqa: E402

Configs = dict[str, tuple[Any, tuple[int, ...]]]  # name: (Envoy options, pids that run; the first measured)
Runs = dict[str, list[dict[str, float]]]  # name: each round's figures

PARTS = ("overhead", "streams")
"""The page's parts; ``router`` runs when ``--parts`` names it."""
MODES = {
    "default": {"request_body": "buffered", "response": "summary", "failure": "open"},
    "full-duplex": {"request_body": "full-duplex", "response": "full-duplex", "failure": "closed"},
    "request-only": {"request_body": "buffered", "response": "none", "failure": "open"},
    "observer": {"request_body": "buffered", "response": "observer", "failure": "open"},
    "response-full-duplex": {"request_body": "buffered", "response": "full-duplex", "failure": "open"},
}  # fmt: skip
"""The overhead part runs the first four, the streams part ``STREAM_MODES``."""
STREAM_MODES = ("default", "response-full-duplex", "request-only")
ANSWERS = {"json-8": 8, "sse-8": 8, "sse-256": 256, "sse-1000": 1000}
"""The streams part's answers, by key (``sse``: streamed): their tokens."""
TOKEN_S = 0.005  # the streams part's servers send one event per token this often
SCRAPE_S = 1.0  # epp's scrape period in the streams part: its idle CPU, subtracted, stays small
IDLE_S = 2 * SCRAPE_S  # epp's idle CPU rate is read this long before and after a cell: whole scrape periods
TRACING = {
    "off": {},
    "sampled out": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
    "sampled in": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}  # fmt: skip
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 4000, "completion_tokens": 16, "total_tokens": 4016,
                               "prompt_tokens_details": {"cached_tokens": 3000}}})  # fmt: skip


def envoy_options(pool: tuple[str, ...], *epps: str, mode: str = "default") -> Any:
    """The front Envoy balancing ``pool`` at random alone, or through ``epps`` in ``mode``."""
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import with_ports

    if not epps:
        return with_ports(EnvoyOptions(routing="random", pool=pool))
    return with_ports(EnvoyOptions(epp=epps, pool=pool, **MODES[mode]))


def epp(pool: tuple[str, ...], log: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    from simulator.eppproc import EppProcess

    return EppProcess(list(pool), log, extra=("--log-level", "error", *extra), env=env or {})


# --- the wrk parts: overhead and tracing -------------------------------------------------


def vllm_page() -> bytes:
    """The families of the real vLLM page epp asks for (it names them, as vLLM's Prometheus
    client allows): what the upstreams of both parts serve on /metrics."""
    from urllib.parse import unquote

    from epp.datastore.metricsparse import VLLM, query_for
    from simulator.emulator.metrics import restrict_page

    wanted = {unquote(q.partition("=")[2]) for q in query_for(VLLM)[1:].split("&")}
    return restrict_page(PAGE.read_bytes(), wanted)


def upstream_config(ports: list[int]) -> dict[str, Any]:
    """Listeners answering every request at once (/metrics: ``vllm_page``)."""
    page = vllm_page().decode()
    routes = [{"match": {"prefix": prefix}, "direct_response": {"status": 200, "body": {"inline_string": body}},
               "response_headers_to_add": [{"header": {"key": "content-type", "value": kind}}]}
              for prefix, body, kind in [("/metrics", page, "text/plain"), ("/", ANSWER, "application/json")]]  # fmt: skip
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


def wrk_script(path: Path) -> None:
    """A wrk Lua script posting 256 completions of 16 KB prompts from 64 shared prefixes."""
    texts = prompts(256, 16384)
    bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": 16}) for p in texts]
    lua = ["bodies = {", *(f"  [[{b}]]," for b in bodies), "}", "i = 0", "request = function()",
           "  i = i + 1", '  return wrk.format("POST", "/v1/completions", '
           '{["content-type"] = "application/json"}, bodies[(i % #bodies) + 1])', "end"]  # fmt: skip
    path.write_text("\n".join(lua) + "\n")


def parse_wrk(out: str) -> dict[str, float]:
    """Requests/s, p50 ms, and non-2xx responses and socket errors from ``wrk --latency``."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    assert rps and p50, out
    errors = r"Non-2xx or 3xx responses:\s+(\d+)|Socket errors: \D+(\d+)\D+(\d+)\D+(\d+)\D+(\d+)"
    bad = sum(int(x or 0) for found in re.findall(errors, out) for x in found)
    ms = float(p50.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    return {"rps": float(rps.group(1)), "p50_ms": ms, "bad": bad}


@dataclass(slots=True)
class Rig:
    """Where the wrk script is and the settings the wrk parts share."""

    workdir: Path
    seconds: float
    rounds: int
    concurrency: list[int]

    async def wrk(self, url: str, conc: int, seconds: float) -> dict[str, float]:
        script = str(self.workdir / "bodies.lua")
        argv = ["wrk", "-t1", f"-c{conc}", f"-d{seconds:g}s", "--latency", "-s", script, url]
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return parse_wrk(done.stdout)

    async def measure(self, options: Any, server_pid: int | None, conc: int) -> dict[str, float]:
        """One wrk run through a fresh front Envoy (after a second's warm-up)."""
        from simulator.envoy import start_envoy
        from simulator.stack.cpu import cpu_s

        envoy = await start_envoy(options, self.workdir, name="front")

        async def now() -> tuple[float, float, int]:
            unrouted = await envoy.counters("http.inference.ext_proc.failure_mode_allowed")
            cpu = cpu_s(server_pid) if server_pid else 0.0
            return cpu_s(envoy.proc.pid), cpu, sum(unrouted.values())

        try:
            await self.wrk(envoy.url, conc, 1)
            t0 = await now()
            run = await self.wrk(envoy.url, conc, self.seconds)
            t1 = await now()
        finally:
            await envoy.stop()
        n = max(1.0, run["rps"] * self.seconds)
        run.update(envoy_cpu_ms=(t1[0] - t0[0]) * 1e3 / n, server_cpu_ms=(t1[1] - t0[1]) * 1e3 / n)
        return {**run, "unrouted": t1[2] - t0[2]}

    async def interleave(self, configs: Configs, conc: int) -> Runs:
        """``configs``: name -> (Envoy options, the pid of the server that runs and counts); each
        round runs each once, in turn."""
        pids = {pid for _, running in configs.values() for pid in running}
        runs: Runs = {n: [] for n in configs}
        for name in (n for r in range(self.rounds) for n in rotated(list(configs), r)):
            options, running = configs[name]
            only(running, pids)
            await asyncio.sleep(1.5 if running else 0.5)  # a resumed epp rescrapes
            runs[name].append(await self.measure(options, running[0] if running else None, conc))
        only(pids, pids)
        return runs


@dataclass(frozen=True, slots=True)
class Table:
    """A wrk part's table: per configuration req/s and p50; per pair (a, b) a's throughput over
    b's (of the medians, and paired round by round) and a's p50 less b's; CPU per request of
    the front Envoy (in the last configuration) and of each server; unrouted, errors."""

    key: tuple[str, ...]
    names: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]

    def head(self) -> list[str]:
        servers = " / ".join(self.names[1:] if self.names[0] == "Envoy alone" else self.names)
        return [*self.key, *(f"{n}: req/s, p50" for n in self.names),
                *(f"{a} / {b}: throughput, p50" for a, b in self.pairs),
                f"CPU ms a request: Envoy ({self.names[-1]}); {servers}",
                "unrouted, errors"]  # fmt: skip

    def row(self, key: list[object], runs: Runs) -> list[object]:
        def m(name: str, what: str) -> float:
            return med(runs[name], what)

        cells = [*key, *(f"{m(n, 'rps'):,.0f}, {m(n, 'p50_ms'):.2f} ms" for n in self.names)]
        for a, b in self.pairs:
            pairs = zip(runs[a], runs[b], strict=True)
            paired = statistics.median(x["rps"] / y["rps"] for x, y in pairs)
            ratio, later = m(a, "rps") / m(b, "rps"), m(a, "p50_ms") - m(b, "p50_ms")
            cells.append(f"{ratio:.2f} (paired {paired:.2f}), {later:+.2f} ms")
        servers = [f"{m(n, 'server_cpu_ms'):.2f}" for n in self.names if n != "Envoy alone"]
        cells.append(f"{m(self.names[-1], 'envoy_cpu_ms'):.2f}; " + " / ".join(servers))
        unrouted, bad = (sum(x[k] for r in runs.values() for x in r) for k in ("unrouted", "bad"))
        return [*cells, f"{unrouted:.0f}, {bad:.0f}"]

    def rows(self, results: dict[str, Any]) -> list[list[object]]:
        return [self.row(k.split("/"), runs) for k, runs in results.items()]

    async def run(self, rig: Rig, configs: Configs, mode: str = "") -> Any:
        """Each concurrency's runs, by ``MODE/CONCURRENCY`` (or ``CONCURRENCY``); prints each row."""
        out = {}
        for conc in rig.concurrency:
            key = [mode, conc] if mode else [conc]
            out["/".join(map(str, key))] = runs = await rig.interleave(configs, conc)
            print(table(self.head(), [self.row(key, runs)]), flush=True)
        return out


OVERHEAD = Table(("mode", "concurrency"), ("Envoy alone", "+ no-op", "+ epp"), (("+ epp", "+ no-op"),))  # fmt: skip
TRACE = Table(("concurrency",), tuple(TRACING), (("sampled out", "off"), ("sampled in", "off")))
ROUTER = Table(("concurrency",), ("Envoy alone", "+ router", "+ epp", "+ router + epp"),
               (("+ router", "Envoy alone"), ("+ router + epp", "+ epp")))  # fmt: skip


async def model_router(rig: Rig, pool: tuple[str, ...], e: Any) -> Any:
    """The router part: two pools behind ``epp model-router`` (every request names ``m``, the
    second pool gets none), ``e`` the first pool's epp; the router's CPU in its runs."""
    from epp.envoyconfig import EnvoyOptions, PoolRoute
    from simulator.envoy import with_ports
    from simulator.eppproc import RouterProcess

    extra = ("--models-refresh-s", "60", "--log-level", "error")
    router = RouterProcess([f"m=m@{','.join(pool)}", f"other=other@{pool[0]}"], rig.workdir / "router.log", extra=extra)  # fmt: skip
    pools = (PoolRoute("m", ("m",), pool, (e.address,)), PoolRoute("other", ("other",), pool[:1], (e.address,)))  # fmt: skip
    routed = {"model_router": (router.address,), "pools": pools, **MODES["default"]}
    try:
        await router.start()
        configs = {"Envoy alone": (envoy_options(pool), ()),
                   "+ router": (with_ports(EnvoyOptions(routing="random", **routed)), (router.pid,)),
                   "+ epp": (envoy_options(pool, e.address), (e.pid,)),
                   "+ router + epp": (with_ports(EnvoyOptions(routing="epp", **routed)), (router.pid, e.pid))}  # fmt: skip
        print("The router's part: CPU per request of the router in '+ router' and '+ router + epp', of epp in "
              "'+ epp'; the front Envoy's in '+ router + epp'.", flush=True)
        return await ROUTER.run(rig, configs)
    finally:
        await router.stop()


async def wrk_parts(args: argparse.Namespace) -> dict[str, Any]:
    """The overhead part (when ``args.parts`` names it) and the tracing part."""
    from epp.envoyconfig import EnvoyOptions
    from simulator.envoy import start_envoy
    from simulator.otlp import OtlpReceiver
    from simulator.vllm import free_port

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-"))
    ports = [free_port() for _ in range(8)]
    upstream = await start_envoy(EnvoyOptions(), workdir, name="up", config=upstream_config(ports))
    pool = tuple(f"127.0.0.1:{p}" for p in ports)
    rig = Rig(workdir, args.seconds, args.rounds, args.concurrency)
    wrk_script(workdir / "bodies.lua")
    noop, noop_port = start_noop(pool)
    receiver = await OtlpReceiver(max_spans=1000).start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    epps = {v: epp(pool, workdir / f"{v.split()[-1]}.log", env={**env, **e} if e else None)
            for v, e in TRACING.items()}  # fmt: skip
    for mode in list(MODES)[:4]:
        extra = ["--response-observer"] if mode == "observer" else []
        epps[mode] = epp(pool, workdir / f"{mode}.log", *extra)
    out: dict[str, Any] = {"tracing": {}, "overhead": {}}
    try:
        if args.tracing != "off":
            traced = {v: epps[v] for v in TRACING}
            for e in traced.values():
                await e.start()
            configs = {v: (envoy_options(pool, e.address), (e.pid,)) for v, e in traced.items()}
            out["tracing"] = await TRACE.run(rig, configs)
            out["spans"] = receiver.received  # sampled in: five a request, less what the SDK drops
            only([], [e.pid for e in traced.values()])
        for mode in list(MODES)[:4] if "overhead" in args.parts else []:
            await (e := epps[mode]).start()
            configs = {"Envoy alone": (envoy_options(pool), ()),
                       "+ no-op": (envoy_options(pool, f"127.0.0.1:{noop_port}", mode=mode), (noop.pid,)),
                       "+ epp": (envoy_options(pool, e.address, mode=mode), (e.pid,))}  # fmt: skip
            out["overhead"] |= await OVERHEAD.run(rig, configs, mode)
            await e.stop()
        if "router" in args.parts:
            await (e := epps["default"]).start()
            out["router"] = await model_router(rig, pool, e)
    finally:
        for e in epps.values():  # EppProcess.stop: a no-op for one stopped or never started
            await e.stop()
        stop([noop])
        await receiver.stop()
        await upstream.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


# --- streamed answers ----------------------------------------------------------------------


async def serve_sse(ports: list[int]) -> None:
    """The streams part's model servers: chat completions like vLLM's (one SSE event per token
    every ``TOKEN_S``, ``usage`` with cached tokens last; or one JSON answer), and the real
    vLLM /metrics page epp scrapes."""
    from aiohttp import web

    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def event(**doc: Any) -> bytes:
        return b"data: " + json.dumps({**head, **doc}).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 8))
        prompt = sum(len(m.get("content", "")) for m in body.get("messages", [])) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": "length"}
            choice["message"] = {"role": "assistant", "content": " word" * n}
            answer = {**head, "object": "chat.completion", "usage": usage, "choices": [choice]}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            token = {"index": 0, "delta": {"content": f" word{i}"}, "finish_reason": None}
            await resp.write(event(choices=[{**token, "logprobs": None}]))
            await asyncio.sleep(TOKEN_S)
        await resp.write(event(choices=[], usage=usage) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    page = vllm_page()
    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def stream_cell(
    url: str, bodies: list[bytes], conc: int, n: int, pid: int, idle_s: float = IDLE_S
) -> dict[str, float]:
    """``n`` requests by ``conc`` clients; epp's CPU per request (``pid``'s, less the lower of
    its idle rates over ``idle_s`` just before and just after: an upper bound) and its noise (the
    two idle rates' difference over the cell, a request), the gaps between an answer's token
    events after its first."""
    import aiohttp

    from simulator.stack.cpu import cpu_ns

    def now() -> tuple[float, float]:
        return cpu_ns(pid) / 1e6, time.monotonic()

    gaps: list[float] = []
    left = iter(range(n))
    failed = 0
    json_type = {"content-type": "application/json"}

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal failed
        for i in left:
            async with http.post(url, data=bodies[i % len(bodies)], headers=json_type) as r:
                last, done = -1.0, r.status == 200 and b'"stream"' not in bodies[0]
                async for line in r.content:
                    done |= r.status == 200 and line.startswith(b"data: [DONE]")
                    token = line.startswith(b"data: ") and b'"delta"' in line
                    if token and b'"content":""' not in line:
                        if last >= 0:
                            gaps.append(time.perf_counter() - last)
                        last = time.perf_counter()
                failed += not done

    t0 = now()
    await asyncio.sleep(idle_s)
    t1 = now()
    connector, timeout = aiohttp.TCPConnector(limit=0), aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(client(http) for _ in range(conc)))
    await asyncio.sleep(0.3)  # the access log's last entries reach epp (flushed every 5 ms)
    t2 = now()
    await asyncio.sleep(idle_s)
    t3 = now()
    before, after = ((b[0] - a[0]) / (b[1] - a[1]) for a, b in ((t0, t1), (t2, t3)))  # idle, ms a second
    epp_ms = (t2[0] - t1[0] - min(before, after) * (t2[1] - t1[1])) / n
    return {"epp_ms": epp_ms, "noise_ms": abs(before - after) * (t2[1] - t1[1]) / n, "failed": failed, "gap_p50_ms": pct(gaps, 0.5) * 1e3,
            "gap_p99_ms": pct(gaps, 0.99) * 1e3}  # fmt: skip


async def streams(args: argparse.Namespace) -> dict[str, Any]:
    from simulator.envoy import start_envoy
    from simulator.vllm import free_port

    workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-streams-"))
    ports = [free_port(), free_port()]
    pool = tuple(f"127.0.0.1:{p}" for p in ports)
    sse, _ = spawn(__file__, "--serve-sse", ",".join(map(str, ports)))
    (config := workdir / "epp.yaml").write_text(f"scraping:\n  intervalSeconds: {SCRAPE_S}\n")
    e = epp(pool, workdir / "epp.log", "--config", str(config))
    texts = prompts(64, 16384, seed=5)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    bodies = {key: [json.dumps({"model": "m", "max_tokens": tokens, "messages": [{"role": "user", "content": p}],
                                **(stream if "sse" in key else {})}).encode() for p in texts]
              for key, tokens in ANSWERS.items()}  # fmt: skip
    cells = [(key, tokens, conc) for key, tokens in ANSWERS.items() for conc in args.concurrency]
    results: dict[str, Any] = {}
    try:
        await e.start()
        for r, mode in ((i, m) for i in range(args.rounds) for m in rotated(STREAM_MODES, i)):
            options = envoy_options(pool, e.address, mode=mode)
            envoy = await start_envoy(options, workdir, name="front")
            url = envoy.url + "/v1/chat/completions"
            try:
                # warm-up: connections, scrapes, and the access log reaching epp
                await stream_cell(url, bodies["sse-8"], 4, 16, e.pid, 0.1)
                for key, tokens, conc in cells:
                    # about --seconds of answers, two a client and four in all at least
                    per = 0.01 + (tokens * TOKEN_S if "sse" in key else 0.0)
                    n = max(4, 2 * conc, min(400, int(args.seconds / per) * conc))
                    cell = await stream_cell(url, bodies[key], conc, n, e.pid)
                    name = f"{mode}/{key}/{conc}"
                    results.setdefault(name, []).append(cell)
                    print(f"round {r + 1} {name}: epp {cell['epp_ms']:.2f} ms", file=sys.stderr)
            finally:
                await envoy.stop()
    finally:
        await e.stop()
        stop([sse])
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def stream_table(results: dict[str, Any], concurrency: list[int]) -> str:
    """The streams part's table, and what it says of issue 71's targets."""

    def ms(mode: str, key: str, conc: int, what: str = "epp_ms") -> float:
        return med(results[f"{mode}/{key}/{conc}"], what)

    def noisy(mode: str, key: str, conc: int) -> bool:  # under twice its idle noise, or <= 0
        return ms(mode, key, conc) <= 2 * ms(mode, key, conc, "noise_ms")

    def x(mode: str, a: str, b: str, conc: int) -> str:  # a's epp CPU over b's, unless noise
        if noisy(mode, a, conc) or noisy(mode, b, conc):
            return "n/a (under the idle noise)"
        return f"{ms(mode, a, conc) / ms(mode, b, conc):.2f}x"

    def gaps(mode: str, key: str, conc: int) -> str:
        return f"{ms(mode, key, conc, 'gap_p50_ms'):.2f} / {ms(mode, key, conc, 'gap_p99_ms'):.2f}"

    rows: list[list[object]] = []
    for mode, conc, (key, n) in product(STREAM_MODES, concurrency, ANSWERS.items()):
        cpu, kind = ms(mode, key, conc), "streamed" if "sse" in key else "unstreamed"
        failed = sum(r["failed"] for r in results[f"{mode}/{key}/{conc}"])
        noise = f"± {ms(mode, key, conc, 'noise_ms'):.2f}"
        shown = [f"{cpu:.2f} {noise}", f"{1e3 * cpu / n:,.1f}"] if not noisy(mode, key, conc) else [f"noise {noise}", ""]
        rows.append([mode, f"{n} tokens, {kind}", conc, *shown, x(mode, key, "json-8", conc).removesuffix("x"),
                     gaps(mode, key, conc) if n > 8 else "", failed])  # fmt: skip
    head = ["mode", "answer", "streams", "epp CPU ms a request", "epp CPU us a token", "x the short unstreamed answer",
            "event gaps p50 / p99 (ms)", "failed"]  # fmt: skip
    lines = [table(head, rows, 2), ""]
    for c in concurrency:
        gap = "; ".join(f"{t} tokens: p50 / p99 {gaps('default', f'sse-{t}', c)} vs "
                        f"{gaps('request-only', f'sse-{t}', c)} ms" for t in (256, 1000))  # fmt: skip
        lines.append(
            f"- {c} stream(s), the default bootstrap, epp's CPU: a 256-token streamed answer over the short "
            f"unstreamed one {x('default', 'sse-256', 'json-8', c)} (target <= 2); a 1,000-token one over the "
            f"256-token one {x('default', 'sse-1000', 'sse-256', c)} (target <= 1; the same ratio with "
            "no response processing at all, request-only, whose cost cannot grow with the answer: "
            f"{x('request-only', 'sse-1000', 'sse-256', c)}, the measurement's noise); event gaps with epp in "
            f"the path vs Envoy's --response none: {gap}."
        )  # fmt: skip
    return "\n".join(lines)


# --- the pages -----------------------------------------------------------------------------

WRK_NOTES = (
    "Medians of interleaved rounds (a fresh front Envoy with one worker a run; wrk, one thread; 8 "
    "direct-response upstreams serving the real vLLM /metrics page epp scrapes). Paired: the median "
    "of the per-round ratios. CPU per request: the front Envoy's in the last configuration's runs, "
    "each server's in its own. Unrouted: let through without a destination (failure_mode_allowed)."
)
TRACING_NOTES = (
    "\n\nThe default mode, three `epp serve` alike but for OTEL_* variables: off (none), sampled "
    "out (parentbased_traceidratio, ARG 0: spans started and dropped, the traceparent still sent), "
    "sampled in (parentbased_always_on: five spans a request exported over OTLP/HTTP to a receiver "
    "in the benchmark's process, which received {spans:,} spans in all; the SDK's batch queue drops "
    "what it cannot send in time). "
)
STREAM_NOTES = (
    "Medians of {rounds} interleaved rounds (a fresh front Envoy per mode and round; epp scraping "
    "every {scrape:g} s; 2 Python servers streaming a chat chunk per token every {token:g} ms; an "
    "aiohttp client, closed loop). epp CPU: its threads' CPU time less the lower of its idle "
    "rates before and after the cell (an upper bound), ± the two idle rates' difference over the "
    "cell (a ratio reads 'noise' where a cell is under twice that: one long answer at a time, a "
    "few in a cell). Event gaps: between an answer's token events as the client read them. Modes: "
    "default (the shipped bootstrap: epp reads the headers and a streamed answer's first bytes, "
    "Envoy's access log brings the usage and the end), response-full-duplex (every chunk through "
    "epp), request-only (--response none)."
)


def overhead_page(args: argparse.Namespace, data: dict[str, Any]) -> str:
    modes = "; ".join(f"{k}: request {v['request_body']}, response {v['response']}, fail-{v['failure']}"
                      for k, v in MODES.items())  # fmt: skip
    notes = STREAM_NOTES.format(rounds=args.rounds, scrape=SCRAPE_S, token=TOKEN_S * 1e3)
    return "\n\n".join([
        "## Short unstreamed requests: the ext_proc hop", table(OVERHEAD.head(), OVERHEAD.rows(data["overhead"])),
        f"{WRK_NOTES} Modes: {modes}.", "## Streamed answers: what their length costs epp",
        stream_table(data["streams"], args.concurrency), notes])  # fmt: skip


async def main_async(args: argparse.Namespace) -> None:
    data = await wrk_parts(args)
    if traced := data.pop("tracing"):
        notes = TRACING_NOTES.format(spans=data.pop("spans"))
        markdown = table(TRACE.head(), TRACE.rows(traced)) + notes + WRK_NOTES
        title = "The cost of epp's tracing through real Envoy"
        print(f"wrote {write_result('envoy-tracing', title, markdown, traced)}", flush=True)
    if "streams" in args.parts:
        data["streams"] = await streams(args)
        print(stream_table(data["streams"], args.concurrency), flush=True)
    if set(PARTS) <= set(args.parts):
        title = "ext_proc overhead through real Envoy"
        print(f"wrote {write_result('envoy-overhead', title, overhead_page(args, data), data)}")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="a wrk run; a streams cell, about")
    p.add_argument("--concurrency", type=ints, default=[1, 16])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: overhead, streams, router")
    p.add_argument("--tracing", choices=("also", "only", "off"), default="also")
    p.add_argument("--serve-sse", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_sse:
        return asyncio.run(serve_sse(ints(args.serve_sse)))
    args.parts = [] if args.tracing == "only" else args.parts.split(",")
    if unknown := set(args.parts) - {*PARTS, "router"}:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}, router")
    if shutil.which("wrk") is None:
        sys.exit("bench_envoy: wrk is not installed (Debian: apt-get install wrk)")
    if not PAGE.exists():
        sys.exit(f"bench_envoy: the real vLLM page is missing ({PAGE})")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
