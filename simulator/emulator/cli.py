"""``epp-sim emulate``: serve one emulated vLLM replica until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from simulator.clihelp import HelpFormatter, deprecated_alias, stop_event
from simulator.emulator.config import EmulatorConfig
from simulator.emulator.server import start_emulator
from simulator.model.cost import load_profile


def register(subparsers: Any) -> None:
    d = EmulatorConfig()
    p = subparsers.add_parser(
        "emulate",
        help="serve one emulated vLLM replica",
        description=(
            "Serve one emulated vLLM replica: the OpenAI API (/v1/completions, "
            "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models), Anthropic's "
            "/v1/messages (and /v1/messages/count_tokens), /health, vLLM's /metrics, "
            "/tokenize, /detokenize, /generate and /inference/v1/generate, the pooling APIs "
            "(/v1/rerank, /v1/score, /pooling, /classify, /v2/embed, ...), "
            "/v1/audio/transcriptions and /translations, and vLLM's dev-mode endpoints: "
            "POST /reset_prefix_cache, POST /sleep?level=0|1|2 (drops the KV cache, aborts "
            "requests in flight, answers 503 until woken; vllm:engine_sleep_state says so, "
            "and epp stops routing to it), POST /wake_up and GET /is_sleeping. Responses are stored as vLLM stores them with "
            "VLLM_ENABLE_RESPONSES_API_STORE=1 (previous_response_id, GET/DELETE "
            "/v1/responses/{id}, .../cancel of a background response; 404 for a response "
            "this replica does not hold). Timings come from a cost model of a 7-8B model on one A100-class "
            "GPU with a prefix KV cache; text is 4 characters per token and deterministic. "
            'On start-up prints one JSON line {"url": ...} with the bound address.'
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on; 0 picks a free one")
    p.add_argument("--model", default=d.model, help="served model name (the base model)")
    kv_blocks = p.add_argument(
        "--kv-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV cache size in blocks (capacity = blocks x block size tokens)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most requests decoding together; the rest wait (FIFO)",
    )
    batched = p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_batched_tokens,
        help="uncached prompt tokens admitted per engine step (vLLM's flag)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt + completion accepted, in tokens",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=d.speedup,
        help="run the modelled GPU this many times faster than real time; "
        "latency metrics stay in modelled seconds",
    )
    p.add_argument(
        "--cost", default="",
        help="step costs: a preset (simulator/model/profiles: a100-llama3-8b, the default) or a "
        "profile file epp-sim calibrate wrote",
    )  # fmt: skip
    p.add_argument(
        "--lora-adapters",
        default="",
        help="comma-separated LoRA adapter names served besides the base model "
        "(a request names one as its model)",
    )
    p.add_argument(
        "--max-loras", type=int, default=d.max_loras, help="most distinct adapters in one batch"
    )
    p.add_argument(
        "--tokenizer", default="",
        help="Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with the "
        "chat template): tokenize prompts with it and name KV blocks by vLLM's sha256_cbor "
        "block hashes, as a real server does (default: 4 characters per token)",
    )  # fmt: skip
    p.add_argument(
        "--kv-events", default="", metavar="ZMQ_ENDPOINT",
        help="publish vLLM-format KV-cache events there (needs --tokenizer); bound when it "
        "has '*' (tcp://*:5557), connected to otherwise (epp's bound socket)",
    )  # fmt: skip
    p.add_argument("--kv-events-topic", default="",
                   help="event topic (default kv@HOST:PORT@MODEL)")  # fmt: skip
    p.add_argument("--kv-events-replay", default="", metavar="ZMQ_ENDPOINT",
                   help="bind a ROUTER socket there that replays missed event batches")  # fmt: skip
    p.add_argument(
        "--kv-store", default="", metavar="DIR",
        help="share KV with other emulators through DIR, as vLLM's ExampleConnector (kv_both): "
        "computed prompts are saved there, prompts found there are loaded instead of computed "
        "(counted in vllm:external_prefix_cache_hits_total); disaggregated prefill runs on it",
    )  # fmt: skip
    p.add_argument("--kv-store-max-blocks", type=int, default=d.kv_store_max_blocks,
                   help="most blocks this emulator keeps in --kv-store (its oldest are removed)")  # fmt: skip
    deprecated_alias(p, "--num-gpu-blocks", kv_blocks)
    deprecated_alias(p, "--max-batched-tokens", batched)  # vLLM's name
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    adapters = tuple(a.strip() for a in args.lora_adapters.split(",") if a.strip())
    extra = {"cost": load_profile(args.cost).cost} if args.cost else {}
    return EmulatorConfig(
        **extra,
        host=args.host,
        port=args.port,
        model=args.model,
        num_gpu_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        speedup=args.speedup,
        lora_adapters=adapters,
        max_loras=args.max_loras,
        tokenizer=args.tokenizer,
        kv_events=args.kv_events,
        kv_events_topic=args.kv_events_topic,
        kv_events_replay=args.kv_events_replay,
        kv_store=args.kv_store,
        kv_store_max_blocks=args.kv_store_max_blocks,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"epp-sim emulate: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(config))
    return 0


async def _serve(config: EmulatorConfig) -> None:
    server = await start_emulator(config)
    print(json.dumps({"url": server.url, "model": config.model}), flush=True)
    stop = stop_event()
    try:
        await stop.wait()
    finally:
        await server.close()
