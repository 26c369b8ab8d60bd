"""Fit a cost profile to a loaded run: ``epp-sim calibrate --from-log``.

``epp-sim calibrate URL`` measures a server one request or one batch at a time. Under real
traffic the same server is slower: its API server streams for every running request, the
engine's steps mix prefills with decodes, and on a shared machine the other servers, the
gateway and the client take CPU. Measured on the stack's real vLLM servers, a decode step
costs ~15 ms a running sequence under the demo's load against ~6.7 ms probed idle.

So the probed profile gives the shape (what a token, a cached token and a sequence cost
relative to each other) and a loaded run gives the scale: the replay of that run (its
prompts and output lengths in the closed loop its client ran, ``epp-sim trace convert --from
stack``), routed by the run's own policy, is repeated with the prefill costs times ``a`` and the decode costs times
``b`` until its TTFT p50, TTFT p90 and median time per output token match the run's (least
squares on their logarithms: a coarse grid of ``a`` and ``b`` in factors of 2 from 0.25 to
16, then the best and its neighbours 2^0.5, 2^0.25 and 2^0.125 apart in turn). A run routed independently of the servers' state (random,
round-robin) fits best: the replay routes it the same way whatever the costs.

With ``noises`` (``--fit-noise``) the fit also picks the steps' log-normal spread
(``CostModel.step_noise``) from those values, ``a`` and ``b`` fitted anew for each: a loaded
server's steps vary, which lowers the median TTFT and lengthens the tail that deterministic
steps give. With ``stalls`` (``--fit-stalls``) it picks the host's stalls
(``CostModel.host_stall_rate_hz``, ``host_stall_s``; none among them) the same way: on a
host whose servers share its cores with everything else, all of them stop now and then,
which lengthens the tail on every server at once (simulator/model/stalls.py).

With ``misses`` (``--fit-miss-cost``) the cost of an uncached prompt token may also grow
against the other prefill costs, by one of those factors, and each run's wall time (its
first request's start to its last answer's end) joins the loss. Probed alone, a CPU server
prefills a 2,048-token prompt in ~33 ms. Under the demo's load, random (a quarter of its
prompt tokens uncached, against a tenth for epp) runs 1-18% longer than epp live, but within
a few percent in a replay fitted without this: a miss costs more on a loaded host than the
probe says. A single prefill scale cannot show that without slowing
every hit too; the wall time is what tells the two apart, since a run of many misses takes
longer. The factor is searched at the best noise and stalls, each with its own ``a`` and
``b``.

The TTFT matched is the client's (``--measure client``: the request log's ``ttft_s``, through
the gateway both ways), or the servers' own (``--measure server``: their
``vllm:time_to_first_token_seconds`` histograms over each run, kept in the stack's
``demo.json``: from a request's arrival at a server to its first token, with nothing in front
of the server counted, not even a router behind the gateway, which Envoy's ``upstream_ttft_s``
counts). For the servers' the replay's TTFTs are binned in the same buckets and both sides
read as Prometheus' ``histogram_quantile`` reads them.

The fitted profile then predicts other runs: other policies, other rounds
(bench/bench_calibrated_replay.py checks it against the live stack).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from simulator.model.cost import CostModel

PREFILL_FIELDS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_cached_token_s")
DECODE_FIELDS = ("decode_base_s", "decode_per_seq_s")
COARSE = [2.0**k for k in range(-2, 5)]  # 0.25x .. 16x
REFINE = (2**0.5, 2**0.25, 2**0.125)
"""After the coarse grid, the best and its neighbours this factor apart, then closer."""
NOISE_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The step-noise values ``--fit-noise`` tries."""
STALL_GRID = tuple((rate, mean) for rate in (0.25, 0.5, 1.0, 2.0) for mean in (0.1, 0.2, 0.4, 0.8))
"""The host stalls ``--fit-stalls`` tries: (stalls a second, mean duration in seconds)."""
MISS_GRID = (1.5, 2.0, 3.0, 4.0)
"""The factors on an uncached token's prefill cost ``--fit-miss-cost`` tries besides 1."""


@dataclass(slots=True, frozen=True)
class RunFigures:
    """What a run's requests saw: TTFT p50 / p90, the median time per output token."""

    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    requests: int
    wall_s: float = math.nan
    """The run's first request's start to its last answer's end."""
    busiest_share: float = math.nan
    """The share of its requests the busiest server served (nan: not known)."""

    def errors(self, other: RunFigures, wall: bool = False) -> list[float]:
        """log(other / self) of the three figures (with ``wall``, of the wall time too)."""
        pairs = [(self.ttft_p50_s, other.ttft_p50_s), (self.ttft_p90_s, other.ttft_p90_s),
                 (self.tpot_p50_s, other.tpot_p50_s)]  # fmt: skip
        if wall:
            pairs.append((self.wall_s, other.wall_s))
        return [math.log(b / a) if a > 0 and b > 0 else math.inf for a, b in pairs]


def stack_rows(path: str | Path) -> list[dict[str, Any]]:
    """The stack's ``requests.jsonl`` (``epp-sim stack --demo --out-dir``; gzipped too)."""
    from simulator.replay.workload import open_text

    with open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stack_runs(rows: Iterable[dict[str, Any]]) -> list[tuple[str, int]]:
    """The (policy, round) runs a stack log holds, in order."""
    seen: dict[tuple[str, int], None] = {}
    for r in rows:
        seen.setdefault((str(r.get("policy", "")), int(r.get("round", 0))), None)
    return list(seen)


def live_figures(rows: Iterable[dict[str, Any]], policy: str, round_: int,
                 ttft_key: str = "ttft_s") -> RunFigures:  # fmt: skip
    """One run's figures from the stack's log (answered requests only). ``ttft_key``: the
    client's TTFT (``ttft_s``), or the server's as Envoy saw it (``upstream_ttft_s``, from
    its access log: without the response's way back through epp and Envoy to the client).
    The time per output token is the client's either way."""
    run = [r for r in rows if r.get("policy") == policy and int(r.get("round", 0)) == round_
           and r.get("status") == 200 and r.get(ttft_key) is not None]  # fmt: skip
    if not run:
        raise ValueError(f"no answered request of policy {policy!r} in round {round_} with {ttft_key}")
    ttft = [float(r[ttft_key]) for r in run]
    tpot = [(float(r["e2e_s"]) - float(r["ttft_s"])) / (int(r["completion_tokens"]) - 1)
            for r in run if int(r.get("completion_tokens") or 0) > 1 and r.get("ttft_s") is not None]  # fmt: skip
    p50, p90 = np.percentile(ttft, [50, 90])
    wall = max((float(r["start_s"]) + float(r["e2e_s"]) for r in run if r.get("e2e_s") is not None),
               default=math.nan) - min(float(r["start_s"]) for r in run)  # fmt: skip
    return RunFigures(float(p50), float(p90), statistics.median(tpot) if tpot else math.nan, len(run), wall)


def run_summaries(log: str | Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The per-run summaries of the stack run whose request log is ``log``: ``demo.json``
    beside it (``epp-sim stack --demo --out-dir``), by (policy, round)."""
    path = Path(log).with_name("demo.json")
    if not path.is_file():
        raise ValueError(f"{path}: not found; the servers' TTFT is read from the demo.json that "
                         "`epp-sim stack --demo --out-dir DIR` writes beside requests.jsonl")  # fmt: skip
    doc = json.loads(path.read_text(encoding="utf-8"))
    runs = doc.get("by_round") or doc.get("runs") or []
    return {(str(s["policy"]), int(s.get("round", 0))): s for s in runs}


def server_figures(summaries: dict[tuple[str, int], dict[str, Any]], rows: Iterable[dict[str, Any]],
                   policy: str, round_: int) -> tuple[RunFigures, list[tuple[float, float]]]:  # fmt: skip
    """One run's figures by the servers' own TTFT (``--measure server``, module docstring),
    and its histogram's cumulative buckets; the time per output token is the client's."""
    from simulator.stack.report import histogram_quantile, parse_buckets

    s = summaries.get((policy, round_))
    if s is None:
        raise ValueError(f"no summary of policy {policy!r} round {round_} in the run's demo.json")
    buckets = parse_buckets(s.get("server_ttft_buckets") or [])
    if not buckets or not buckets[-1][1]:
        raise ValueError(f"the run's demo.json has no server TTFT histogram for {policy!r} round {round_} "
                         "(real vLLM servers report one; a stack from before this field was written lacks it)")  # fmt: skip
    client = live_figures(rows, policy, round_)
    split = s.get("per_replica_requests") or []
    busiest = max(split) / sum(split) if sum(split) else math.nan
    return RunFigures(histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.9), client.tpot_p50_s,
                      int(buckets[-1][1]), client.wall_s, busiest), buckets  # fmt: skip


def replay_policy_for(label: str, configs: Sequence[Path] = ()) -> str:
    """The replay policy that routes as the stack's run ``label`` did: ``epp`` with the run's
    config (a shipped profile, or a file named ``<label>.yaml`` in ``configs``), the SGLang
    router as ``cache-aware``, the baselines by name."""
    from epp.config.loader import SHIPPED
    from simulator.replay.policies import POLICY_NAMES

    if label.startswith("SGLang router"):
        return "cache-aware" if "random" not in label else "random"
    base = label.removesuffix(" (via epp)").removesuffix(" precise")
    if base == "epp":
        return "epp"
    if base.startswith("epp "):
        name = base.removeprefix("epp ")
        if name in SHIPPED:
            return "epp" if name == "default" else f"epp:{name}"
        for folder in configs:
            if (folder / f"{name}.yaml").is_file():
                return f"epp:{folder / f'{name}.yaml'}"
        raise ValueError(f"run {label!r}: no shipped profile or config file named {name!r}")
    if base in POLICY_NAMES:
        return base
    raise ValueError(f"run {label!r}: no replay policy routes as it did")


def scaled(base: CostModel, prefill: float, decode: float) -> CostModel:
    """``base`` with its prefill costs times ``prefill`` and decode costs times ``decode``."""
    changes = {f: getattr(base, f) * prefill for f in PREFILL_FIELDS}
    changes |= {f: getattr(base, f) * decode for f in DECODE_FIELDS}
    return dataclasses.replace(base, **changes)


Replay = Callable[[CostModel], RunFigures]


@dataclass(slots=True, frozen=True)
class Fit:
    cost: CostModel
    prefill_scale: float
    decode_scale: float
    live: list[RunFigures]
    replayed: list[RunFigures]
    replays: int
    miss_scale: float = 1.0
    """The uncached token's own factor (``misses``), on top of ``prefill_scale``."""


def fit_scales(base: CostModel, targets: Sequence[tuple[RunFigures, Replay]],
               noises: Sequence[float] = (), stalls: Sequence[tuple[float, float]] = (),
               misses: Sequence[float] = ()) -> Fit:  # fmt: skip
    """The prefill and decode scales of ``base`` (with ``noises``, the step noise among them;
    with ``stalls``, the host's stalls among those (rate, mean duration) pairs and none;
    with ``misses``, an uncached token's own factor among those and 1, the runs' wall time
    then in the loss) whose replays best match the runs: each target is a run's live figures
    and how to replay it (``replay(cost)``); the loss sums over them. A coarse grid, then the
    best and its neighbours, closer and closer (module docstring), for each variant; the
    miss factor at the best variant."""
    if not targets:
        raise ValueError("no run to fit")
    variants = [{"step_noise": sigma, "host_stall_rate_hz": rate, "host_stall_s": mean}
                for sigma in (noises or (base.step_noise,))
                for rate, mean in ((base.host_stall_rate_hz, base.host_stall_s), *stalls)]  # fmt: skip
    wall = bool(misses)
    cache: dict[tuple[float, float, int, float], tuple[float, list[RunFigures]]] = {}

    def model(a: float, b: float, v: int, m: float) -> CostModel:
        shaped = dataclasses.replace(base, prefill_per_token_s=base.prefill_per_token_s * m)
        return dataclasses.replace(scaled(shaped, a, b), **variants[v])

    def loss(a: float, b: float, v: int, m: float) -> float:
        key = round(a, 9), round(b, 9), v, m
        if key not in cache:
            got = [replay(model(a, b, v, m)) for _, replay in targets]
            total = sum(e * e for (live, _), g in zip(targets, got, strict=True) for e in live.errors(g, wall))
            cache[key] = (total, got)
        return cache[key][0]

    def search(v: int, m: float) -> tuple[float, float, int, float]:
        a, b = min(((a, b) for a in COARSE for b in COARSE), key=lambda ab: loss(ab[0], ab[1], v, m))
        for step in REFINE:
            a, b = min(((a * step**i, b * step**j) for i in (-1, 0, 1) for j in (-1, 0, 1)),
                       key=lambda ab: loss(ab[0], ab[1], v, m))  # fmt: skip
        return a, b, v, m

    best = min((search(v, 1.0) for v in range(len(variants))), key=lambda p: loss(*p))
    if misses:
        best = min((best, *(search(best[2], m) for m in misses if m != 1.0)), key=lambda p: loss(*p))
    a, b, v, m = best
    got = cache[round(a, 9), round(b, 9), v, m][1]
    return Fit(model(a, b, v, m), a, b, [live for live, _ in targets], got, len(cache), m)


@dataclass(slots=True)
class StackRun:
    """One run of a stack log and how to replay it; the run is converted once, on the first
    replay (a fit replays it hundreds of times)."""

    log: Path
    label: str
    round_: int
    replicas: int
    kv_blocks: int
    block_size: int
    policy: str
    ttft_edges: tuple[float, ...] = ()
    """When set, the replay's TTFT p50 and p90 are read from its TTFTs binned in these
    histogram buckets (upper edges, the last +Inf), as the servers' are (``--measure
    server``, module docstring)."""
    replies_cached: bool = True
    """``ReplayConfig.replies_cached``: False for a run on real vLLM servers with the
    stack's tiny model, whose replies do not come back as the tokens generated."""
    _requests: Any = None
    _ids: list[str] | None = None

    def requests(self) -> Any:
        """The run as a request log (``convert --from stack``, closed loop)."""
        if self._requests is None:
            import tempfile

            from simulator.replay.convert import convert
            from simulator.replay.requestlog import RequestLog

            with tempfile.TemporaryDirectory(prefix="epp-fitlog-") as tmp:
                path = Path(tmp) / "run.jsonl"
                rows = list(convert("stack", self.log, self.label, self.round_))
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
                self._requests = RequestLog.load(path)
                self._ids = [str(r["id"]) for r in rows]
        return self._requests

    def run(self, cost: CostModel, seed: int = 0) -> Any:
        """The run replayed with ``cost`` (a ``ReplayResult``)."""
        from simulator.replay.policies import policy_factory
        from simulator.replay.replayer import ReplayConfig, Replayer

        cfg = ReplayConfig(replicas=self.replicas, kv_blocks=self.kv_blocks, block_size_tokens=self.block_size,
                           cost=cost, seed=seed, replies_cached=self.replies_cached)  # fmt: skip
        name, factory = policy_factory(self.policy)
        return Replayer(cfg).run(self.requests(), factory, name)

    def outcomes(self, cost: CostModel) -> dict[str, Any]:
        """The replayed requests served, by the stack log's request (``u<user>t<turn>``)."""
        result = self.run(cost)
        assert self._ids is not None
        # the request log's row i is the replay's request r<i>
        return {self._ids[int(o.request_id[1:])]: o for o in result.outcomes if not o.rejected}

    def replay(self, cost: CostModel, seed: int = 0) -> tuple[RunFigures, float]:
        """Its figures and hit rate, replayed with ``cost``."""
        from simulator.replay.report import summarize
        from simulator.stack.report import histogram_quantile

        result = self.run(cost, seed)
        s = summarize(result)
        served = [o for o in result.outcomes if not o.rejected]
        wall = max(o.finish_s for o in served) - min(o.arrival_s for o in served) if served else math.nan
        per = np.bincount([o.replica for o in served], minlength=self.replicas)
        busiest = float(per.max() / per.sum()) if served else math.nan
        if not self.ttft_edges:
            return RunFigures(s.ttft_p50_s, s.ttft_p90_s, s.tpot_p50_s, s.served, wall, busiest), s.hit_rate
        ttft = np.sort([o.first_token_s - o.arrival_s for o in served])
        counts = np.searchsorted(ttft, self.ttft_edges, side="right")  # cumulative: le is inclusive
        buckets = list(zip(self.ttft_edges, counts.tolist(), strict=True))
        return RunFigures(histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.9), s.tpot_p50_s,
                          s.served, wall, busiest), s.hit_rate  # fmt: skip

    def figures(self, cost: CostModel) -> RunFigures:
        """Its figures replayed with ``cost`` (what :func:`fit_scales` calls)."""
        return self.replay(cost)[0]


def pick_run(log: Path, label: str = "", round_: int = 0) -> tuple[str, int]:
    """The run ``label`` (or the log's only policy) in ``round_``; errors list the runs."""
    return pick_runs(log, label, [round_])[0]


def pick_runs(log: Path, label: str = "", rounds: Sequence[int] | None = None) -> list[tuple[str, int]]:
    """The runs of ``label`` (or the log's only policy) in ``rounds`` (all its rounds when
    None); errors list the runs."""
    runs = stack_runs(stack_rows(log))
    if not runs:
        raise ValueError(f"{log}: no requests")
    policies = sorted({p for p, _ in runs})
    if not label:
        if len(policies) > 1:
            raise ValueError(f"{log} holds the runs of several policies ({', '.join(policies)}): name one "
                             "(a run routed regardless of the servers' state fits best: random, round-robin)")  # fmt: skip
        label = policies[0]
    mine = sorted(r for p, r in runs if p == label)
    wanted = mine if rounds is None else list(rounds)
    missing = [r for r in wanted if r not in mine]
    if missing or not wanted:
        raise ValueError(f"{log}: no run of {label!r} in round {missing[0] if missing else '(any)'} "
                         f"(runs: {', '.join(f'{p} round {r}' for p, r in runs)})")  # fmt: skip
    return [(label, r) for r in wanted]


def replicas_of(log: Path, label: str, round_: int) -> int:
    """The servers a run's requests went to: the stack's count (demo.json beside the log),
    else the distinct upstreams the run's requests name (a router behind the gateway is
    then one upstream: give the stack's demo.json)."""
    path = Path(log).with_name("demo.json")
    if path.is_file():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            n = int(json.loads(path.read_text(encoding="utf-8"))["replicas"])
            if n > 0:
                return n
    return len({r.get("upstream") for r in stack_rows(log)
                if r.get("policy") == label and int(r.get("round", 0)) == round_ and r.get("upstream")}) or 1  # fmt: skip
