"""An epp server on port 0 with a static pool and metrics injected (no scraping)."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import yaml

from epp.config.loader import EppConfig, default_config, parse_config
from epp.framework.endpoint import Endpoint, Metrics, endpoint_id
from epp.server.runner import ServerHandle, ServerOptions, start_server


def pool(n: int, base_port: int = 8000) -> list[Endpoint]:
    return [Endpoint(endpoint_id(f"10.0.0.{i + 1}", base_port), f"10.0.0.{i + 1}", base_port) for i in range(n)]


def inject_metrics(handle: ServerHandle, waiting: int = 0, kv: float = 0.1, **kw: Any) -> None:
    now = time.monotonic()
    for e in handle.datastore.snapshot():
        handle.datastore.update_metrics(
            e.id, Metrics(waiting=waiting, running=1, kv_usage=kv, scraped_at_s=now, **kw)
        )


def config_with(extra: dict[str, Any]) -> EppConfig:
    base = dict(default_config().raw)
    base.update(extra)
    return parse_config(yaml.safe_load(yaml.safe_dump(base)), "<test>")


@dataclass
class Epp:
    handle: ServerHandle
    channel: grpc.aio.Channel


async def start_epp(
    endpoints: Sequence[Endpoint] | None = None,
    config: EppConfig | None = None,
    **options: Any,
) -> Epp:
    opts = ServerOptions(**{"host": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                            "metrics_port": -1, "scrape": False, **options})
    handle = await start_server(
        config, pool(4) if endpoints is None else endpoints, opts, rng=random.Random(7)
    )
    inject_metrics(handle)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.grpc_port}")
    return Epp(handle, channel)


async def stop_epp(epp: Epp) -> None:
    await epp.channel.close()
    await epp.handle.stop(0)


async def epp_fixture(**kw: Any) -> AsyncIterator[Epp]:
    epp = await start_epp(**kw)
    try:
        yield epp
    finally:
        await stop_epp(epp)
