"""What index sync between epp replicas buys: routing quality with R replicas, sync off / on.

In process, on simulated time: R epp ``Scheduler``s with the same (default) config share one
simulated pool of model servers. Requests arrive as a Poisson stream, each to a random epp
replica (as Envoy spreads them), with a shared-prefix workload: each prompt is one of
``--groups`` system prompts followed by a unique question. A model server holds a request's
prompt for ``--service-s`` (its queue length is what every replica's queue scorer sees), and
truly caches every chunk it has processed (``truth``: a per-server set of chain hashes).

With sync on, each replica's own writes go through the real ``Outbox`` (flushed every
``--flush-ms``) and reach the other replicas' ``RemoteApplier`` ``--delay-ms`` later (the
network and the peer's event loop); with sync off each replica learns only from the requests
it routed itself.

Printed per (R, sync): the share of requests that landed on a server already holding their
whole shared prefix, among requests whose prefix some server held (``prefix hit``), the
share of all prompt chunks that were truly cached where the request went (``cached
chunks``: the prefill the pool saved), and the busiest server's share of requests over
the mean (``load max/mean``). Then a sync-delay sweep at the largest R. No pass/fail.

Run: ./run python bench/bench_sync.py [--requests 4000] [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass, field

from epp.config.loader import default_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import ResponseInfo
from epp.plugins.approxprefix import PrefixProducer
from epp.scheduling.scheduler import Scheduler
from epp.sync.apply import RemoteApplier
from epp.sync.outbox import Outbox
from epp.wiring import build_scheduler


@dataclass(slots=True, frozen=True)
class Workload:
    kind: str
    """``shared-prefix``: a system prompt from ``groups`` + a unique question. ``chat``:
    ``groups`` conversations; each request is the next turn of one of them (its prompt is
    the previous turn's prompt + the reply + a new question), restarted after 8 turns.
    Replies are fed back (``on_response``), as epp learns them in production."""
    requests: int
    endpoints: int
    groups: int
    system_chars: int
    question_chars: int
    rate_per_s: float
    service_s: float
    seed: int


@dataclass(slots=True, frozen=True)
class SyncSetting:
    on: bool
    flush_s: float = 0.02
    delay_s: float = 0.05

    def label(self) -> str:
        if not self.on:
            return "off"
        return f"on, {self.delay_s * 1000:.0f} ms"


@dataclass(slots=True, frozen=True)
class Outcome:
    prefix_hit: float
    cached_chunks: float
    load_max_over_mean: float
    applied: int


@dataclass(slots=True, frozen=True)
class _Wire:
    """A record as it would cross the network (the shape ``RemoteApplier`` reads)."""

    endpoint_id: str
    hashes: list[int]
    age_s: float


@dataclass(slots=True)
class _Replica:
    scheduler: Scheduler
    outbox: Outbox
    applier: RemoteApplier
    cursors: dict[int, int] = field(default_factory=dict)
    """Per peer (by index), how far that peer has read this replica's outbox."""


def approx(s: Scheduler) -> PrefixProducer:
    producer = s.plugin(PrefixProducer)
    assert producer is not None
    return producer


def text(rng: random.Random, chars: int) -> str:
    words = [rng.choice("abcdefghijklmnopqrstuvwxyz") * rng.randint(1, 9) for _ in range(chars // 4)]
    return " ".join(words)[:chars]


def run(w: Workload, replicas_n: int, sync: SyncSetting) -> Outcome:
    rng = random.Random(w.seed)
    systems = [text(rng, w.system_chars) for _ in range(w.groups)]
    history = [s + str(g) for g, s in enumerate(systems)]  # chat: each conversation so far
    turns = [0] * w.groups
    ids = [EndpointId(f"10.0.0.{i + 1}:8000") for i in range(w.endpoints)]
    now = 0.0

    def clock() -> float:
        return now

    replicas: list[_Replica] = []
    for r in range(replicas_n):
        sched = build_scheduler(default_config(), random.Random(w.seed * 100 + r))
        outbox = Outbox(capacity_records=8192, batch_records=256)
        if sync.on:
            approx(sched).subscribe(outbox.append)
        applier = RemoteApplier(approx(sched).apply_remote, lambda eid: True, clock)
        replicas.append(_Replica(sched, outbox, applier))
    for i, rep in enumerate(replicas):
        rep.cursors = {j: rep.outbox.head for j in range(replicas_n) if j != i}

    truth: dict[EndpointId, set[int]] = {e: set() for e in ids}
    busy_until: dict[EndpointId, list[float]] = {e: [] for e in ids}
    routed: dict[EndpointId, int] = dict.fromkeys(ids, 0)
    deliveries: list[tuple[float, int, int, list[_Wire]]] = []  # (at, seq, dst, records)
    seq = 0
    next_flush = sync.flush_s
    hits = could_hit = cached = total_chunks = applied = 0

    def flush(at: float) -> None:
        nonlocal seq
        for src in replicas:
            for dst, cursor in src.cursors.items():
                read = src.outbox.read(cursor, 1 << 30)
                src.cursors[dst] = read.next_cursor
                if read.writes:
                    wires = [_Wire(x.endpoint_id, list(x.hashes), at - x.stamp_s) for x in read.writes]
                    seq += 1
                    heapq.heappush(deliveries, (at + sync.delay_s, seq, dst, wires))

    for i in range(w.requests):
        now += rng.expovariate(w.rate_per_s)
        if sync.on:
            while next_flush <= now:
                flush(next_flush)
                next_flush += sync.flush_s
            while deliveries and deliveries[0][0] <= now:
                at, _, dst, wires = heapq.heappop(deliveries)
                # the peer applied it on arrival (``at``); this loop only gets there at ``now``
                wires = [_Wire(x.endpoint_id, x.hashes, x.age_s + (now - at)) for x in wires]
                applied += replicas[dst].applier.apply(wires).applied

        pool = []
        for e in ids:
            active = busy_until[e]
            while active and active[0] <= now:
                heapq.heappop(active)
            pool.append(Endpoint(e, e.split(":")[0], 8000, metrics=Metrics(
                waiting=len(active), running=len(active), kv_usage=0.3, scraped_at_s=now)))

        group = rng.randrange(w.groups)
        question = " Q" + str(i) + " " + text(rng, w.question_chars)
        if w.kind == "chat":
            previous = history[group]
            prompt = previous + question
            shared = len(previous) // 64 if turns[group] else 0  # the previous turn + reply
        else:
            prompt = systems[group] + question
            shared = w.system_chars // 64
        replica = replicas[rng.randrange(replicas_n)]
        result = replica.scheduler.schedule(InferenceRequest(str(i), "m", prompt), pool, now)
        target = result.target.id
        hashes = result.state.prefix.hashes
        held = truth[target]
        if shared and any(hashes[shared - 1] in t for t in truth.values()):
            could_hit += 1
            hits += hashes[shared - 1] in held
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        cached += n
        total_chunks += len(hashes)
        held.update(hashes)
        if w.kind == "chat":
            # the server caches its reply too, and epp learns it from the response
            reply = " A: " + text(rng, w.question_chars)
            replica.scheduler.on_response(result, ResponseInfo(generated_text=reply))
            start = len(hashes) * 64
            held.update(approx(replica.scheduler).hasher.extend(prompt + reply, hashes[-1], start))
            turns[group] += 1
            if turns[group] == 8:
                turns[group] = 0
                history[group] = text(rng, w.system_chars) + str(i)
            else:
                history[group] = prompt + reply
        heapq.heappush(busy_until[target], now + w.service_s)
        routed[target] += 1

    mean = w.requests / w.endpoints
    return Outcome(
        prefix_hit=hits / could_hit if could_hit else 0.0,
        cached_chunks=cached / total_chunks if total_chunks else 0.0,
        load_max_over_mean=max(routed.values()) / mean,
        applied=applied,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["shared-prefix", "chat", "both"], default="both")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--endpoints", type=int, default=8)
    ap.add_argument("--groups", type=int, default=48,
                    help="distinct system prompts (shared-prefix) or conversations (chat)")
    ap.add_argument("--system-chars", type=int, default=4096)
    ap.add_argument("--question-chars", type=int, default=512)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per simulated second")
    ap.add_argument("--service-s", type=float, default=0.5, help="simulated time a server holds a request")
    ap.add_argument("--flush-ms", type=float, default=20.0)
    ap.add_argument("--delay-ms", type=float, default=50.0, help="network + peer delay of a batch")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="1000 requests")
    args = ap.parse_args()
    kinds = ["shared-prefix", "chat"] if args.workload == "both" else [args.workload]
    for kind in kinds:
        w = Workload(
            kind=kind,
            requests=1000 if args.quick else args.requests,
            endpoints=args.endpoints,
            groups=args.groups,
            system_chars=args.system_chars - args.system_chars % 64,
            question_chars=args.question_chars,
            rate_per_s=args.rate,
            service_s=args.service_s,
            seed=args.seed,
        )
        report(w, [int(r) for r in args.replicas.split(",")], args.flush_ms, args.delay_ms)


def report(w: Workload, rs: list[int], flush_ms: float, delay_ms: float) -> None:
    on = SyncSetting(True, flush_ms / 1000, delay_ms / 1000)
    what = (f"{w.groups} system prompts of {w.system_chars} chars + {w.question_chars}-char "
            "questions" if w.kind == "shared-prefix" else
            f"{w.groups} conversations (up to 8 turns, {w.question_chars}-char turns)")
    print(f"== {w.kind}: {w.requests} requests at {w.rate_per_s:g}/s over {w.endpoints} servers, "
          f"{what}; each request to a random epp replica")
    header = f"{'replicas':>8}  {'sync':<12} {'prefix hit':>10}  {'cached chunks':>13}  {'load max/mean':>13}"
    print(header)
    print("-" * len(header))
    for r in rs:
        for setting in ([SyncSetting(False)] if r == 1 else [SyncSetting(False), on]):
            o = run(w, r, setting)
            label = "-" if r == 1 else setting.label()
            print(f"{r:>8}  {label:<12} {o.prefix_hit:>10.3f}  {o.cached_chunks:>13.3f}  "
                  f"{o.load_max_over_mean:>13.2f}")
    top = max(rs)
    print(f"sync delay at {top} replicas (flush every {flush_ms:g} ms):")
    print(f"{'delay':>8}  {'prefix hit':>10}  {'cached chunks':>13}")
    for d_ms in (0.0, 50.0, 500.0, 2000.0):
        o = run(w, top, SyncSetting(True, flush_ms / 1000, d_ms / 1000))
        print(f"{d_ms:>6.0f}ms  {o.prefix_hit:>10.3f}  {o.cached_chunks:>13.3f}")
    print()

if __name__ == "__main__":
    main()
