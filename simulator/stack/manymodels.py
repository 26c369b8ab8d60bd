"""The local stack with several models: ``epp-sim stack --models chat:4,coder:2``.

One pool per model: its servers (emulated, or real vLLM serving the tiny model under that
name), its own epp, and in front of all of them ``epp model-router`` and one real Envoy with
the bootstrap ``epp envoy-config --pool NAME=MODEL@SERVERS ...`` prints: a request goes to the
pool of the model its body names, and that pool's epp picks the server. ``NAME:N:A+B`` adds
LoRA adapters ``A`` and ``B`` to the pool's (emulated) servers, routed to that pool.

With a baseline policy (random, round-robin) the model router still picks the pool (without
it the gateway cannot serve two models), and Envoy balances inside the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epp.envoyconfig import EnvoyOptions, PoolRoute
from simulator.envoy import EnvoyUnavailable, start_envoy, with_ports
from simulator.stack.stack import (
    EnvoyGateway,
    EppReplica,
    Stack,
    StackError,
    StackOptions,
    _Child,
    _log_dir,
    _ready_replicas,
    _spawn,
    _start_epps,
    _stop_parts,
    _wait_epp,
    _wait_gateway,
)

POLICIES = ("epp", "random", "round-robin", "least-request")


@dataclass(slots=True, frozen=True)
class ModelPool:
    """One model of ``--models``: its name (what clients send as ``model``), its servers'
    count and the LoRA adapters they serve."""

    model: str
    replicas: int
    adapters: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The pool's name: the model's, as a DNS label."""
        return re.sub(r"[^a-z0-9-]+", "-", self.model.lower()).strip("-")[:63] or "pool"

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.adapters)


def parse_models(text: str) -> tuple[ModelPool, ...]:
    """``chat:4,coder:2`` (``MODEL:N[:ADAPTER+ADAPTER...]``, comma-separated)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        model, _, rest = part.partition(":")
        count, _, adapters = rest.partition(":")
        if not model or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--models {part!r}: expected MODEL:N[:ADAPTER+ADAPTER...], N >= 1 "
                             "servers (chat:4,coder:2)")  # fmt: skip
        out.append(ModelPool(model, int(count), tuple(a for a in adapters.split("+") if a)))
    if len(out) < 1:
        raise ValueError("--models: name at least one MODEL:N")
    names = [p.name for p in out]
    if len(set(names)) != len(names) or len({m for p in out for m in p.models}) != sum(
            len(p.models) for p in out):
        raise ValueError(f"--models {text!r}: every model and pool once")
    return tuple(out)


@dataclass
class StackPool:
    """A running pool of the stack."""

    spec: ModelPool
    replica_urls: list[str]
    epps: list[EppReplica] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def endpoints(self) -> tuple[str, ...]:
        return tuple(u.removeprefix("http://") for u in self.replica_urls)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "models": list(self.spec.models),
                "replica_urls": self.replica_urls, "epp_grpcs": [e.grpc for e in self.epps]}  # fmt: skip


def check(options: StackOptions) -> None:
    """What the several-models stack supports (``ValueError`` names the conflict)."""
    if options.gateway != "envoy":
        raise ValueError("--models runs real Envoy (the model router is an Envoy ext_proc)")
    if options.policy not in POLICIES:
        raise ValueError(f"--models with --routing {options.policy!r}: one of {', '.join(POLICIES)}")
    if options.pd or options.prefix != "approx" or options.servers or options.fair:
        raise ValueError("--models: aggregated pools, approximate prefix, servers it starts")
    if options.engine == "vllm" and any(p.adapters for p in options.models):
        raise ValueError("--models with adapters needs emulated servers (real vLLM needs "
                         "adapter weights)")  # fmt: skip


async def start_models_stack(options: StackOptions) -> Stack:
    check(options)
    deadline = time.monotonic() + options.ready_timeout_s
    log_dir = _log_dir(options)
    children: list[_Child] = []
    inline: list[Any] = []
    pools: list[StackPool] = []
    try:
        first = 0
        for spec in options.models:
            one = dataclasses.replace(options, models=(), replicas=spec.replicas, model=spec.model,
                                      lora_adapters=spec.adapters, first_server=first)  # fmt: skip
            first += spec.replicas
            kids: list[_Child] = []
            urls = await _ready_replicas(one, log_dir, kids, inline, None)
            children += kids
            pool = StackPool(spec, urls)
            pools.append(pool)
        deadline = time.monotonic() + options.ready_timeout_s
        if options.policy == "epp":
            for pool in pools:
                one = dataclasses.replace(options, models=(), model=pool.spec.model)
                pool.epps = await _start_epps(one, options.config, list(pool.endpoints()), log_dir,
                                              children, inline, deadline, name=f"epp-{pool.name}")  # fmt: skip
        router, router_metrics = await _start_router(options, pools, log_dir, children, inline)
        await _wait_epp(router, deadline)
        gateway = await _start_envoy(options, pools, router, log_dir)
        urls = [u for p in pools for u in p.replica_urls]
        stack = Stack(options, gateway, urls, [e for p in pools for e in p.epps], log_dir,
                      children, inline, pools=list(pools), model_router=router,
                      model_router_metrics=router_metrics)  # fmt: skip
        try:
            await _wait_gateway(gateway.url, deadline)
        except BaseException:
            await gateway.stop()
            raise
        return stack
    except BaseException:
        with contextlib.suppress(Exception):
            await _stop_parts(inline, children)
        raise


def pool_flags(pools: list[StackPool]) -> tuple[list[str], list[str]]:
    """The model router's ``--pool`` and ``--adapters`` values."""
    flags = [f"{p.name}={p.spec.model}@{','.join(p.endpoints())}" for p in pools]
    adapters = [f"{p.spec.model}={','.join(p.spec.adapters)}" for p in pools if p.spec.adapters]
    return flags, adapters


async def _start_router(
    options: StackOptions, pools: list[StackPool], log_dir: Path | None,
    children: list[_Child], inline: list[Any],
) -> tuple[str, str]:  # fmt: skip
    """``epp model-router``, in a child process or in this one: its ext_proc address and
    its /metrics URL."""
    flags, adapters = pool_flags(pools)
    if options.isolation == "process":
        assert log_dir is not None
        argv = ["model-router", *(f"--pool={f}" for f in flags),
                *(f"--adapters={a}" for a in adapters)]  # fmt: skip
        ch, info = await _spawn("model-router", argv, log_dir, options.ready_timeout_s)
        children.append(ch)
        return str(info["router"]["grpc"]), str(info["router"]["metrics"])
    from simulator.stack import child

    handle = await child.start_model_router(flags, adapters)
    inline.append(handle)
    described = child.describe_epp(handle)
    return str(described["grpc"]), str(described["metrics"])


async def _start_envoy(
    options: StackOptions, pools: list[StackPool], router: str, log_dir: Path | None
) -> EnvoyGateway:
    import tempfile

    scratch = None if log_dir else Path(tempfile.mkdtemp(prefix="epp-envoy-"))
    folder = log_dir or scratch
    assert folder is not None
    routes = tuple(PoolRoute(p.name, (p.spec.model,), p.endpoints(), tuple(e.grpc for e in p.epps))
                   for p in pools)  # fmt: skip
    envoy_options = with_ports(
        EnvoyOptions(pools=routes, model_router=(router,), routing=options.policy,
                     failure="open" if options.request_mode == "buffered" else "closed",
                     request_body=options.request_mode,
                     response="observer" if options.response_observer else (options.response_mode or "full-duplex"),
                     upstream_host_header=True, message_timeout_s=10.0,
                     access_log=str(folder / "envoy-access.jsonl")),
        port=options.gateway_port,
    )  # fmt: skip
    try:
        envoy = await start_envoy(envoy_options, folder, ready_timeout_s=options.ready_timeout_s)
    except EnvoyUnavailable as exc:
        raise StackError(str(exc)) from None
    return EnvoyGateway(envoy, scratch)


# --- the demo: every model's workload at once, a table per model ------------------------

DEMO_REPLICAS = 4
"""The demo workload is sized for this many servers; a pool of N gets N/4 of its system
prompts and conversations at a time (at least 2), so every pool's caches are as full."""
ADAPTER_GROUPS = 2
"""System prompts of the pool's workload whose conversations name an adapter instead."""


@dataclass(slots=True, frozen=True)
class ModelLoad:
    """One model's share of the demo: its workload, and the pool that serves it."""

    model: str
    pool: str
    workload: Any


def model_loads(models: tuple[ModelPool, ...], workload: Any) -> list[ModelLoad]:
    """Each pool's workload (scaled to its servers, seeded apart), split between its base
    model and its adapters (``ADAPTER_GROUPS`` system prompts each)."""
    out = []
    for k, spec in enumerate(models):
        share = spec.replicas / DEMO_REPLICAS
        groups = max(2, round(workload.num_groups * share))
        concurrency = max(2, round(workload.concurrency * share))
        adapter_groups = min(ADAPTER_GROUPS, max(1, groups // 4)) if spec.adapters else 0
        base_groups = max(1, groups - adapter_groups * len(spec.adapters))
        seed = workload.seed + 1009 * k
        out.append(ModelLoad(spec.model, spec.name, dataclasses.replace(
            workload, num_groups=base_groups, seed=seed,
            concurrency=max(1, round(concurrency * base_groups / groups)))))  # fmt: skip
        for j, adapter in enumerate(spec.adapters):
            out.append(ModelLoad(adapter, spec.name, dataclasses.replace(
                workload, num_groups=adapter_groups, seed=seed + 7 * (j + 1),
                concurrency=max(1, round(concurrency * adapter_groups / groups)))))  # fmt: skip
    return out


@dataclass(slots=True)
class ModelRun:
    """One model's requests under one policy, with its pool's server counters."""

    summary: Any
    misrouted: int
    """Requests answered by a server outside the model's pool (``x-upstream-host``)."""


async def run_policy(options: StackOptions, loads: list[ModelLoad], progress: Any = None) -> dict[str, ModelRun]:
    """Every model's workload at once through one fresh stack; per model its summary."""
    import asyncio

    from simulator.stack.driver import run_workload
    from simulator.stack.report import scrape_replicas, summarize

    stack = await start_models_stack(options)
    try:
        pools = {p.name: p for p in stack.pools}
        tasks = {}
        for load in loads:
            task = None
            if progress is not None:
                task = progress.add_task(f"{load.model} via {options.policy}", total=load.workload.total_requests)

            def advance(_: object, task: Any = task) -> None:
                if progress is not None and task is not None:
                    progress.advance(task)

            tasks[load.model] = run_workload(stack.gateway_url, load.workload, load.model, on_done=advance)
        results = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
        counters = {name: await scrape_replicas(p.replica_urls) for name, p in pools.items()}
    finally:
        await stack.stop()
    out = {}
    for load in loads:
        records = results[load.model]
        pool = pools[load.pool]
        allowed = set(pool.endpoints())
        misrouted = sum(1 for r in records.records if r.ok and r.upstream and r.upstream not in allowed)
        out[load.model] = ModelRun(summarize(options.policy, records, counters[load.pool]), misrouted)
    return out


async def run_models_demo(
    base: StackOptions, workload: Any, policies: tuple[str, ...], out_dir: Path | None,
    console: Any = None,
) -> dict[str, dict[str, ModelRun]]:  # fmt: skip
    """The demo with ``base.models``: per policy a fresh stack, every model's workload at
    once; a table per model (its pool's servers' counters beside its own requests)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from simulator.stack.report import write_json

    console = console or Console()
    loads = model_loads(base.models, workload)
    pools = ", ".join(f"{p.name}: {p.replicas} servers of {p.model}"
                      + (f" with adapters {', '.join(p.adapters)}" if p.adapters else "")
                      for p in base.models)  # fmt: skip
    engine = "real vLLM servers (the tiny model under each name)" if base.engine == "vllm" else "emulated servers"
    console.print(f"[bold]Stack[/]: {pools} ({engine}); an epp per pool, epp model-router and "
                  "one real Envoy in front; fresh servers per policy.")  # fmt: skip
    for load in loads:
        console.print(f"[bold]Workload {load.model}[/] (pool {load.pool}): {load.workload.describe()}")
    runs: dict[str, dict[str, ModelRun]] = {}
    with Progress(TextColumn("{task.description:>28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:  # fmt: skip
        for policy in policies:
            runs[policy] = await run_policy(dataclasses.replace(base, policy=policy), loads, progress)
    from rich.table import Table

    table = Table(title="per model: " + " vs ".join(policies) + " (fresh servers each; hit rate "
                  "over the model's pool's servers)", title_justify="left")  # fmt: skip
    for name in ("model", "policy", "hit rate", "TTFT p50 / p90 ms", "server TTFT ms", "misrouted", "errors"):
        table.add_column(name, justify="left" if name in ("model", "policy") else "right")
    for load in loads:
        for i, p in enumerate(policies):
            r = runs[p][load.model]
            s = r.summary
            table.add_row(load.model if i == 0 else "", p, f"{s.hit_rate:.1%}",
                          f"{s.ttft_p50_ms:.0f} / {s.ttft_p90_ms:.0f}", f"{s.server_ttft_mean_ms:.0f}",
                          str(r.misrouted), f"{s.errors}/{s.requests}", end_section=i == len(policies) - 1)  # fmt: skip
    console.print(table)
    console.print("misrouted = requests a server outside the model's pool answered "
                  "(x-upstream-host); hit rate = the pool's vllm:prefix_cache_hits_total / "
                  "queries_total; TTFT from the client's SSE stream; server TTFT = the mean of the "
                  "pool's vllm:time_to_first_token_seconds (the servers' own, without the gateway).")  # fmt: skip
    if out_dir is not None:
        flat = [dataclasses.replace(r.summary, policy=f"{p} / {m}") for p in policies
                for m, r in runs[p].items()]  # fmt: skip
        path = write_json(flat, out_dir / "demo-models.json",
                          {"models": [dataclasses.asdict(p) for p in base.models],
                           "misrouted": {f"{p} / {m}": r.misrouted for p in policies
                                         for m, r in runs[p].items()}})  # fmt: skip
        console.print(f"numbers: {path}")
    return runs
