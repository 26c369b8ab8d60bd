"""CPU time of the local stack's processes, by role, from ``/proc`` (Linux; empty elsewhere).

Roles, from the process tree under one root (the process running the stack):
``vllm`` (every real vLLM server with its engine core and workers), ``epp`` (epp children),
``router`` (the SGLang router), ``envoy`` (real Envoy, the stack's gateway), ``emulator`` (emulated replicas in a child), and
``gateway+client`` (the root itself: the workload driver, the development gateway with
``--gateway python``, and epp when it runs inline). ``bench/bench_cpu_vllm.py`` and the
demo's per-run CPU row read it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int) -> float:
    """utime + stime of one process (threads included), seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_ns(pid: int) -> int:
    """CPU time of one process's live threads, nanoseconds, from the scheduler's own count
    (``/proc/PID/task/*/schedstat``): ``cpu_s`` counts in clock ticks (10 ms here), too
    coarse for a few requests; threads that ended are not counted. 0 once it is gone."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for t in tasks:
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total


def processes() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgid, command line) of every process."""
    out: list[tuple[int, int, int, str]] = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return out
    for d in entries:
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        out.append((int(d.name), int(stat[1]), int(stat[2]), cmd))
    return out


def role_of(cmd: str) -> str:
    """The role of a direct child of the stack's process, from its command line."""
    if "vllm.entrypoints" in cmd:
        return "vllm"
    if "envoy" in cmd.split(" ", 1)[0].rsplit("/", 1)[-1]:
        return "envoy"
    if "sglang_router" in cmd or cmd.startswith("sglang::router"):
        return "router"
    if "simulator.stack.child" in cmd and " epp" in cmd:
        return "epp"
    if "simulator.stack.child" in cmd and " replicas" in cmd:
        return "emulator"
    return "other"


def roles(root: int | None = None) -> dict[str, list[int]]:
    """The processes under ``root`` (default: this one) by role; each child's descendants
    count with it."""
    root = os.getpid() if root is None else root
    procs = processes()
    kids: dict[int, list[int]] = defaultdict(list)
    cmds = {}
    for pid, ppid, _, cmd in procs:
        kids[ppid].append(pid)
        cmds[pid] = cmd
    out: dict[str, list[int]] = {"gateway+client": [root]}
    for child in kids.get(root, []):
        role = role_of(cmds.get(child, ""))
        todo = [child]
        while todo:
            pid = todo.pop()
            out.setdefault(role, []).append(pid)
            todo += kids.get(pid, [])
    return out


def sample(by_role: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each role's processes."""
    return {role: sum(cpu_s(p) for p in pids) for role, pids in by_role.items()}


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each role used between two samples."""
    return {role: max(0.0, after[role] - before.get(role, 0.0)) for role in after}
