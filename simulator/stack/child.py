"""Processes of the local stack: ``python -m simulator.stack.child replicas|epp ...``.

Each child starts its servers on port 0 through the programmatic starters, prints ONE JSON
line with the bound addresses, then serves until SIGTERM/SIGINT or until its stdin closes
(the parent died), so a killed ``epp-sim stack`` leaves no orphans. The replicas share one
process and one event loop; epp gets its own, so its latency is not measured through the
emulators' work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
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
) -> list[RunningEmulator]:
    extra: dict[str, Any] = {}
    if kv_blocks:
        extra["num_gpu_blocks"] = kv_blocks
    if max_num_seqs:
        extra["max_num_seqs"] = max_num_seqs
    config = EmulatorConfig(host=host, port=0, model=model, speedup=speedup, **extra)
    return [await start_emulator(config) for _ in range(count)]


async def start_epp(endpoints: list[str], config: str, host: str = "127.0.0.1") -> Any:
    """epp's own ``start_server`` on free ports, scraping ``endpoints``' /metrics."""
    from epp.config.loader import default_config, load_config
    from epp.datastore.static import parse_endpoint_list
    from epp.server.runner import ServerOptions, start_server

    cfg = load_config(config) if config else default_config()
    options = ServerOptions(host=host, grpc_port=0, health_port=-1, metrics_port=0)
    return await start_server(cfg, parse_endpoint_list(",".join(endpoints)), options)


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
            args.count, args.speedup, args.model, args.kv_blocks, args.max_num_seqs
        )
        print(json.dumps({"replica_urls": [r.url for r in reps]}), flush=True)
        try:
            await _until_stopped()
        finally:
            for r in reps:
                await r.close()
    else:
        handle = await start_epp(args.endpoints.split(","), args.config)
        print(
            json.dumps(
                {
                    "epp_grpc": f"127.0.0.1:{handle.grpc_port}",
                    "epp_metrics": f"http://127.0.0.1:{handle.metrics_port}/metrics",
                }
            ),
            flush=True,
        )
        try:
            await _until_stopped()
        finally:
            await handle.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="simulator.stack.child")
    p.add_argument("role", choices=["replicas", "epp"])
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--model", default=EmulatorConfig().model)
    p.add_argument("--kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--endpoints", default="")
    p.add_argument("--config", default="")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        asyncio.run(_main(args))
    except Exception as exc:  # noqa: BLE001 - report any start-up failure as one clear line
        print(f"simulator.stack.child {args.role}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
