"""``epp-sim stack`` as a user runs it: child processes, one JSON line, clean shutdown; the demo
replaying an inference-perf recipe."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("epp_replicas", [1, 2], ids=["one-epp", "two-epps"])
async def test_stack_prints_one_json_line_serves_and_stops_everything_on_sigterm(
    tmp_path: Path, epp_replicas: int
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "simulator.cli",
        "stack",
        "--replicas",
        "2",
        "--speedup",
        "20",
        "--epp-replicas",
        str(epp_replicas),
        "--log-dir",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        info = json.loads(line)
        if epp_replicas == 1:  # the line scripts already read, unchanged
            assert set(info) == {"gateway_url", "epp_grpc", "replica_urls"}
        else:
            assert set(info) == {"gateway_url", "epp_grpc", "replica_urls", "epp_grpcs"}
            assert len(set(info["epp_grpcs"])) == 2 and info["epp_grpc"] == info["epp_grpcs"][0]
        assert len(info["replica_urls"]) == 2
        async with aiohttp.ClientSession() as http:
            body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi", "max_tokens": 3}
            async with http.post(info["gateway_url"] + "/v1/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["x-upstream-host"] in [
                    u.removeprefix("http://") for u in info["replica_urls"]
                ]
        children = [int(p) for p in (await _children(proc.pid))]
        # replicas (one process), epp (every epp replica) and Envoy
        assert len(children) == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0
    assert not [pid for pid in children if _alive(pid)]
    summary = (await proc.stderr.read()).decode()
    assert "gateway" in summary and "Ctrl-C" in summary


async def _children(pid: int) -> list[str]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return path.read_text().split() if path.exists() else []


RECIPE = """\
load:
  type: constant
  stages:
  - rate: 40
    duration: 1
api:
  type: chat
server:
  type: vllm
  model_name: meta-llama/Llama-3.1-8B-Instruct
  base_url: http://0.0.0.0:8000
data:
  type: shared_prefix
  shared_prefix:
    num_groups: 4
    num_prompts_per_group: 2
    system_prompt_len: 600
    question_len: 20
    output_len: 4
    enable_multi_turn_chat: true
"""


async def _demo(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    """The demo on the recipe above with two fast emulated replicas: its output, its out-dir."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator.cli", "stack", "--demo", "--workload", str(recipe),
        "--replicas", "2", "--speedup", "20", "--kv-blocks", "96", "--out-dir", str(out), *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=_env(), cwd=ROOT,
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = stdout.decode()
    assert proc.returncode == 0, text
    return text, out


async def test_demo_replays_an_inference_perf_recipe_and_writes_table_and_plot(
    tmp_path: Path,
) -> None:
    text, out = await _demo(tmp_path)
    assert "4 system prompts x 2 users, 5 turns" in text  # 40 requests over 8 users
    for row in (
        "prefix cache hit rate",
        "TTFT p50",
        "TTFT p90",
        "throughput",
        "requests per replica",
    ):
        assert row in text
    assert (out / "demo.png").stat().st_size > 10_000
    doc = json.loads((out / "demo.json").read_text())
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == {"epp", "random"}
    assert runs["epp"]["requests"] == runs["random"]["requests"] == 40
    assert runs["epp"]["errors"] == 0 and runs["random"]["errors"] == 0
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted({r["policy"] for r in lines}) == ["epp", "random"]
    assert len(lines) == 80
    epp = [r for r in lines if r["policy"] == "epp"]
    assert {(r["user"], r["turn"]) for r in epp} == {(u, t) for u in range(8) for t in range(5)}
    assert all(r["status"] == 200 and r["upstream"] and r["ttft_s"] > 0 for r in epp)


async def test_demo_rounds_share_the_servers_and_empty_their_caches_between_runs(
    tmp_path: Path,
) -> None:
    text, out = await _demo(
        tmp_path, "--rounds", "2", "--fair", "--config", "default,predicted-ttft"
    )
    assert "each round" in text and "all 2 rounds" in text
    doc = json.loads((out / "demo.json").read_text())
    assert doc["rounds"] == 2
    # each run's counters are its own (the difference over the run), not the servers' totals
    # one epp run per config; each round starts one policy later
    a, b, c = "epp default", "epp predicted-ttft", "random (via epp)"
    assert [(r["round"], r["policy"]) for r in doc["by_round"]] == [
        (0, a), (0, b), (0, c), (1, b), (1, c), (1, a),
    ]
    for run in doc["by_round"]:
        assert run["requests"] == 40 and run["errors"] == 0
        assert sum(run["per_replica_requests"]) == 40
    assert {r["policy"]: sum(r["per_replica_requests"]) for r in doc["runs"]} == {
        a: 80, b: 80, c: 80,
    }
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 240
    for key in {(r["round"], r["policy"]) for r in lines}:
        run = sorted((r for r in lines if (r["round"], r["policy"]) == key),
                     key=lambda r: r["start_s"])  # fmt: skip
        # the same prompts as the previous run: only an emptied cache misses on them
        assert run[0]["cached_tokens"] == 0, key
