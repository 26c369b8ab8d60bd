"""What the real-vLLM tests start besides the servers (``simulator.vllm.start_server``):
``epp serve`` as its own process, and reading a Prometheus page."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

import aiohttp

from simulator import vllm


async def start_epp(config: Path, log_path: Path) -> tuple[asyncio.subprocess.Process, int, int]:
    """``epp serve --config CONFIG`` on free ports; returns it, its gRPC and metrics ports."""
    grpc_port, metrics_port = vllm.free_port(), vllm.free_port()
    log = open(log_path, "ab")  # noqa: SIM115, ASYNC230 - handed to the child
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp.cli", "serve", "--host", "127.0.0.1", "--grpc-port",
            str(grpc_port), "--health-port", "-1", "--metrics-port", str(metrics_port),
            "--log-format", "text", "--config", str(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    finally:
        log.close()
    return proc, grpc_port, metrics_port


async def kill_all(procs: Iterable[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def metric(http: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples on the page at ``url`` whose labels contain ``labels``."""
    async with http.get(url) as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, value = line.rsplit(" ", 1)
        if key == name or (key.startswith(name + "{") and labels in key):
            total += float(value)
    return total
