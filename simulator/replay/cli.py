"""``epp-sim replay``: replay a trace or a generated workload against every routing policy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from epp.config.loader import default_config, load_config
from epp.errors import ConfigError
from simulator.clihelp import HelpFormatter, deprecated_alias
from simulator.model.cost import CostModel, load_profile
from simulator.replay.advice import (
    advice,
    kv_fit,
    no_reuse_warning,
    prefix_reuse,
    too_large_warning,
)
from simulator.replay.bound import bound_percentile, ttft_lower_bounds
from simulator.replay.convert import CSV_COLUMNS, convert, csv_format, left_out_note
from simulator.replay.policies import POLICY_NAMES, ROLE_AWARE_POLICIES, policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer, ReplayResult, pd_roles
from simulator.replay.report import PolicyStats, print_table, summarize
from simulator.replay.requestlog import RequestLog
from simulator.replay.sweep import parse_sweep, sweep_points
from simulator.replay.workload import (
    DEFAULT_TRACE,
    GENERATORS,
    MooncakeTrace,
    Workload,
    build_generator,
    open_text,
    plain_suffix,
)

DEFAULT_POLICIES = ",".join(POLICY_NAMES)


def register(subparsers: Any) -> None:
    d = ReplayConfig()
    p = subparsers.add_parser(
        "replay",
        help="replay a trace against routing policies (offline, simulated time)",
        description=(
            "Discrete-event replay of a trace (a request log, JSONL or CSV, or Mooncake JSONL: "
            "docs/replay.md) or a generated workload against "
            "N emulated replicas (prefix KV cache + cost model), once per routing policy; epp "
            "runs its real scheduler with the given config. Prints one table row per policy."
        ),
        formatter_class=HelpFormatter,
    )
    add_workload_args(p)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated; epp:FILE / precise:FILE / oracle:FILE name a config; "
                   "also ttft-oracle (each request to the replica whose what-if run gives its "
                   "first token soonest: slow, not in the default set)")
    p.add_argument("--config", help="epp scheduling config (file or shipped name) for epp, precise and oracle "
                   "(default: the shipped 'default')")
    p.add_argument("--replicas", type=int, default=d.replicas, help="emulated replicas")
    p.add_argument(
        "--pd",
        metavar="P:D",
        help="disaggregated serving: P prefill and D decode replicas (sets --replicas "
        "to P+D; default --config pd, --policies epp); split requests prefill on a "
        "prefiller, move their KV (--cost's kv_transfer_*) and decode on the decoder",
    )
    p.add_argument("--kv-blocks", type=int, default=d.kv_blocks, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=d.block_size_tokens, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most requests decoding together per replica; the rest wait")
    batched = p.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_batched_tokens,
        help="uncached prompt tokens admitted per engine step, as vLLM's flag (with "
        "--chunked-prefill: the tokens a step computes, decodes and prompt chunks together)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="replicas compute prompts in chunks that share each step with the running "
                   "decodes, as vLLM's chunked prefill (default: a step computes whole prompts)")
    p.add_argument("--cost", default="",
                   help="the replicas' step costs: a preset (a100-llama3-8b, the default) or a "
                   "profile file epp-sim calibrate wrote (docs/replay.md)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="most distinct LoRA adapters a replica runs in one batch (vLLM --max-loras); "
                   "a request for another waits")
    scrape = p.add_argument("--scrape-interval-s", type=float, default=d.scrape_interval_s,
                   help="seconds between metric scrapes (default: each epp config's "
                   "scraping.intervalSeconds: 0.2, 1 for predicted-ttft)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the policies' random choices (random, tie-breaks)")
    w = p.add_argument_group("where an index built from what the router sent goes wrong")
    replicas = w.add_argument(
        "--epp-replicas", type=int, default=d.routers,
        help="independent epp replicas (as epp-sim stack's); arrivals round-robin (without "
        "--sync-flush-ms each learns only from what it routed)")
    sync = w.add_argument(
        "--sync-flush-ms", type=float, default=None, metavar="MS",
        help="index sync between the --epp-replicas at epp serve's --sync-flush-ms (20 "
        "there by default): each one's prefix-index writes and prefill in flight reach the "
        "others this many milliseconds later (the flush period's worst case; the network "
        "is not modelled); unset: no sync; epp policies only")
    w.add_argument("--bypass-share", type=float, default=d.bypass_share,
                   help="share of requests sent straight to a random replica, past the epp replicas")
    w.add_argument("--restart", action="append", default=[], metavar="T:R",
                   help="replica R's cache is emptied at T seconds (a restart); repeatable")
    w.add_argument("--replies-not-cached", action="store_true",
                   help="a chat reply's blocks do not serve the conversation's next turn: the model "
                   "answers in tokens that do not come back as the same tokens (the stack's tiny model "
                   "on real vLLM; epp-sim calibrate --replies-not-cached)")
    w.add_argument("--no-reply-text", action="store_true",
                   help="the epp replicas hear each reply's usage and first token but not its text, "
                   "as epp does of a streamed answer through the default bootstrap (epp "
                   "envoy-config --response summary; --response full-duplex reads the text)")
    w.add_argument("--reported-kv-blocks", type=int, default=d.reported_kv_blocks,
                   help="KV blocks the replicas report (0: --kv-blocks); more models a smaller "
                   "cache than configured")
    delay = w.add_argument("--event-delay-s", type=float, default=d.event_delay_s,
                   help="seconds before a KV event reaches the precise policy")
    w.add_argument("--event-loss", type=float, default=d.event_loss,
                   help="share of KV-event batches lost (sequence gaps)")
    p.add_argument("--sweep", help="param=v1,v2,... (rate, time_scale, replicas, kv_blocks, block_size, scrape_interval_s, weight.<scorer>)")
    p.add_argument("--out", help="write the report as JSON (a list, one object per policy and sweep point)")
    p.add_argument("--plot-dir", help="write PNG plots there")
    p.add_argument("--out-dir", help="write report.json (results and every input: command, trace "
                   "SHA-256, settings, epp config, version), report.csv, the plots and index.html there")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    deprecated_alias(p, "--scrape-interval", scrape)
    deprecated_alias(p, "--max-batched-tokens", batched)  # vLLM's name
    deprecated_alias(w, "--routers", replicas)  # epp-sim stack's name
    deprecated_alias(w, "--sync-ms", sync)  # epp serve's name
    deprecated_alias(w, "--event-delay", delay)  # its unit, as its siblings'
    p.set_defaults(run=run)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Where the requests come from: a trace or a generator (``build_workload`` reads them)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help=f"a request log (JSONL or CSV) or a Mooncake JSONL trace "
                     f"(default: {DEFAULT_TRACE} if present)")
    src.add_argument("--workload", choices=sorted(GENERATORS), help="generated workload instead of a trace")
    p.add_argument(
        "--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
        help="generator parameter, e.g. --set num_groups=8 --set rate=4 (repeatable)",
    )
    p.add_argument(
        "--workload-file",
        help="YAML generator parameters (flat, or an inference-perf config with data.shared_prefix)",
    )
    p.add_argument("--trace-format", choices=("auto", "requests", "mooncake", *CSV_COLUMNS),
                   default="auto",
                   help="the --trace file's format: auto reads Mooncake JSONL when the first row "
                   "has exactly its four fields (timestamp in ms, input_length, output_length, "
                   "hash_ids), an Azure or BurstGPT CSV by its columns (converted as epp-sim "
                   "trace convert does), else a request log (timestamp in seconds)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times (0.5 = twice as fast; generators: use --set rate=)")
    p.add_argument("--limit", type=_non_negative_int, default=0,
                   help="replay only the first N trace requests (0 = all)")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="leave out trace rows that do not parse (counted, the first named) "
                   "instead of stopping at the first")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _restart(text: str) -> tuple[float, int]:
    at, _, replica = text.partition(":")
    try:
        return float(at), int(replica)
    except ValueError:
        raise ValueError(f"--restart expects SECONDS:REPLICA, got {text!r}") from None


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


MOONCAKE_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}


def trace_format(path: Path, given: str = "auto") -> str:
    """``mooncake``, ``azure``, ``burstgpt`` or ``requests``: as given, else from the file (a
    CSV with Azure's or BurstGPT's columns is that trace, another CSV a request log; JSONL
    whose first row has exactly Mooncake's fields is Mooncake)."""
    if given != "auto":
        return given
    if plain_suffix(path) == ".csv":
        return csv_format(path) or "requests"
    with open_text(path) as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except ValueError:
                    return "requests"  # the request-log reader names the bad line
                return "mooncake" if isinstance(first, dict) and set(first) == MOONCAKE_FIELDS else "requests"
    return "requests"


def build_workload(args: argparse.Namespace) -> Workload:
    if (args.workload_file or args.params) and not args.workload:
        flag = "--workload-file" if args.workload_file else "--set"
        raise ValueError(f"{flag} configures a generator: add --workload {'|'.join(sorted(GENERATORS))}")
    if args.workload:
        trace_only = [f for f, on in (("--limit", getattr(args, "limit", 0)),
                                      ("--time-scale", getattr(args, "time_scale", 1.0) != 1.0),
                                      ("--skip-bad-rows", getattr(args, "skip_bad_rows", False))) if on]  # fmt: skip
        if trace_only:
            raise ValueError(f"{', '.join(trace_only)} {'applies' if len(trace_only) == 1 else 'apply'} "
                             "to --trace only; a generated workload's size and pace are its "
                             "parameters (--set num_sessions=20 --set rate=4)")  # fmt: skip
        params: dict[str, Any] = {}
        if args.workload_file:
            loaded = yaml.safe_load(Path(args.workload_file).read_text(encoding="utf-8")) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{args.workload_file}: expected a mapping")
            params.update(loaded)
        for item in args.params:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
            params[key.strip()] = _parse_value(value)
        return build_generator(args.workload, params)
    path = Path(args.trace) if args.trace else DEFAULT_TRACE
    if not path.exists():
        raise ValueError(f"trace {path} not found (pass --trace or --workload)")
    trace: MooncakeTrace | RequestLog
    fmt = trace_format(path, args.trace_format)
    if fmt == "mooncake":
        trace = MooncakeTrace.load(path, args.time_scale, args.limit, args.skip_bad_rows)
    elif fmt in CSV_COLUMNS:
        left_out: list[int] = []
        rows = enumerate(convert(fmt, path, left_out=left_out), 2)  # line 1 is the header
        trace = RequestLog.load(path, args.time_scale, args.limit, args.skip_bad_rows, rows)
        print(f"epp-sim replay: {path} is {'an Azure' if fmt == 'azure' else 'a BurstGPT'} trace: "
              f"read as epp-sim trace convert --from {fmt} converts it"
              + left_out_note(left_out, len(trace)), file=sys.stderr)  # fmt: skip
    else:
        trace = RequestLog.load(path, args.time_scale, args.limit, args.skip_bad_rows)
    if trace.skipped:
        print(f"epp-sim replay: skipped {len(trace.skipped)} bad row(s) of {path}, the first: "
              f"{trace.skipped[0]}", file=sys.stderr)  # fmt: skip
    return trace


def _run_policies(
    workload: Workload, config: ReplayConfig, specs: list[str], epp_cfg: Any, console: Console, progress: bool
) -> tuple[list[ReplayResult], list[PolicyStats]]:
    results: list[ReplayResult] = []
    stats: list[PolicyStats] = []
    total = len(workload)
    with Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not progress,
    ) as bar:
        for spec in specs:
            name, factory = policy_factory(spec, epp_cfg)
            task = bar.add_task(name, total=total)

            def advance(n: int, t: TaskID = task) -> None:
                bar.update(t, completed=n)

            result = Replayer(config).run(workload, factory, name, progress=advance)
            bar.remove_task(task)
            results.append(result)
            stats.append(summarize(result))
    return results, stats


def _setup(args: argparse.Namespace) -> tuple[Workload, Any, list[str], ReplayConfig, Any]:
    """The workload, the epp config, the policies, the replay settings and the sweep."""
    workload = build_workload(args)
    if not len(workload):
        raise ValueError(f"workload {workload.name} has no requests")
    roles = pd_roles(args.pd) if args.pd else ()
    if roles:
        args.replicas = len(roles)
        if not args.config:
            args.config = "pd"
        if args.policies == DEFAULT_POLICIES:
            args.policies = "epp"
    epp_cfg = load_config(args.config) if args.config else default_config()
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    for spec in specs:
        policy_factory(spec, epp_cfg)  # fail fast on a bad name or config
        if roles and spec.partition(":")[0] not in ROLE_AWARE_POLICIES:
            raise ValueError(
                f"policy {spec!r} does not read endpoint roles: with --pd, "
                f"policies {', '.join(ROLE_AWARE_POLICIES)} (with a P/D config)"
            )
    config = ReplayConfig(
        replicas=args.replicas,
        kv_blocks=args.kv_blocks,
        block_size_tokens=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.chunked_prefill,
        max_loras=args.max_loras,
        cost=load_profile(args.cost).cost if args.cost else CostModel(),
        scrape_interval_s=args.scrape_interval_s,
        seed=args.seed,
        routers=args.epp_replicas,
        sync_delay_s=None if args.sync_flush_ms is None else args.sync_flush_ms / 1e3,
        bypass_share=args.bypass_share,
        restarts=tuple(_restart(r) for r in args.restart),
        reported_kv_blocks=args.reported_kv_blocks,
        event_delay_s=args.event_delay_s,
        event_loss=args.event_loss,
        roles=roles,
        replies_cached=not args.replies_not_cached,
        reply_text_learned=not args.no_reply_text,
    )
    sweep = parse_sweep(args.sweep) if args.sweep else None
    return workload, epp_cfg, specs, config, sweep


def run(args: argparse.Namespace) -> int:
    # Piped output gets a wide table rather than rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=170)
    err = Console(stderr=True)
    try:
        workload, epp_cfg, specs, config, sweep = _setup(args)
    except (ValueError, OSError, ConfigError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    reuse = prefix_reuse(workload, config.block_size_tokens)
    if reuse == 0.0:
        err.print(no_reuse_warning(workload.name), highlight=False)
    progress = not args.no_progress and sys.stderr.isatty()
    rows: list[dict[str, Any]] = []
    plots: list[Path] = []
    bound: dict[str, float] = {}
    if sweep is None:
        results, stats = _run_policies(workload, config, specs, epp_cfg, console, progress)
        bounds = ttft_lower_bounds(workload.requests(), config.cost, config.block_size_tokens,
                                   config.model, config.replies_cached)  # fmt: skip
        fit = kv_fit(bounds, config.kv_blocks)
        if warning := too_large_warning(fit, config.kv_blocks, config.block_size_tokens):
            console.print(warning, highlight=False)  # before any figure
        print_table(stats, console, title=_title(workload, config))
        p50, p90, p99 = (bound_percentile(bounds, config.kv_blocks, q) for q in (50, 90, 99))
        if fit.too_large < fit.requests:  # no bound for nothing served
            console.print(
                f"TTFT no policy beats (simulator/replay/bound.py): p50 {p50:.2f}s, p90 {p90:.2f}s, "
                f"p99 {p99:.2f}s", highlight=False,
            )  # fmt: skip
        for line in advice(stats, reuse, config.kv_blocks, config.block_size_tokens,
                           args.config or "", fit):  # fmt: skip
            console.print(line, highlight=False)
        rows = [s.to_json() for s in stats]
        bound = {"p50": p50, "p90": p90, "p99": p99} if fit.too_large < fit.requests else {}
        for plot_dir in (d for d in (args.plot_dir, args.out_dir) if d):
            from simulator.replay.plots import write_plots

            plots = write_plots(plot_dir, results, stats)
            for path in plots:
                console.print(f"wrote {path}")
    else:
        try:
            points = sweep_points(sweep, workload, config, epp_cfg)
        except ValueError as exc:
            err.print(f"[red]error:[/red] {exc}")
            return 2
        console.print(
            f"{'point':<26} {'policy':<18} {'hit':>6} {'ttft p50':>9} {'p90':>8} {'p99':>8} "
            f"{'e2e p99':>8} {'tok/s':>8} {'queue':>6} {'imb':>5}"
        )
        for point in points:
            _, stats = _run_policies(point.workload, point.config, specs, point.epp_config, console, progress)
            for s in stats:
                console.print(
                    f"{point.label:<26} {s.policy:<18} {s.hit_rate:>6.1%} {s.ttft_p50_s:>8.2f}s "
                    f"{s.ttft_p90_s:>7.2f}s {s.ttft_p99_s:>7.2f}s {s.e2e_p99_s:>7.2f}s "
                    f"{s.throughput_tok_s:>8,.0f} {s.queue_share:>6.0%} {s.load_imbalance:>5.2f}",
                    highlight=False,
                )
                rows.append({**s.to_json(), "sweep": point.label})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.out}")
    if args.out_dir:
        from simulator.replay.output import inputs_of, write_outputs

        trace = None if args.workload else str(args.trace or DEFAULT_TRACE)
        inputs = inputs_of(workload, trace, config, specs, args.config, getattr(args, "argv", sys.argv[1:]))
        for path in write_outputs(args.out_dir, inputs, rows, plots if sweep is None else (),
                                  bound if sweep is None else None):  # fmt: skip
            console.print(f"wrote {path}")
    return 0


def _title(workload: Workload, config: ReplayConfig) -> str:
    scale = getattr(workload, "time_scale", None)
    extra = f", time scale {scale:g}" if scale is not None else ""
    kv = config.kv_blocks * config.block_size_tokens
    pd = ""
    if config.disaggregated:
        pd = f" ({config.roles.count('prefill')} prefill, {config.roles.count('decode')} decode)"
    return (
        f"{workload.name}: {len(workload)} requests{extra}, {config.replicas} replicas{pd} x "
        f"{kv:,} KV tokens"
    )
