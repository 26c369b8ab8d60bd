"""The local stack notices one of its processes exiting on its own (``Stack.first_exit``)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

from simulator.stack.stack import Stack, _Child


async def _child(name: str, code: str, log: Path) -> _Child:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    return _Child(name, proc, log)


async def test_first_exit_names_the_process_its_code_and_its_log(tmp_path: Path) -> None:
    log = tmp_path / "epp.log"
    log.write_text("starting\nboom: the index is gone\n")
    alive = await _child("vllm-0", "import time; time.sleep(30)", tmp_path / "vllm.log")
    dying = await _child("epp", "import sys, time; time.sleep(0.2); sys.exit(3)", log)
    stack = Stack(SimpleNamespace(), SimpleNamespace(), [], [], tmp_path, [alive, dying])  # type: ignore[arg-type]
    try:
        said = await asyncio.wait_for(stack.first_exit(), 20)
    finally:
        await alive.stop()
    assert said == f"epp exited with code 3: starting | boom: the index is gone (log: {log})"


async def test_a_killed_process_is_named_by_its_signal(tmp_path: Path) -> None:
    ch = await _child("sidecar-0", "import time; time.sleep(30)", tmp_path / "none.log")
    stack = Stack(SimpleNamespace(), SimpleNamespace(), [], [], tmp_path, [ch])  # type: ignore[arg-type]
    watch = asyncio.ensure_future(stack.first_exit())
    await asyncio.sleep(0.1)
    assert not watch.done()
    ch.signal(9)
    said = await asyncio.wait_for(watch, 20)
    assert said.startswith("sidecar-0 was killed by signal 9")
