"""Processes of the local stack: ``python -m simulator.stack.child replicas|epp ...``.

Each child starts its servers on port 0 through the programmatic starters, prints ONE JSON
line with the bound addresses, then serves until SIGTERM/SIGINT or until its stdin closes
(the parent died), so a killed ``epp-sim stack`` leaves no orphans. The replicas share one
process and one event loop; epp gets its own, so its latency is not measured through the
emulators' work. Several epp replicas share that process too (one event loop serves them
all: on a 2-core machine a process each would only add contention).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from simulator.clihelp import stop_event
from simulator.emulator import EmulatorConfig, RunningEmulator, start_emulator


async def start_replicas(
    count: int,
    speedup: float,
    model: str,
    kv_blocks: int | None,
    max_num_seqs: int | None,
    host: str = "127.0.0.1",
    tokenizer: str = "",
    kv_events: str = "",
    kv_store: str = "",
    lora_adapters: tuple[str, ...] = (),
    max_loras: int | None = None,
) -> list[RunningEmulator]:
    extra: dict[str, Any] = {"tokenizer": tokenizer, "kv_events": kv_events, "kv_store": kv_store,
                             "lora_adapters": tuple(lora_adapters)}  # fmt: skip
    if max_loras:
        extra["max_loras"] = max_loras
    if kv_blocks:
        extra["num_gpu_blocks"] = kv_blocks
    if max_num_seqs:
        extra["max_num_seqs"] = max_num_seqs
    config = EmulatorConfig(host=host, port=0, model=model, speedup=speedup, **extra)
    return [await start_emulator(config) for _ in range(count)]


async def start_epps(
    count: int,
    endpoints: list[str],
    config: str,
    sync: bool = True,
    host: str = "127.0.0.1",
    mesh_timeout_s: float = 30.0,
    scrape_interval_s: float | None = None,
    response_observer: bool = False,
    sync_prefill: bool = True,
) -> list[Any]:
    """``count`` epp servers (epp's own ``start_server``) on free ports, scraping ``endpoints``.

    With ``count > 1`` and ``sync``, every replica shares its index writes with the others
    (docs/sync.md). Ports are 0 and the peer set can change after start, so each server
    starts with sync on and no peers; once all are listening, each is given the others' bound
    sync ports (``handle.sync.peers.update``), as ``--peer-dns`` does when pods appear.
    Choosing free ports first and passing ``--peers`` up front would race with any other
    process binding them in between. Returns once every replica follows every other."""
    from epp.config.loader import default_config, load_config
    from epp.datastore.scraper import ScrapeOptions
    from epp.datastore.static import parse_endpoint_list
    from epp.extproc.observer import DEFAULT_WAIT_S as OBSERVER_WAIT_S
    from epp.server.runner import ServerOptions, start_server
    from epp.sync.node import SyncOptions

    # several configs (comma-separated): one per replica (precise mode: each binds its own
    # KV-event socket)
    names = config.split(",") if "," in config else [config] * count
    if len(names) != count:
        raise ValueError(f"{len(names)} configs for {count} epp replicas")
    cfgs = [load_config(n) if n else default_config() for n in names]
    pool = parse_endpoint_list(",".join(endpoints)) if endpoints else list(cfgs[0].static_endpoints)
    share = sync and count > 1
    handles: list[Any] = []
    try:
        for cfg in cfgs:
            options = ServerOptions(
                host=host,
                grpc_port=0,
                health_port=-1,
                metrics_port=0,
                sync=SyncOptions(port=0, share_prefill=sync_prefill) if share else None,
                scraping=ScrapeOptions(
                    interval_s=scrape_interval_s or cfg.scraping.interval_seconds
                ),
                response_observer_wait_s=OBSERVER_WAIT_S if response_observer else 0.0,
            )
            handles.append(await start_server(cfg, pool, options))
        if share:
            addresses = [f"{host}:{h.sync_port}" for h in handles]
            for h, own in zip(handles, addresses, strict=True):
                h.sync.peers.update(a for a in addresses if a != own)
            await _wait_mesh(handles, mesh_timeout_s)
    except BaseException:
        for h in handles:
            await h.stop(0)
        raise
    return handles


async def _wait_mesh(handles: list[Any], timeout_s: float) -> None:
    """Until every replica has an open ``Subscribe`` stream to every other."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while any(len(h.sync.connected) < len(handles) - 1 for h in handles):
        if time.monotonic() > deadline:
            raise TimeoutError(f"epp replicas did not connect their index sync in {timeout_s}s")
        await asyncio.sleep(delay)  # back-off between readiness probes
        delay = min(delay * 2, 0.1)


async def start_model_router(
    pools: list[str], adapters: list[str], host: str = "127.0.0.1", refresh_s: float = 2.0
) -> Any:
    """``epp model-router`` (its own ``start_router``) on free ports, over ``pools``
    (``--pool`` values) with ``adapters`` (``--adapters`` values)."""
    from epp.modelrouter.listing import ListingOptions
    from epp.modelrouter.pools import from_flags
    from epp.modelrouter.server import RouterOptions, start_router

    config = from_flags(pools, adapters)
    assert config is not None
    options = RouterOptions(host=host, grpc_port=0, metrics_port=0,
                            listing=ListingOptions(refresh_s=refresh_s))  # fmt: skip
    return await start_router(config, options)


def describe_epp(handle: Any, host: str = "127.0.0.1") -> dict[str, Any]:
    return {
        "grpc": f"{host}:{handle.grpc_port}",
        "metrics": f"http://{host}:{handle.metrics_port}/metrics",
        "sync": f"{host}:{handle.sync_port}" if getattr(handle, "sync", None) is not None else None,
    }


async def _until_stopped() -> None:
    stop = stop_event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:
        if not os.read(sys.stdin.fileno(), 4096):  # EOF: the parent is gone
            loop.remove_reader(sys.stdin.fileno())
            stop.set()

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    await stop.wait()


async def _main(args: argparse.Namespace) -> None:
    if args.role == "replicas":
        reps = await start_replicas(
            args.count, args.speedup, args.model, args.kv_blocks, args.max_num_seqs,
            tokenizer=args.tokenizer, kv_events=args.kv_events, kv_store=args.kv_store,
            lora_adapters=tuple(a for a in args.lora_adapters.split(",") if a), max_loras=args.max_loras,
        )  # fmt: skip
        print(json.dumps({"replica_urls": [r.url for r in reps]}), flush=True)
        try:
            await _until_stopped()
        finally:
            for r in reps:
                await r.close()
    elif args.role == "model-router":
        router = await start_model_router(args.pool, args.adapters)
        print(json.dumps({"router": describe_epp(router)}), flush=True)
        try:
            await _until_stopped()
        finally:
            await router.stop(1.0)
    else:
        handles = await start_epps(
            args.count, [e for e in args.endpoints.split(",") if e], args.config, sync=not args.no_sync,
            scrape_interval_s=args.scrape_interval_s, response_observer=args.response_observer,
            sync_prefill=not args.no_sync_prefill,
        )
        print(json.dumps({"epps": [describe_epp(h) for h in handles]}), flush=True)
        try:
            await _until_stopped()
        finally:
            await asyncio.gather(*(h.stop(1.0) for h in handles))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="simulator.stack.child")
    p.add_argument("role", choices=["replicas", "epp", "model-router"])
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--model", default=EmulatorConfig().model)
    p.add_argument("--kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--tokenizer", default="", help="replicas: tokenizer directory")
    p.add_argument("--kv-events", default="", help="replicas: where to publish KV events")
    p.add_argument("--kv-store", default="", help="replicas: a KV store directory they share")
    p.add_argument("--lora-adapters", default="", help="replicas: LoRA adapters served, comma-separated")
    p.add_argument("--max-loras", type=int, default=None, help="replicas: most distinct adapters a batch")
    p.add_argument("--endpoints", default="", help="epp: the pool (default: the config's staticEndpoints)")
    p.add_argument("--config", default="")
    p.add_argument("--no-sync", action="store_true", help="epp: replicas do not share their index")
    p.add_argument("--no-sync-prefill", action="store_true",
                   help="epp: replicas share their index but not their prefill in flight")
    p.add_argument("--scrape-interval-s", type=float, default=None, help="epp: scrape period")
    p.add_argument("--response-observer", action="store_true",
                   help="epp: responses come on an observer filter's stream")
    p.add_argument("--pool", action="append", default=[], help="model-router: a pool, NAME=MODEL@SERVERS")
    p.add_argument("--adapters", action="append", default=[], help="model-router: BASE=ADAPTER,...")
    p.add_argument("--log-level", default=os.environ.get("EPP_SIM_LOG_LEVEL", "WARNING"))
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        asyncio.run(_main(args))
    except Exception as exc:
        print(f"simulator.stack.child {args.role}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
