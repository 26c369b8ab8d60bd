"""Where a policy loses prefix hits on the chat generator's conversations, in the replay:
the later turns it sends to another replica than the turn before, what the replica it left
really held of the prompt then (the emulated server's cache, not epp's index), and how many
replicas each shared system prompt ends up on.

Per policy and seed: the prefix hit rate and TTFT p90; the later turns moved, and of those
the ones that left a replica holding more of the prompt than the one chosen (with the blocks
thereby prefilled again); the share of all prompt tokens prefilled at first turns, at moved
turns and at turns that stayed; the replicas a system prompt was sent to (mean over the
system prompts) and the requests per replica. For epp's policies, also how its prefix index
compared with the true caches at the picks: per (request, replica), index below the truth
by more than half a chunk's worth of blocks, above it, or level.

    ./run python bench/report_replay_moves.py --load 12 --kv-blocks 1024 \\
        --policies epp,epp:cache-aware,precise
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_profiles import Point, config_of, workload_of
from simulator.replay.policies import Cluster, policy_factory
from simulator.replay.replayer import Replayer
from simulator.replay.report import summarize

_DEBUG_LINE = re.compile(r"predicted-ttft request (\S+): (.*)")
_UNCACHED = re.compile(r"u=(\d+)")
_SYSTEM_CHARS = 64
"""A prompt's first characters name its shared system prompt."""


def _watch_truth(factory: Callable[[Cluster], Any], truth: dict[str, list[int]]) -> Callable[[Cluster], Any]:
    """Wrap a policy so that each pick first records the blocks of the prompt every replica's
    cache holds."""

    def make(cluster: Cluster) -> Any:
        policy = factory(cluster)
        pick = policy.pick

        def watched(arrival: Any, t: float) -> Any:
            truth[arrival.request.request_id] = [e.cache.contains_prefix(arrival.block_hashes)
                                                 for e in cluster.engines]  # fmt: skip
            return pick(arrival, t)

        policy.pick = watched
        return policy

    return make


def one(point: Point, spec: str, seed: int) -> dict[str, Any]:
    """The figures of one policy on one seed (``main`` prints them)."""
    requests = {r.request_id: r for r in workload_of(point, False, seed).requests()}
    name, factory = policy_factory(spec)
    truth: dict[str, list[int]] = {}
    cfg = config_of(point, seed)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    ttft_log = logging.getLogger("epp.plugins.ttft")
    level, propagate = ttft_log.level, ttft_log.propagate
    ttft_log.setLevel(logging.DEBUG)
    ttft_log.propagate = False
    ttft_log.addHandler(handler)
    try:
        result = Replayer(cfg).run(workload_of(point, False, seed), _watch_truth(factory, truth), name)
    finally:
        ttft_log.removeHandler(handler)
        ttft_log.setLevel(level)
        ttft_log.propagate = propagate
    outcomes = sorted(result.outcomes, key=lambda o: o.arrival_s)
    total = sum(o.prompt_tokens for o in outcomes) or 1
    last: dict[str, int] = {}
    miss = {"first": 0, "moved": 0, "stayed": 0}
    moved = held = lost = 0
    homes: dict[str, set[int]] = {}
    per_replica = [0] * cfg.replicas
    for o in outcomes:
        req = requests[o.request_id]
        per_replica[o.replica] += 1
        homes.setdefault(req.prompt[:_SYSTEM_CHARS], set()).add(o.replica)
        before = last.get(req.session_id)
        kind = "first" if before is None else "moved" if before != o.replica else "stayed"
        miss[kind] += o.prompt_tokens - o.cached_tokens
        if kind == "moved" and before is not None:
            moved += 1
            gap = truth[o.request_id][before] - truth[o.request_id][o.replica]
            if gap > 0:
                held += 1
                lost += gap
        last[req.session_id] = o.replica
    summary = summarize(result)
    row: dict[str, Any] = {
        "hit": summary.hit_rate, "p90": summary.ttft_p90_s,
        "later": len(outcomes) - len(last), "moved": moved, "held": held,
        "lost_blocks": lost, "miss": {k: v / total for k, v in miss.items()},
        "system_homes": statistics.mean(len(v) for v in homes.values()),
        "per_replica": per_replica,
    }
    row["index"] = _index_accuracy(log.getvalue(), truth, {o.request_id: o.prompt_tokens for o in outcomes},
                                   cfg.block_size_tokens)  # fmt: skip
    return row


def _index_accuracy(debug: str, truth: dict[str, list[int]], prompts: dict[str, int],
                    block: int) -> dict[str, int] | None:  # fmt: skip
    """From predicted-ttft's debug lines (uncached tokens per candidate), epp's index against
    the true caches; None for a policy that logs none."""
    out = {"below": 0, "above": 0, "level": 0}
    slack = 64 / 4 / block / 2  # half a 64-character chunk, in blocks
    for line in debug.splitlines():
        m = _DEBUG_LINE.match(line)
        if not m or m.group(1) not in truth:
            continue
        rid = m.group(1)
        for i, u in enumerate(_UNCACHED.findall(m.group(2))):
            index = (prompts[rid] - float(u)) / block
            real = truth[rid][i]
            out["below" if real > index + slack else "above" if index > real + slack else "level"] += 1
    return out if sum(out.values()) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=float, default=12.0, help="requests a second (default: 12)")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per replica (default: 1024)")
    ap.add_argument("--replicas", type=int, default=4, help="replicas (default: 4)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default: 3)")
    ap.add_argument("--system-prompts", type=int, default=0,
                    help="the sessions' shared system prompts (default: the generator's 8)")  # fmt: skip
    ap.add_argument("--policies", default="epp,epp:cache-aware",
                    help="comma-separated, as epp-sim replay --policies (default: epp,epp:cache-aware)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.seeds < 1 or a.replicas < 1 or a.kv_blocks < 1 or a.load <= 0 or a.system_prompts < 0:
        ap.error("--seeds, --replicas, --kv-blocks and --load must be positive, --system-prompts not negative")
    point = Point("chat", a.load, a.kv_blocks, a.replicas, system_prompts=a.system_prompts)
    print(f"chat at {a.load:g}/s, {a.kv_blocks} KV blocks, {a.replicas} replicas"
          + (f", {a.system_prompts} system prompts" if a.system_prompts else ""))
    for spec in a.policies.split(","):
        for seed in range(a.seeds):
            r = one(point, spec, seed)
            miss = r["miss"]
            line = (f"{spec} seed {seed}: hit {r['hit']:.1%}, TTFT p90 {r['p90']:.2f} s; later turns moved "
                    f"{r['moved']} of {r['later']}, {r['held']} off a replica holding more "
                    f"({r['lost_blocks']} blocks prefilled again); prompt tokens prefilled at first turns "
                    f"{miss['first']:.1%}, moved {miss['moved']:.1%}, stayed {miss['stayed']:.1%}; "
                    f"replicas a system prompt went to {r['system_homes']:.2f}; requests per replica "
                    f"{r['per_replica']}")  # fmt: skip
            if r["index"]:
                i = r["index"]
                line += f"; index vs cache: below {i['below']}, above {i['above']}, level {i['level']}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
