"""``epp-sim calibrate URL``: measure a running vLLM (or SGLang, or emulated) server and write
a cost profile the replay and the emulator read (``--cost FILE``; ``simulator.model.cost``).

What it measures, one request or batch at a time (the server should be otherwise idle):

* **prefill**: the time to the first streamed token of prompts of each ``--lengths`` (token
  ids, so the length is exact; fresh ids each time: nothing cached), then of the same prompt
  again (all but its last block cached). A least-squares fit of
  ``ttft = a + per_token * uncached + per_cached * cached``.
* **decode**: ``B`` requests at once for each ``--batches`` size, each generating
  ``--decode-tokens`` tokens (``ignore_eos``): a stream's time from its first token to its
  last over ``decode-tokens - 1`` is one decode step of a batch of ``B`` (the median over
  the streams; right whatever tokens a chunk carries, e.g. vLLM's ``--stream-interval``); a
  fit of ``step = decode_base + per_seq * B``.
* **the server**: its KV blocks, block size and ``max_num_seqs`` where ``/metrics`` says them.
* **a shared host** (several URLs: servers on one machine's cores): each server is probed
  alone, then all at once. The profile is the mean of the servers' costs alone, and
  ``shared_host_slowdown`` how much longer a reference job (a 1024-token prefill and 24
  decode steps of 4 sequences) took them together: the replay slows a replica's steps by that
  much while the others are busy.

The model's lone-request TTFT is ``prefill + decode_step(1)`` (simulator/model/engine.py), so
``prefill_base = a - decode_step(1)``. What the client sees beyond the server (HTTP, the
event loop) lands in ``prefill_base``. Each figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from simulator.clihelp import HelpFormatter
from simulator.model.cost import COST_FIELDS, CostModel, CostProfile, dump_profile

MAX_RESPONSE_BYTES = 16 << 20


@dataclass(slots=True)
class Sample:
    uncached: int
    cached: int
    ttft_s: float


def fit_linear(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares ``y = c0 + sum(c_i * x_i)`` (normal equations, small and dense)."""
    rows = [[1.0, *x] for x in xs]
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            raise ValueError("the measurements do not determine the fit (vary the lengths)")
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (b[r] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


class Client:
    def __init__(self, http: aiohttp.ClientSession, url: str, model: str) -> None:
        self.http, self.url, self.model = http, url.rstrip("/"), model

    async def stream(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Arrival times (perf_counter) of the streamed chunks carrying text, from the send."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        t0 = time.perf_counter()
        times: list[float] = []
        async with self.http.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {r.status}: {(await r.text())[:300]}")
            size = 0
            async for line in r.content:
                size += len(line)
                if size > MAX_RESPONSE_BYTES:
                    raise RuntimeError(f"{self.url}: response over {MAX_RESPONSE_BYTES} bytes")
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text") is not None:
                        times.append(time.perf_counter() - t0)
        if not times:
            raise RuntimeError(f"{self.url}: the stream carried no token")
        return times


async def server_info(http: aiohttp.ClientSession, url: str) -> tuple[str, dict[str, Any]]:
    """The served model and what ``/metrics`` says of the cache."""
    async with http.get(url.rstrip("/") + "/v1/models") as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/v1/models: HTTP {r.status}")
        models = (await r.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    server: dict[str, Any] = {}
    try:
        async with http.get(url.rstrip("/") + "/metrics") as r:
            page = await r.read() if r.status == 200 else b""
    except aiohttp.ClientError:
        page = b""
    if page:
        from epp.datastore.metricsparse import SGLANG, VLLM, PageParser, ScrapeError

        for names in (VLLM, SGLANG):
            try:
                m = PageParser(names).parse(page, 1.0)
            except ScrapeError:  # not this engine's page
                continue
            if m.num_gpu_blocks:
                server |= {"kv_blocks": m.num_gpu_blocks, "block_size": m.block_size_tokens}
                break
    return str(models[0]["id"]), server


async def calibrate(url: str, lengths: Sequence[int], batches: Sequence[int], repeats: int,
                    decode_tokens: int, progress: Any = print) -> CostProfile:  # fmt: skip
    rng = random.Random()  # fresh prompts on every run: the server may remember the last one's

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model, server = await server_info(http, url)
        client = Client(http, url, model)
        await client.stream(fresh(16), 2)  # warm-up (first-request costs)
        samples: list[Sample] = []
        block = int(server.get("block_size") or 16)
        for n in lengths:
            for _ in range(repeats):
                prompt = fresh(n)
                first = (await client.stream(prompt, 1))[0]
                again = (await client.stream(prompt, 1))[0]
                cached = (n - 1) // block * block  # vLLM keeps the last token out of the hit
                samples += [Sample(n, 0, first), Sample(n - cached, cached, again)]
            progress(f"  prefill {n:>6} tokens: {statistics.median(s.ttft_s for s in samples[-2 * repeats::2]) * 1e3:8.1f} ms"
                     f" uncached, {statistics.median(s.ttft_s for s in samples[-2 * repeats + 1::2]) * 1e3:8.1f} ms cached")  # fmt: skip
        steps: dict[int, float] = {}
        for b in batches:
            gaps: list[float] = []
            for _ in range(repeats):
                runs = await asyncio.gather(*(client.stream(fresh(32), decode_tokens) for _ in range(b)))
                for times in runs:
                    # from the first token to the last: decode_tokens - 1 steps, however the
                    # server groups tokens into chunks (vLLM's --stream-interval)
                    if len(times) >= 2:
                        gaps.append((times[-1] - times[0]) / (decode_tokens - 1))
            if not gaps:
                raise RuntimeError("no token gaps measured: raise --decode-tokens")
            steps[b] = statistics.median(gaps)
            progress(f"  decode batch {b:>3}: {steps[b] * 1e3:8.2f} ms a step")
    decode_base, per_seq = fit_linear([[b] for b in steps], list(steps.values()))
    decode_base, per_seq = max(decode_base, 0.0), max(per_seq, 0.0)
    a, per_token, per_cached = fit_linear([[s.uncached, s.cached] for s in samples], [s.ttft_s for s in samples])
    cost = CostModel(
        prefill_base_s=max(a - (decode_base + per_seq), 0.0), prefill_per_token_s=max(per_token, 0.0),
        prefill_per_cached_token_s=max(per_cached, 0.0), decode_base_s=decode_base, decode_per_seq_s=per_seq,
    )  # fmt: skip
    source = (f"epp-sim calibrate {url} on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
              f"model {model}, prefill at {', '.join(map(str, lengths))} tokens, decode batches "
              f"{', '.join(map(str, batches))}, {repeats} repeats")  # fmt: skip
    return CostProfile(model, cost, source, server)


def reference_s(cost: CostModel) -> float:
    """The reference job a shared host's slowdown is read on: a 1024-token prefill and 24
    decode steps of 4 sequences."""
    return cost.prefill_s(1024) + 24 * cost.decode_step_s(4)


async def calibrate_host(urls: Sequence[str], lengths: Sequence[int], batches: Sequence[int], repeats: int,
                         decode_tokens: int, progress: Any = print) -> tuple[CostProfile, list[float]]:  # fmt: skip
    """Servers sharing one host, probed one after the other, then together (module
    docstring). Returns the profile and each server's together / alone ratio."""

    def probe(url: str) -> Any:
        return calibrate(url, lengths, batches, repeats, decode_tokens,
                         progress=lambda m: progress(f"  {url}: {m.strip()}"))  # fmt: skip

    progress(f"probing {len(urls)} servers one after the other...")
    alone = [await probe(u) for u in urls]
    progress(f"probing {len(urls)} servers together...")
    together = await asyncio.gather(*(probe(u) for u in urls))
    ratios = [reference_s(t.cost) / reference_s(a.cost) for a, t in zip(alone, together, strict=True)]
    mean = {f: statistics.fmean(getattr(p.cost, f) for p in alone) for f in COST_FIELDS}
    mean["shared_host_slowdown"] = max(0.0, statistics.fmean(ratios) - 1.0)
    source = (f"epp-sim calibrate {' '.join(urls)} (a shared host: alone, then together; "
              f"together / alone {', '.join(f'{r:.2f}x' for r in ratios)}) on "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")  # fmt: skip
    return CostProfile(alone[0].name, CostModel(**mean), source, alone[-1].server), ratios


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure a running server and write a cost profile for the replay",
        description=__doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1:3]),
        formatter_class=HelpFormatter,
    )  # fmt: skip
    p.add_argument("url", nargs="*", default=[],
                   help="the server's base URL to probe, e.g. http://127.0.0.1:8000 (or --from-log below); "
                   "several: servers sharing one host, probed alone then together (shared_host_slowdown)")
    p.add_argument("--out", required=True, help="the profile file to write (YAML)")
    fit = p.add_argument_group(
        "fit to a loaded run (instead of URL)",
        "Scale a probed profile's prefill and decode costs until the replay of a run of the stack "
        "(its requests.jsonl, epp-sim stack --demo --out-dir) matches the run's TTFT p50, p90 and "
        "time per output token: a server under load is slower than one probed idle "
        "(simulator/fitlog.py).",
    )
    fit.add_argument("--from-log", type=Path, metavar="REQUESTS_JSONL", help="the stack's request log")
    fit.add_argument("--profile", help="the profile to scale (a file from epp-sim calibrate URL, or a preset)")
    fit.add_argument("--run", dest="runs", action="append", default=[], metavar="POLICY",
                     help="the runs to fit, by their policy column (the log's only one by default); "
                     "repeat it to fit several policies' runs at once, the loss summed over them. "
                     "Random or round-robin pin what a cache miss costs; a cache-friendly policy's "
                     "runs pin the tail of hits (the host's stalls)")
    fit.add_argument("--round", default="0",
                     help="the run's round (--rounds); 'all': fit its rounds together")
    fit.add_argument("--replay-policy", default="",
                     help="the replay policy that routes as the run did (guessed from its name; "
                     "one --run only)")
    fit.add_argument("--measure", choices=("client", "server"), default="client",
                     help="the TTFT to match: the client's (through the gateway both ways), or the "
                     "servers' own, from their TTFT histograms in the run's demo.json (from arrival at "
                     "the server to its first token; the replay's TTFTs binned alike)")
    fit.add_argument("--kv-blocks", type=int, default=0, help="KV blocks a server (the profile's by default)")
    fit.add_argument("--block-size", type=int, default=0, help="tokens a block (the profile's by default)")
    fit.add_argument("--fit-noise", action="store_true",
                     help="also fit the steps' log-normal noise (step_noise: 0, 0.25, 0.5, 0.75 or 1)")
    fit.add_argument("--fit-stalls", action="store_true",
                     help="also fit host-wide stalls (host_stall_rate_hz 0.25-2 a second x host_stall_s "
                     "0.1-0.8 s, or none): servers sharing a few cores with everything else all stop "
                     "now and then (simulator/model/stalls.py)")
    fit.add_argument("--replies-not-cached", action="store_true",
                     help="a reply's blocks do not serve the conversation's next turn: the servers' model "
                     "answers in tokens that do not come back as the same tokens (the stack's tiny model, "
                     "random weights; on its real vLLM servers the next turn hits only the prompt's blocks)")
    fit.add_argument("--fit-miss-cost", action="store_true",
                     help="also fit an uncached prompt token's own cost against the other prefill costs "
                     "(x1.5, 2, 3 or 4, or as probed), the runs' wall time then in the loss: on a loaded "
                     "host a cache miss costs more than one probed alone")
    p.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths to prefill (tokens)")
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (their median counts)")
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens each decode request generates")
    p.set_defaults(run=run)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} expects integers >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    if args.from_log:
        return run_fit(args)
    if not args.url:
        print("epp-sim calibrate: give a server's URL, or --from-log with --profile", file=sys.stderr)
        return 2
    try:
        lengths, batches = _ints(args.lengths, "--lengths"), _ints(args.batches, "--batches")
        if len(set(lengths)) < 2 or len(set(batches)) < 2:
            raise ValueError("--lengths and --batches need two different values at least (a fit)")
        if args.repeats < 1 or args.decode_tokens < 8:
            raise ValueError("--repeats must be >= 1 and --decode-tokens >= 8")
        if len(args.url) > 1:
            profile, _ = asyncio.run(calibrate_host(args.url, lengths, batches, args.repeats, args.decode_tokens))
        else:
            print(f"calibrating {args.url[0]}...")
            profile = asyncio.run(calibrate(args.url[0], lengths, batches, args.repeats, args.decode_tokens))
    except (ValueError, RuntimeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"epp-sim calibrate: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dump_profile(profile))
    c = profile.cost
    print(f"wrote {args.out}: prefill {c.prefill_base_s * 1e3:.1f} ms + {c.prefill_per_token_s * 1e6:.1f} us/token "
          f"(+ {c.prefill_per_cached_token_s * 1e6:.2f} us/cached token), decode {c.decode_base_s * 1e3:.2f} ms "
          f"+ {c.decode_per_seq_s * 1e3:.3f} ms/sequence a step, shared host x{1 + c.shared_host_slowdown:.2f}; "
          f"server {profile.server or 'unreported'}")  # fmt: skip
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from simulator.fitlog import (
        MISS_GRID,
        NOISE_GRID,
        STALL_GRID,
        StackRun,
        fit_scales,
        live_figures,
        pick_runs,
        replay_policy_for,
        replicas_of,
        run_summaries,
        server_figures,
        stack_rows,
    )
    from simulator.model.cost import load_profile

    try:
        if args.url:
            raise ValueError("give a URL or --from-log, not both")
        if not args.profile:
            raise ValueError("--from-log needs --profile: the probed shape to scale (epp-sim calibrate URL --out FILE)")
        base = load_profile(args.profile)
        rounds = None if args.round == "all" else [_round(args.round)]
        labels = list(dict.fromkeys(args.runs)) or [""]
        if args.replay_policy and len(labels) > 1:
            raise ValueError("--replay-policy names how one run routed: give it with one --run")
        runs = [run for label in labels for run in pick_runs(args.from_log, label, rounds)]
        kv = args.kv_blocks or int(base.server.get("kv_blocks") or 0)
        block = args.block_size or int(base.server.get("block_size") or 0)
        if kv <= 0 or block <= 0:
            raise ValueError("the profile does not say the servers' KV blocks and block size: give --kv-blocks and --block-size")
        policies = {label: args.replay_policy or replay_policy_for(label) for label, _ in runs}
        rows = stack_rows(args.from_log)
        summaries = run_summaries(args.from_log) if args.measure == "server" else {}
        targets = []
        for label, round_ in runs:
            replicas = replicas_of(args.from_log, label, round_)
            if args.measure == "server":
                live, buckets = server_figures(summaries, rows, label, round_)
                edges = tuple(le for le, _ in buckets)
            else:
                live, edges = live_figures(rows, label, round_), ()
            run_ = StackRun(args.from_log, label, round_, replicas, kv, block, policies[label], edges,
                            replies_cached=not args.replies_not_cached)  # fmt: skip
            targets.append((live, run_.figures))
        replayed_as = ", ".join(dict.fromkeys(policies.values()))
        print(f"fitting {args.profile} to {_describe(runs)} of {args.from_log} by the {args.measure}'s TTFT, "
              f"replayed as {replayed_as}...")
        fit = fit_scales(base.cost, targets, NOISE_GRID if args.fit_noise else (),
                         STALL_GRID if args.fit_stalls else (), MISS_GRID if args.fit_miss_cost else ())  # fmt: skip
    except (ValueError, OSError, KeyError) as exc:
        print(f"epp-sim calibrate: {exc}", file=sys.stderr)
        return 2
    source = (f"{base.source or base.name}; scaled to {_describe(runs)} of {args.from_log} ({args.measure} TTFT): "
              f"prefill x{fit.prefill_scale:.3f}{_miss(fit.miss_scale)}, decode x{fit.decode_scale:.3f}, "
              f"step noise {fit.cost.step_noise:g}{_stalls(fit.cost)}")  # fmt: skip
    profile = CostProfile(base.name, fit.cost, source, dict(base.server) | {"kv_blocks": kv, "block_size": block})
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dump_profile(profile))
    print(f"prefill x{fit.prefill_scale:.2f}{_miss(fit.miss_scale)}, decode x{fit.decode_scale:.2f}, step noise "
          f"{fit.cost.step_noise:g}{_stalls(fit.cost)} ({fit.replays} replays)")  # fmt: skip
    several = len(labels) > 1
    for (label, round_), lv, rp in zip(runs, fit.live, fit.replayed, strict=True):
        print(f"  {label + ', ' if several else ''}round {round_}: TTFT p50 {lv.ttft_p50_s * 1e3:.0f} ms live / "
              f"{rp.ttft_p50_s * 1e3:.0f} ms replayed, p90 {lv.ttft_p90_s * 1e3:.0f} / {rp.ttft_p90_s * 1e3:.0f} ms, an output token "
              f"{lv.tpot_p50_s * 1e3:.1f} / {rp.tpot_p50_s * 1e3:.1f} ms, the run {lv.wall_s:.1f} / {rp.wall_s:.1f} s")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


def _describe(runs: list[tuple[str, int]]) -> str:
    """The runs a fit was made to: "the run 'random' (round 0, 1)", or "the runs 'random'
    (round 0, 1) and 'SGLang router' (round 0, 1)"."""
    rounds: dict[str, list[str]] = {}
    for label, round_ in runs:
        rounds.setdefault(label, []).append(str(round_))
    parts = [f"{label!r} (round {', '.join(rs)})" for label, rs in rounds.items()]
    return ("the run " if len(parts) == 1 else "the runs ") + " and ".join(parts)


def _stalls(cost: CostModel) -> str:
    """The profile's host stalls, for a line of output ("" when it has none)."""
    if cost.host_stall_rate_hz <= 0 or cost.host_stall_s <= 0:
        return ""
    return f", host stalls {cost.host_stall_rate_hz:g}/s of {cost.host_stall_s * 1e3:.0f} ms"


def _miss(factor: float) -> str:
    """An uncached token's own factor, for a line of output ("" when it is 1)."""
    return "" if factor == 1.0 else f" (an uncached token x{factor:g} more)"


def _round(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"--round expects a round number (0, 1...) or 'all', got {text!r}")
    return int(text)

