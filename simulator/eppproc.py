"""``epp serve`` (or ``epp model-router``) in its own process, as users run it: the real-Envoy
tests and the benchmarks start epp with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from simulator.vllm import free_port, wait_healthy


@dataclass
class EppProcess:
    """``epp serve`` in its own process on fixed ports (so it can come back on them)."""

    endpoints: list[str]
    log_path: Path
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the process's environment (``OTEL_*``)."""
    proc: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def argv(self) -> list[str]:
        """The epp command and its own flags (the ports and ``extra`` are added to them)."""
        return ["serve", "--health-port", "-1", "--endpoints", ",".join(self.endpoints)]

    async def start(self) -> None:
        err = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 - handed to the child
        try:
            command, *flags = self.argv()
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epp.cli", command, "--host", "127.0.0.1",
                "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
                "--log-format", "text", *flags, *self.extra,
                stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err,
                env={**os.environ, **self.env},
            )  # fmt: skip
        finally:
            err.close()
        # its metrics page answers once its gRPC port is bound
        await wait_healthy(f"http://127.0.0.1:{self.metrics_port}/metrics", self.proc, self.log_path, 30, 0.05)

    async def routed(self) -> float:
        """Requests this epp answered (``epp_requests_total``, every status)."""
        return await self.metric("epp_requests_total")

    async def ready_endpoints(self) -> float:
        """Endpoints this epp has fresh metrics for (``epp_pool_ready_endpoints``)."""
        return await self.metric("epp_pool_ready_endpoints")

    async def metric(self, name: str, label: str = "") -> float:
        """The sum of ``name``'s samples on this epp's metrics page (those with ``label``,
        e.g. ``outcome="home"``, when given)."""
        return await page_metric(f"http://127.0.0.1:{self.metrics_port}/metrics", name, label)

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # a paused one (SIGSTOP) ends too
                self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@dataclass
class RouterProcess(EppProcess):
    """``epp model-router`` in its own process; ``endpoints`` holds its ``--pool`` values."""

    def argv(self) -> list[str]:
        return ["model-router", *(flag for p in self.endpoints for flag in ("--pool", p))]


async def page_metric(url: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples (those with ``label`` in their line, when given) on the
    Prometheus text page at ``url``; 0 when it has none."""
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)  # fmt: skip
