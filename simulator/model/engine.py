"""One replica's engine: continuous batching over a :class:`PrefixCache` and a :class:`CostModel`.

The engine has no clock of its own. The caller passes ``now`` (seconds, any origin) and asks
:meth:`Engine.next_event_time` when something observable will next happen; the live
emulator sleeps until then in real time, the offline replayer jumps its simulated clock
there. Both then call :meth:`Engine.advance`.

Scheduling, simplified from vLLM:

* Waiting requests are admitted FIFO at step boundaries while the batch has fewer than
  ``max_num_seqs`` requests, the KV cache can hold them, and the step's prefill budget
  (``max_batched_tokens`` uncached prompt tokens) is not spent; the first request of a
  step is always admitted whatever its size (whole prompts; ``EngineConfig.chunked_prefill``
  computes them in chunks instead, as vLLM's chunked prefill). A request whose LoRA
  adapter would exceed ``max_loras`` distinct adapters in the batch is skipped, the
  others behind it may go (as vLLM does).
* Admission reserves KV blocks for the prompt and the full ``max_output_tokens``, so a
  running request never has to be preempted.
* A step that admits requests lasts ``sum(prefill) + decode_step(batch)`` and gives the new
  requests their first token; otherwise the batch decodes, ``decode_step(batch)`` per token.
* Disaggregated serving: a request carrying ``external_tokens`` (its prefill ran on another
  server) loads those the local cache lacks instead of computing them; they count as cached
  in its prefill cost and as vLLM's external prefix-cache hits. The transfer itself happens
  before the request reaches the engine (its caller delays it, ``CostModel.kv_transfer_s``).
* ``slowdown`` multiplies the steps' costs (the replay sets it for replicas sharing a host,
  ``CostModel.shared_host_slowdown``), and ``CostModel.step_noise`` a segment's cost by a
  log-normal factor drawn from the engine's own generator (``seed``). ``stalls`` (the
  replay's ``HostStalls``, ``CostModel.host_stall_rate_hz``) are times the host runs no
  engine: a segment's work runs around them.

Time advances in *segments* rather than single steps: while the batch does not change,
``k`` identical decode steps are one segment ending when the next request finishes
(``k`` read off a heap of finishing step numbers). A request arriving mid-segment cuts it
at the next step boundary so that it joins the batch there. The cost is per event, not
per token, which keeps the offline replay of thousands of long requests fast.

Driving it from a discrete-event loop::

    engine = Engine(PrefixCache(num_blocks=10240, block_size_tokens=16))
    for arrival_s, request in arrivals:                    # in time order
        while (t := engine.next_event_time()) is not None and t <= arrival_s:
            handle(engine.advance(t))                      # first tokens, finishes
        engine.submit(request, arrival_s)
    while (t := engine.next_event_time()) is not None:
        handle(engine.advance(t))

Requests submitted at the same instant are admitted together, at the boundary that
:meth:`Engine.next_event_time` then reports.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.model.cache import PrefixCache
from simulator.model.cost import CostModel
from simulator.model.stalls import HostStalls


class RequestTooLarge(ValueError):
    """The request needs more KV blocks than the whole cache holds: it could never run."""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    """Most requests decoding together (vLLM ``--max-num-seqs``)."""
    max_batched_tokens: int = 8192
    """Uncached prompt tokens admitted per step; the first admission ignores it. With
    ``chunked_prefill``: the tokens a step computes, decodes and prefill chunks together
    (vLLM ``--max-num-batched-tokens``)."""
    max_loras: int = 4
    """Most distinct LoRA adapters in one batch (vLLM ``--max-loras``)."""
    chunked_prefill: bool = False
    """Prefill in chunks, as vLLM's chunked prefill: a step gives each running request's
    decode one token and the rest of ``max_batched_tokens`` to the prompts being computed,
    oldest first; a prompt's first token comes at the end of the step that computes its last
    chunk. Off: a step computes whole prompts (the model above)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "max_loras"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine config field {name!r} must be > 0")


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """A request as the engine sees it: sizes and block hashes, no text."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[int]
    """Hashes of the prompt's full blocks (see ``simulator.model.cache``)."""
    max_output_tokens: int
    final_block_hashes: Sequence[int] | None = None
    """Hashes of the full blocks of prompt + output, cached when the request finishes.
    ``None``: only the prompt's blocks stay cached."""
    adapter: str = ""
    """LoRA adapter name, empty for the base model."""
    external_tokens: int = 0
    """Leading prompt tokens whose KV another server computed (a disaggregated prefill):
    those the local cache lacks are loaded, not computed (vLLM's external prefix cache
    hits), charged as cached tokens. The last prompt token is always computed."""


@dataclass(slots=True, frozen=True)
class FirstToken:
    request_id: str
    time_s: float
    cached_tokens: int
    """Prompt tokens served from the prefix cache or loaded from another server
    (``usage.prompt_tokens_details``)."""
    admitted_s: float
    """When the request left the waiting queue."""


@dataclass(slots=True, frozen=True)
class Finished:
    request_id: str
    time_s: float
    arrival_s: float
    first_token_s: float
    output_tokens: int
    cached_tokens: int


@dataclass(slots=True, frozen=True)
class StepResult:
    """What happened between the previous :meth:`Engine.advance` and this one."""

    first_tokens: list[FirstToken] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    next_event_s: float | None = None


@dataclass(slots=True)
class _Seq:
    req: EngineRequest
    order: int
    arrival_s: float
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    g0: int = 0
    """Engine step counter when the request joined the batch."""
    cached_tokens: int = 0
    """Local prefix-cache hits plus ``external``."""
    external: int = 0
    """Tokens loaded from another server's prefill (beyond the local hits)."""
    left: int = 0
    """Chunked prefill: prompt tokens still to compute."""
    started: bool = False
    """Chunked prefill: a first chunk was computed (it carried the per-request costs)."""


class Engine:
    """Continuous-batching replica driven by an external clock."""

    def __init__(
        self,
        cache: PrefixCache,
        cost: CostModel | None = None,
        config: EngineConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.cache = cache
        self.cost = cost or CostModel()
        self.config = config or EngineConfig()
        self._noise = random.Random(seed)
        """Draws the steps' noise factors (``CostModel.step_noise``)."""
        self._waiting: deque[_Seq] = deque()
        self._waiting_ids: set[str] = set()
        self._running: dict[str, _Seq] = {}
        self._finish_heap: list[tuple[int, int, str]] = []
        self._steps = 0
        self._order = 0
        self._adapters_running: dict[str, int] = {}
        # Current segment: [start, end), `steps` decode steps of `step_s` each, the first
        # one longer by the prefill of `admitted`. `end is None`: idle.
        self._seg_start = 0.0
        self._seg_end: float | None = None
        self._seg_prefill_s = 0.0
        self._seg_step_s = 0.0
        self._seg_steps = 0
        self._seg_admitted: list[_Seq] = []
        """The requests whose first token the segment's end gives."""
        self._seg_chunks: list[tuple[_Seq, int]] = []
        """Chunked prefill: the prompt tokens the segment's step computes, per request."""
        self._prefilling: list[_Seq] = []
        """Chunked prefill: admitted requests whose prompt is not all computed, oldest first."""
        self._first: list[FirstToken] = []
        self._finished: list[Finished] = []
        self.completed = 0
        self.external_queries_tokens = 0
        """Prompt tokens looked up in another server's KV (vLLM
        ``external_prefix_cache_queries``): the uncached part of requests that carry some."""
        self.external_hits_tokens = 0
        """...and the tokens loaded from there (``external_prefix_cache_hits``)."""
        self.slowdown = 1.0
        """How many times its cost a step takes (replicas sharing a host: the replay sets it
        from the others' work, ``CostModel.shared_host_slowdown``); read when a segment
        starts, so a change takes effect at the next step boundary (:meth:`reprice`)."""
        self.stalls: HostStalls | None = None
        """The host's stalls (``CostModel.host_stall_rate_hz``): the replay gives every engine
        the same schedule, and a segment's work runs around them."""

    # -- driving ---------------------------------------------------------------------------

    def submit(self, request: EngineRequest, now: float) -> None:
        """Queue ``request`` at time ``now``. Raises :class:`RequestTooLarge` or ``ValueError``."""
        if request.max_output_tokens < 1:
            raise ValueError("max_output_tokens must be >= 1")
        if request.num_prompt_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        rid = request.request_id
        if rid in self._running or rid in self._waiting_ids:
            raise ValueError(f"request id {rid!r} is already in the engine")
        need = self.cache.blocks_for(request.num_prompt_tokens + request.max_output_tokens)
        if need > self.cache.num_blocks:
            raise RequestTooLarge(
                f"request needs {need} KV blocks, the cache holds {self.cache.num_blocks}"
            )
        # Segments ending exactly at `now` stay pending: a request arriving at a step
        # boundary joins the batch there, with any other request arriving at that instant.
        self._advance_to(now, inclusive=False)
        self._order += 1
        self._waiting.append(_Seq(request, self._order, now))
        self._waiting_ids.add(rid)
        if self._seg_end is None:
            self._idle_boundary(now)
        elif len(self._waiting) == 1 and len(self._running) < self.config.max_num_seqs:
            self._cut_segment(now)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a waiting or running request (client went away). Returns whether it was found."""
        self._advance_to(now)
        seq = self._running.pop(request_id, None)
        if seq is not None:
            self.cache.free(request_id)
            self._release_adapter(seq.req.adapter)
            if seq.left:
                self._prefilling = [s for s in self._prefilling if s is not seq]
            self._cut_segment(now)  # the batch changed: re-plan from the next step
            return True
        if request_id in self._waiting_ids:
            self._waiting_ids.discard(request_id)
            for s in self._waiting:
                if s.req.request_id == request_id:
                    self._waiting.remove(s)
                    break
            return True
        return False

    def next_event_time(self) -> float | None:
        """When the current segment ends (a first token, a finish or an admission), or None."""
        return self._seg_end

    def reprice(self, now: float) -> None:
        """:attr:`slowdown` changed at ``now``: end a run of decode steps at the next step
        boundary, so the steps after it take the new cost (a prefill step runs to its end)."""
        self._advance_to(now, inclusive=False)
        self._cut_segment(now)

    def advance(self, now: float) -> StepResult:
        """Run every segment that ends at or before ``now`` and report what happened."""
        self._advance_to(now)
        result = StepResult(self._first, self._finished, self._seg_end)
        self._first = []
        self._finished = []
        return result

    def clone(self) -> Engine:
        """An independent copy of the engine and its cache (no event sink)."""
        e = Engine(self.cache.clone(), self.cost, self.config)
        e._noise.setstate(self._noise.getstate())
        seqs = {id(s): copy.copy(s) for s in (*self._waiting, *self._running.values())}
        e._waiting = deque(seqs[id(s)] for s in self._waiting)
        e._waiting_ids = set(self._waiting_ids)
        e._running = {rid: seqs[id(s)] for rid, s in self._running.items()}
        e._finish_heap = list(self._finish_heap)
        e._steps = self._steps
        e._order = self._order
        e._adapters_running = dict(self._adapters_running)
        e._seg_start = self._seg_start
        e._seg_end = self._seg_end
        e._seg_prefill_s = self._seg_prefill_s
        e._seg_step_s = self._seg_step_s
        e._seg_steps = self._seg_steps
        e._seg_admitted = [seqs[id(s)] for s in self._seg_admitted]
        e._seg_chunks = [(seqs[id(s)], c) for s, c in self._seg_chunks]
        e._prefilling = [seqs[id(s)] for s in self._prefilling]
        e._first = list(self._first)
        e._finished = list(self._finished)
        e.completed = self.completed
        e.external_queries_tokens = self.external_queries_tokens
        e.external_hits_tokens = self.external_hits_tokens
        e.slowdown = self.slowdown
        e.stalls = self.stalls
        return e

    def first_token_if(self, request: EngineRequest, now: float) -> float:
        """When ``request``, submitted at ``now``, would get its first token if nothing else
        arrived: run on a clone, this engine unchanged. Raises :class:`RequestTooLarge`."""
        what_if = self.clone()
        what_if.submit(request, now)
        rid = request.request_id
        while (t := what_if.next_event_time()) is not None:
            for first in what_if.advance(t).first_tokens:
                if first.request_id == rid:
                    return first.time_s
        raise AssertionError("a submitted request always gets its first token")

    # -- state for metrics and policies ----------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.cache.usage

    @property
    def prefix_cache_queries_tokens(self) -> int:
        return self.cache.queries_tokens

    @property
    def prefix_cache_hits_tokens(self) -> int:
        return self.cache.hits_tokens

    def running_adapters(self) -> list[str]:
        return sorted(self._adapters_running)

    def waiting_adapters(self) -> list[str]:
        return sorted({s.req.adapter for s in self._waiting if s.req.adapter})

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def tokens_generated(self, request_id: str, now: float) -> int | None:
        """Output tokens a running or waiting request has produced by ``now``; None if unknown.

        Reads the position inside the current segment without advancing the engine.
        """
        seq = self._running.get(request_id)
        if seq is None:
            return 0 if request_id in self._waiting_ids else None
        if seq.left and seq not in self._seg_admitted:
            return 0  # chunked prefill, its prompt not all computed by this step's end
        done = self._steps - seq.g0
        end = self._seg_end
        if end is not None:
            if now >= end:
                done += self._seg_steps
            elif not self._seg_admitted and self._seg_step_s > 0:
                done += min(self._seg_steps, int(self._work(self._seg_start, now) / self._seg_step_s))
        return min(done, seq.req.max_output_tokens)

    # -- internals -------------------------------------------------------------------------

    def _advance_to(self, now: float, inclusive: bool = True) -> None:
        while self._seg_end is not None and (
            self._seg_end <= now if inclusive else self._seg_end < now
        ):
            t = self._seg_end
            self._finish_segment(t)
            self._start_segment(t)

    def _start_segment(self, t: float) -> None:
        if self.config.chunked_prefill:
            if (self._prefilling or self._waiting) and self._start_chunk(t):
                return
            admitted: list[_Seq] = []
        else:
            admitted = self._admit(t) if self._waiting else []
        n = len(self._running)
        self._seg_start = t
        self._seg_admitted = admitted
        if admitted:
            cost = self.cost
            self._seg_prefill_s = self.slowdown * sum(
                cost.prefill_s(s.req.num_prompt_tokens - s.cached_tokens, s.cached_tokens)
                for s in admitted
            )
            self._seg_step_s = self.slowdown * cost.decode_step_s(n)
            self._seg_steps = 1
            self._jitter(1)
        elif n:
            heap = self._finish_heap
            while heap:
                _, order, rid = heap[0]
                live = self._running.get(rid)
                if live is not None and live.order == order:
                    break
                heapq.heappop(heap)
            self._seg_prefill_s = 0.0
            self._seg_step_s = self.slowdown * self.cost.decode_step_s(n)
            self._seg_steps = max(1, heap[0][0] - self._steps)
            self._jitter(self._seg_steps)
        else:
            self._seg_end = None
            return
        self._seg_end = self._finish(t, self._seg_prefill_s + self._seg_steps * self._seg_step_s)

    def _start_chunk(self, t: float) -> bool:
        """Chunked prefill: plan one step of decodes and prompt chunks (``EngineConfig.
        chunked_prefill``). False when it computes no prompt token (a decode segment then)."""
        running = self._running
        budget = self.config.max_batched_tokens - (len(running) - len(self._prefilling))
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            chunks.append((seq, min(seq.left, budget)))
            budget -= seq.left
        if budget > 0 and self._waiting:
            for seq in self._admit(t, budget):
                seq.left = seq.req.num_prompt_tokens - seq.cached_tokens
                self._prefilling.append(seq)
                if budget > 0:
                    chunks.append((seq, min(seq.left, budget)))
                budget -= seq.left
        if not chunks:  # the decodes take the whole budget: they run on to the next finish
            return False
        cost = self.cost
        base = cost.prefill_s(0)
        prefill = 0.0
        done: list[_Seq] = []
        for seq, n in chunks:
            prefill += cost.prefill_s(n, 0) - base if seq.started else cost.prefill_s(n, seq.cached_tokens)
            if n == seq.left:
                seq.g0 = self._steps
                done.append(seq)
        self._seg_start = t
        self._seg_admitted = done
        self._seg_chunks = chunks
        self._seg_prefill_s = self.slowdown * prefill
        self._seg_step_s = self.slowdown * cost.decode_step_s(len(running))
        self._seg_steps = 1
        self._jitter(1)
        self._seg_end = self._finish(t, self._seg_prefill_s + self._seg_step_s)
        return True

    def _jitter(self, steps: int) -> None:
        """The segment's cost times a log-normal factor of mean 1 (``CostModel.step_noise``;
        ``steps`` identical steps: the spread of their mean)."""
        sigma = self.cost.step_noise / math.sqrt(steps)
        if sigma > 0:
            f = math.exp(self._noise.gauss(0.0, sigma) - sigma * sigma / 2)
            self._seg_prefill_s *= f
            self._seg_step_s *= f

    def _idle_boundary(self, now: float) -> None:
        """An idle engine got work: schedule an empty segment ending at ``now``, whose end
        admits everything that arrived by then."""
        self._seg_start = now
        self._seg_end = now
        self._seg_prefill_s = 0.0
        self._seg_step_s = 0.0
        self._seg_steps = 0
        self._seg_admitted = []
        self._seg_chunks = []

    def _cut_segment(self, now: float) -> None:
        """End a decode segment at the first step boundary at or after ``now``."""
        if self._seg_admitted or self._seg_steps <= 1 or self._seg_step_s <= 0:
            return
        steps = max(0, math.ceil(self._work(self._seg_start, now) / self._seg_step_s))
        if steps < self._seg_steps:
            self._seg_steps = steps
            self._seg_end = max(now, self._finish(self._seg_start, steps * self._seg_step_s))

    def _finish(self, start: float, work_s: float) -> float:
        """When ``work_s`` of work begun at ``start`` ends (host stalls included)."""
        stalls = self.stalls
        return start + work_s if stalls is None else stalls.finish(start, work_s)

    def _work(self, start: float, now: float) -> float:
        """The work done between ``start`` and ``now`` (host stalls left out)."""
        stalls = self.stalls
        return now - start if stalls is None else stalls.work(start, now)

    def _admit(self, t: float, budget: int = 0) -> list[_Seq]:
        """Admit waiting requests while the batch, the KV cache and ``budget`` (uncached
        prompt tokens, ``max_batched_tokens`` when 0) allow."""
        cfg = self.config
        cache = self.cache
        waiting = self._waiting
        running = self._running
        adapters = self._adapters_running
        budget = budget or cfg.max_batched_tokens
        admitted: list[_Seq] = []
        skipped: list[_Seq] = []
        while waiting and len(running) < cfg.max_num_seqs and budget > 0:
            seq = waiting[0]
            req = seq.req
            if req.adapter and req.adapter not in adapters and len(adapters) >= cfg.max_loras:
                skipped.append(waiting.popleft())
                continue
            alloc = cache.allocate(
                req.request_id, req.block_hashes, req.num_prompt_tokens, req.max_output_tokens
            )
            if alloc is None:
                break
            waiting.popleft()
            self._waiting_ids.discard(req.request_id)
            seq.admitted_s = t
            seq.g0 = self._steps
            hit = alloc.hit_tokens
            if req.external_tokens:
                bs = cache.block_size_tokens
                loadable = min(req.external_tokens, (req.num_prompt_tokens - 1) // bs * bs)
                seq.external = max(0, loadable - hit)
                self.external_queries_tokens += req.num_prompt_tokens - hit
                self.external_hits_tokens += seq.external
            seq.cached_tokens = hit + seq.external
            running[req.request_id] = seq
            if not cfg.chunked_prefill:  # else when its last chunk is computed
                heapq.heappush(
                    self._finish_heap, (self._steps + req.max_output_tokens, seq.order, req.request_id)
                )
            if req.adapter:
                adapters[req.adapter] = adapters.get(req.adapter, 0) + 1
            admitted.append(seq)
            budget -= req.num_prompt_tokens - seq.cached_tokens
        if skipped:
            waiting.extendleft(reversed(skipped))
        return admitted

    def _finish_segment(self, t: float) -> None:
        self._steps += self._seg_steps
        if self._seg_chunks:
            for seq, n in self._seg_chunks:
                seq.left -= n
                seq.started = True
            for seq in self._seg_admitted:  # its prompt computed: it decodes from here
                heapq.heappush(self._finish_heap,
                               (self._steps + seq.req.max_output_tokens - 1, seq.order, seq.req.request_id))  # fmt: skip
            self._prefilling = [s for s in self._prefilling if s.left]
            self._seg_chunks = []
        for seq in self._seg_admitted:
            seq.first_token_s = t
            self._first.append(FirstToken(seq.req.request_id, t, seq.cached_tokens, seq.admitted_s))
        self._seg_admitted = []
        heap = self._finish_heap
        running = self._running
        while heap and heap[0][0] <= self._steps:
            _, order, rid = heapq.heappop(heap)
            done = running.get(rid)
            if done is None or done.order != order:
                continue  # aborted
            del running[rid]
            req = done.req
            self.cache.free(rid, req.final_block_hashes)
            self._release_adapter(req.adapter)
            self.completed += 1
            self._finished.append(
                Finished(
                    rid,
                    t,
                    done.arrival_s,
                    done.first_token_s,
                    req.max_output_tokens,
                    done.cached_tokens,
                )
            )

    def _release_adapter(self, adapter: str) -> None:
        if not adapter:
            return
        n = self._adapters_running[adapter] - 1
        if n:
            self._adapters_running[adapter] = n
        else:
            del self._adapters_running[adapter]
