"""``predicted-ttft-scorer``: route by the time to first token each endpoint would give,
from a cost model learnt online, instead of hand-weighted scores.

``predicted TTFT = c0 + c_u u + c_q q + c_r r + c_k kv + c_o o + c_a a`` (uncached tokens,
prefill queued ahead, running requests, KV use and overflow, LoRA slot waits), plus what the
pick costs later requests (work, fill, evict, contention, adapter, saturation and session
spread charges); the lowest cost scores 1, the others ``best / theirs``. The coefficients
start at priors and are refit by exponentially weighted least squares on the observed first
tokens (each one joins the normal equations at once; they are solved at most every
``_REFIT_INTERVAL_S`` of the Director's clock, or once ``_REFIT_MOST`` responses wait). ``q``
reads the Director's one prefill accounting (``CycleState.prefill``); what the scorer keeps
for a request lives on its cycle state. What each feature reads, each term, the parameters and why each default is what it
is: the plugin's page, ``epp/plugins/ttft.md``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import Pool
from epp.framework.types import CycleState, PickResult, ResponseInfo
from epp.plugins.session import SessionAffinityParams, SessionTable, session_of

log = logging.getLogger(__name__)

_FEATURES = 7  # 1, u, q, r, kv, overflow, adapter slot wait
_LOG_FIRST, _LOG_PERIOD_S = 50, 30.0
"""The fitted model is logged after the first 50 responses, then at most every 30 s."""
_MAX_PENDING = 100_000
"""Adapters, model names and sessions remembered at most (the oldest forgotten first)."""
_REFIT_INTERVAL_S = 0.05
"""The normal equations are solved again at most this often (the observations' clock)..."""
_REFIT_MOST = 64
"""...unless this many responses wait to be solved for."""
_MAX_PAIRS = 1_000_000
_MAX_OVERFLOW = 4.0
_MIN_CAPACITY_TOKENS = 1024
_PRIOR_FLOOR = 1.0
"""The priors never weigh less than this many observations in the fit."""


def _session_headers() -> list[str]:
    return ["x-session-id"]


@dataclass(slots=True, frozen=True)
class PredictedTtftParams:
    prefill_seconds_per_token: float = 9e-5
    """Prior of ``c_u`` and ``c_q``."""
    seconds_per_running_request: float = 0.02
    """Prior of ``c_r``."""
    base_seconds: float = 0.02
    """Prior of ``c0``."""
    seconds_per_kv_overflow: float = 5.0
    """Prior of ``c_o``: a request that needs a whole KV cache more than is free waits this
    long for running requests to release blocks."""
    seconds_per_adapter_wait: float = 1.0
    """Prior of ``c_a``: how long a request waits for an adapter slot on an endpoint whose
    slots other adapters hold (the fit learns the pool's own)."""
    chars_per_token: float = 4.0
    """To read prompt lengths and prefix matches (in characters) as tokens."""
    forgetting: float = 0.999
    """Weight kept by each past observation per new one (0.999: ~1,000 responses)."""
    prior_strength: float = 20.0
    """How many observations the priors are worth."""
    calibration_rate: float = 0.0
    """How fast an endpoint's speed factor follows its observed / predicted TTFT ratio (a
    slower GPU, a busier host): predictions for it are the shared model's times that factor.
    0 (the default): one model for every endpoint; on identical replicas a factor reads
    transient queueing as slowness. Meant for pools of unequal servers (mixed GPUs)."""
    count_own_running: bool = False
    """Count as running on an endpoint the requests epp sent there whose response has not
    ended (epp's in-flight count, ``CycleState.in_flight``), when that is more than the
    scraped ``running`` (a burst epp just sent is in no scrape yet). For servers whose step
    time grows with the batch (vLLM on CPU); off for GPU-like servers, where a larger decode
    batch costs little."""
    learn: bool = True
    """Fit the cost model online from observed first tokens (else keep the starting coefficients)."""
    shared_prefill_cost: bool = False
    """Fit one cost per prefill token for the request's own uncached tokens and the queued
    ones ahead of it (``c_u = c_q``), as a server spends the same on either; with two, a
    workload of mostly cache hits can fit ``c_u`` near zero (seen on real vLLM on the CPU).
    Off by default: on GPU-like servers queued prefill batches well and costs less a token."""
    work_weight: float = 2.0
    """The prefill a pick adds also delays every later request on that endpoint: the score
    charges ``work_weight x c_u x u`` on top of the request's own predicted TTFT (0: greedy,
    the request alone)."""
    fill_weight: float = 3.0
    """Uncached tokens written where the cache is fuller push out sooner what later requests
    would reuse: the score charges ``fill_weight x work_weight x c_u x u x (fill - lowest
    fill)`` among the candidates (fill: the share of the endpoint's cache the prefix index
    holds), so new prefixes go where there is room; the term vanishes once every cache is
    equally full. 0 turns it off."""
    evict_weight: float = 2.0
    """Where caches are full, every uncached token a pick writes pushes a token of some other
    prefix out: the score charges ``evict_weight x work_weight x c_u x u x fill`` on top (so
    nothing while the caches have room). 0 turns it off."""
    adapter_weight: float = 1.0
    """A request for a LoRA adapter that some endpoint holds (running it, epp has requests of
    it in flight there, or epp sent it there last within ``adapter_window_seconds``) is
    charged ``adapter_weight x c_a`` on every endpoint that does not: a slot it takes there is
    one another adapter's requests would wait for, so an adapter stays on the endpoints that
    hold it unless they are that much slower. 0 turns it off."""
    adapter_window_seconds: float = 30.0
    """How long the endpoint epp last sent an adapter to counts as holding it."""
    session_spread_seconds: float = 0.0
    """A request that starts a session (an identity from ``session_headers`` not seen within
    ``session_window_seconds``) sets where the session's later turns will go, since their
    context will be cached there: the score charges this many seconds per session active on
    the endpoint, so new sessions spread over the endpoints instead of piling onto those that
    hold a shared system prompt. 0 (the default): off."""
    session_spread_requests: float = 20.0
    """The spread charge is full once the sessions active have made this many requests each
    on average so far, and proportionally less below: a chat of a few turns is cheaper kept
    beside its system prompt, a long agent session is worth spreading. 0: always full."""
    session_headers: list[str] = field(default_factory=_session_headers)
    """Request headers carrying the session identity (``session_spread_seconds``)."""
    session_window_seconds: float = 120.0
    """A session counts as active on its endpoint this long after its last request."""
    contention_weight: float = 2.0
    """A server that batches prefill chunks (vLLM's chunked prefill) runs a request that
    arrives while others are prefilling in the same steps as theirs: the score charges
    ``contention_weight x c_u x min(u, q)``, nothing on an endpoint with no prefill queued.
    0 turns it off."""
    saturation_weight: float = 0.0
    """When every candidate has prefill queued, no server is free to absorb the prefill a
    pick adds: it is paid by the requests queued behind it wherever it goes, and a prompt
    moved off its cache adds the most. The score charges ``saturation_weight x c_u x u x b /
    (b + saturation_backlog_seconds)``, ``b`` the least prefill backlog among the candidates
    in seconds (``c_q x q``), so that a saturated pool keeps prompts where they are cached;
    nothing while some candidate has none queued. 0 turns it off (the parameter's default;
    the default profile sets 64: docs/research/2026-11-28-saturated-pools-keep-prompts-cached.md)."""
    saturation_backlog_seconds: float = 0.1
    """The least backlog at which the saturation charge is half its full weight (0: full at
    any backlog)."""


@dataclass(slots=True)
class TtftErrors:
    """Prediction error on the responses seen: the absolute error's sum and the first
    ``_MAX_PAIRS`` (predicted, observed) pairs (the replay reports them)."""

    count: int = 0
    abs_sum: float = 0.0
    pairs: list[tuple[float, float]] = field(default_factory=list)

    def add(self, predicted: float, actual: float) -> None:
        self.count += 1
        self.abs_sum += abs(predicted - actual)
        if len(self.pairs) < _MAX_PAIRS:
            self.pairs.append((predicted, actual))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (tiny systems); None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, n + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass(slots=True)
class _Scored:
    """A request's features and predictions per candidate, from ``score`` to ``post_pick``
    (kept on its cycle state)."""

    candidates: dict[EndpointId, tuple[tuple[float, ...], float]]


@dataclass(slots=True)
class _Picked:
    """A picked request's features and prediction, kept on its cycle state until its first
    token is observed (learning) and its response ends (its adapter's slot)."""

    target: EndpointId
    x: tuple[float, ...]
    predicted: float
    adapter: str = ""
    """Counted in ``adapters_on[target]`` until the response ends ('' none)."""
    observed: bool = False


def _take(counts: dict[Any, Any], key: Any, amount: float) -> None:
    """Subtract ``amount`` from a per-endpoint count, dropping the key once nothing is left."""
    left = counts.get(key, 0) - amount
    if left > 1e-6:
        counts[key] = left
    else:
        counts.pop(key, None)


def _unbeaten(pool: Pool, by_fill: Sequence[EndpointId], k: int) -> list[Endpoint]:
    """Of endpoints in order of cache fill, least first, up to ``k`` that no endpoint before
    them (as empty or emptier) beats on queue, running requests and KV use together: for a
    request no endpoint holds, the cost model's cost grows with the fill and, roughly, with
    each of the three (its queued prefill is epp's own count or the server's waiting)."""
    kept: list[Endpoint] = []
    for eid in by_fill:
        e = pool.get(eid)
        if e is None:
            continue
        m = e.metrics
        if not any(b.queue <= e.queue and b.metrics.running <= m.running
                   and b.metrics.kv_usage <= m.kv_usage for b in kept):  # fmt: skip
            kept.append(e)
            if len(kept) >= k:
                break
    return kept


class PredictedTtftScorer:
    """A scorer that also learns (post-pick and post-response hooks)."""

    def __init__(self, name: str, params: PredictedTtftParams) -> None:
        self.name = name
        self.params = params
        p = params
        self.coef = [p.base_seconds, p.prefill_seconds_per_token, p.prefill_seconds_per_token,
                     p.seconds_per_running_request, 0.0, p.seconds_per_kv_overflow,
                     p.seconds_per_adapter_wait]  # fmt: skip
        # normalised features keep the least-squares system well conditioned
        # (z = x / scale: thousands of tokens), and the fit is in z's units: coef x scale
        self._scale = [1.0, 1e3, 1e3, 1.0, 1.0, 1.0, 1.0]
        k = p.prior_strength
        self._prior_z = [c * s for c, s in zip(self.coef, self._scale, strict=True)]
        self._xtx = [[k if i == j else 0.0 for j in range(_FEATURES)] for i in range(_FEATURES)]
        self._xty = [k * z for z in self._prior_z]
        self.mean_uncached = 512.0
        """Uncached tokens of a routed request, averaged (EWMA): the size of a queued one."""
        # what the scorer keeps for a request (its features at the pick, its adapter) lives
        # on the request's cycle state (``_Scored``, ``_Picked``): it dies with the request
        self.speed: dict[EndpointId, float] = {}
        """Per endpoint, observed / predicted TTFT (geometric EWMA; 1 until observed)."""
        self._unsolved = 0
        """Responses added to the normal equations since they were last solved."""
        self._solved_s = -math.inf
        """When they were (the clock of the observations: pick time + time to first token)."""
        self.errors = TtftErrors()
        self._session_params = SessionAffinityParams(headers=list(p.session_headers))
        self._sessions = SessionTable(p.session_window_seconds, _MAX_PENDING)
        """Sessions seen within the window (kept with ``session_spread_seconds`` > 0)."""
        self.sessions_on = self._sessions.on
        """Per endpoint, the sessions active there."""
        self._logged_s = -math.inf
        self.adapters_on: dict[EndpointId, dict[str, int]] = {}
        """Per endpoint, the adapters of the requests epp sent there whose response has not
        ended, and how many of each."""
        self._adapter_home: OrderedDict[str, tuple[EndpointId, float]] = OrderedDict()
        """Per adapter, the endpoint epp last sent it to and when."""
        self.lora_names: OrderedDict[str, None] = OrderedDict()
        """The LoRA adapters the servers have reported running or waiting (the latest last)."""
        self.base_models: OrderedDict[str, None] = OrderedDict()
        """The base models the servers have reported serving (``Metrics.served_models``)."""

    def features(self, state: CycleState, e: Endpoint, adapter: str | None = None) -> tuple[float, ...]:
        """The cost model's inputs for ``e``; ``adapter`` is ``_lora(state)`` when the caller
        has it (``score`` works it out once for all the endpoints)."""
        p = self.params
        prompt_tokens = len(state.request.prompt) / p.chars_per_token
        prefix = state.prefix
        matched = prefix.matched.get(e.id, 0) * prefix.block_chars / p.chars_per_token
        u = max(0.0, prompt_tokens - matched)
        m = e.metrics
        # prefill queued ahead: what epp sent and has not seen prefilled (this replica's, and
        # with index sync the other replicas'), or what the server
        # reports waiting when that is more (other routers, traffic past epp). Not the
        # requests sent since the last scrape (``e.pending``): epp's own are in the prefill
        # accounting until their first token, and once it came they wait no more
        own = state.prefill.get(e.id, 0.0) / p.chars_per_token
        q = max(own, m.waiting * self.mean_uncached)
        r = float(m.running)
        if p.count_own_running:
            r = max(r, float(state.in_flight.get(e.id, 0)))
        capacity = m.kv_capacity_tokens()
        kv = m.kv_usage
        # the share of the KV cache this request would need beyond what is free: it waits
        # for running requests to finish and release blocks
        # (bounded: a server that has not reported a plausible cache size adds nothing)
        overflow = (min(_MAX_OVERFLOW, max(0.0, kv + (u + q) / capacity - 1.0))
                    if capacity >= _MIN_CAPACITY_TOKENS else 0.0)  # fmt: skip
        if adapter is None:
            adapter = self._lora(state)
        return (1.0, u, q, r, kv, overflow, self._slot_wait(adapter, e))

    def _is_adapter(self, name: str) -> bool:
        """A name the servers have reported as an adapter, or, once they have reported any
        (the pool serves adapters) and where they name their base models, any name that is
        not one of those (an alias of the base model in a pool without adapters is never one)."""
        names, base = self.lora_names, self.base_models
        return name in names or (bool(names) and bool(base) and name not in base)

    def _lora(self, state: CycleState) -> str:
        """The request's LoRA adapter ('' for the base model)."""
        adapter = state.request.adapter
        return adapter if adapter and self._is_adapter(adapter) else ""

    def _slot_wait(self, adapter: str, e: Endpoint) -> float:
        """How many times ``adapter`` would wait for the adapters holding ``e``'s slots to
        drain (module docstring): the other adapters running or in flight there beyond the
        slots, plus one; 0 while it runs there or a slot is free."""
        m = e.metrics
        if not adapter or not m.known or m.max_adapters <= 0 or adapter in m.running_adapters:
            return 0.0
        own = {a for a in self.adapters_on.get(e.id, {}) if self._is_adapter(a)}
        others = (m.running_adapters | own) - {adapter}
        return float(max(0, len(others) - m.max_adapters + 1))

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self.coef, x, strict=True))

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        adapter = self._lora(state)
        feats = [self.features(state, e, adapter) for e in endpoints]
        speed = self.speed
        factors = [speed.get(e.id, 1.0) for e in endpoints] if speed else [1.0] * len(feats)
        c0, c1, c2, c3, c4, c5, c6 = self.coef  # predict(), unrolled: this runs per endpoint
        preds = [max(1e-4, f * (c0 * one + c1 * u + c2 * q + c3 * r + c4 * kv + c5 * o + c6 * a))
                 for (one, u, q, r, kv, o, a), f in zip(feats, factors, strict=True)]  # fmt: skip
        # for post_pick (sessions, adapters, the mean uncached size) and learning; kept with
        # ``learn: false`` too (without it the sessions were never recorded and the spread
        # charge never applied)
        state.write(self.name, _Scored(
            {e.id: (x, t) for e, x, t in zip(endpoints, feats, preds, strict=True)}
        ))  # fmt: skip
        w = self.params.work_weight * self.coef[1]
        cw = self.params.contention_weight * self.coef[1]
        sat = self._saturation_charge(feats)
        ws = w + sat
        fill_of = state.prefix.fill
        k = self.params.fill_weight * w
        ev = self.params.evict_weight * w
        if (k > 0 or ev > 0) and fill_of is not None and len(endpoints) > 1:
            fills = fill_of([e.id for e in endpoints])
            low = min(fills)
            cost = [t + f * (ws * x[1] + cw * min(x[1], x[2])) + f * x[1] * (k * (fill - low) + ev * fill)
                    for x, t, f, fill in zip(feats, preds, factors, fills, strict=True)]  # fmt: skip
        else:
            cost = [t + f * (ws * x[1] + cw * min(x[1], x[2]))
                    for x, t, f in zip(feats, preds, factors, strict=True)]  # fmt: skip
        if self.params.adapter_weight > 0 and adapter:
            cost = self._keep_adapter(adapter, endpoints, feats, cost, factors, state.now_s)
        if self.params.session_spread_seconds > 0:
            cost = self._spread_sessions(state, endpoints, cost)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("predicted-ttft request %s: %s", state.request.request_id, "; ".join(
                f"{e.id} u={x[1]:.0f} q={x[2]:.0f} r={x[3]:.0f} kv={x[4]:.2f} over={x[5]:.2f} slot={x[6]:.0f}"
                f" ttft={t:.4f} cost={c:.4f}"
                for e, x, t, c in zip(endpoints, feats, preds, cost, strict=True)))
        best = min(cost)
        return [best / c for c in cost]

    def nominate(self, state: CycleState, pool: Pool, k: int) -> list[Endpoint]:
        """The endpoints it would most likely predict fastest, without predicting for every
        one: those holding the longest prefix (the fewest uncached tokens; level ones, the
        least busy and the least filled), the least busy (running and waiting), those no
        other beats on both the queue and requests running (its cost weighs both, KV use
        hardly), the least filled caches (the prefix producer's view: where uncached tokens evict least), for a request that starts a session the least queued with the
        fewest sessions, and, for a LoRA adapter, the endpoints holding it (reporting it, or
        epp's requests for it in flight there or sent there last)."""
        prefix = state.prefix
        p = self.params
        weighs_fill = (p.fill_weight > 0 or p.evict_weight > 0) and prefix.fill is not None
        held = prefix.holders(pool, 4 * k if weighs_fill else k)
        out = held[:k]
        if weighs_fill and len(held) > k:  # among the longest, the least filled too
            assert prefix.fill is not None
            fills = prefix.fill([e.id for e in held])
            matched = prefix.matched
            by_fill = sorted(range(len(held)), key=lambda i: (-matched[held[i].id], fills[i]))
            out += [held[i] for i in by_fill[:k]]
        out += pool.least("busy", k)
        out += pool.staircase("queue", k, against="running")
        if weighs_fill and prefix.least_filled is not None:
            out += _unbeaten(pool, prefix.least_filled(2 * k, pool.ids), 2 * k)
        if self.params.session_spread_seconds > 0:
            session = session_of(state.request, self._session_params)
            if session and session not in self._sessions:
                on = self._sessions.on
                near = pool.least("queue", 4 * k)
                out += sorted(near, key=lambda e: on.get(e.id, 0))[:k]
        adapter = self._lora(state)
        if adapter:
            held = pool.holding(adapter)
            home = self._adapter_home.get(adapter)
            for eid in (*(e for e, on in self.adapters_on.items() if adapter in on),
                        *((home[0],) if home is not None else ())):  # fmt: skip
                e = pool.get(eid)
                if e is not None:
                    held.append(e)
            out += sorted(held, key=lambda e: e.queue)[:k]
        return out

    def _saturation_charge(self, feats: list[tuple[float, ...]]) -> float:
        """Per uncached token, the saturation charge (``saturation_weight``): the least
        prefill backlog among the candidates, in seconds, ramps it up to its full weight."""
        p = self.params
        if p.saturation_weight <= 0:
            return 0.0
        backlog = max(0.0, self.coef[2]) * min(x[2] for x in feats)
        if backlog <= 0:
            return 0.0
        return p.saturation_weight * self.coef[1] * backlog / (backlog + p.saturation_backlog_seconds)

    def _keep_adapter(self, adapter: str, endpoints: Sequence[Endpoint], feats: list[tuple[float, ...]],
                      cost: list[float], factors: list[float], now_s: float) -> list[float]:  # fmt: skip
        """Where some endpoint holds ``adapter`` (running it, requests for it in flight there,
        or epp's last pick of it within the window while a slot is free there), charge every
        endpoint that does not ``adapter_weight`` slot waits."""
        home, at = self._adapter_home.get(adapter, ("", -math.inf))
        recent = home if now_s - at <= self.params.adapter_window_seconds else ""
        held = [adapter in e.metrics.running_adapters or adapter in self.adapters_on.get(e.id, {})
                or (e.id == recent and not x[6]) for e, x in zip(endpoints, feats, strict=True)]  # fmt: skip
        if not any(held):
            return cost
        k = self.params.adapter_weight * self.coef[6]
        return [c + (k * f if not h and e.metrics.max_adapters > 0 else 0.0)
                for c, h, f, e in zip(cost, held, factors, endpoints, strict=True)]  # fmt: skip

    def _spread_sessions(self, state: CycleState, endpoints: Sequence[Endpoint],
                         cost: list[float]) -> list[float]:  # fmt: skip
        sessions = self._sessions
        sessions.expire(state.now_s)
        session = session_of(state.request, self._session_params)
        if not session or session in sessions:
            return cost
        k = self.params.session_spread_seconds
        full = self.params.session_spread_requests
        if full > 0:
            k *= min(1.0, sessions.mean_requests() / full)
        if k <= 0:
            return cost
        on = sessions.on
        return [c + k * on.get(e.id, 0) for c, e in zip(cost, endpoints, strict=True)]

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        scored = state.read(self.name, _Scored)
        if scored is None:
            return
        picked = scored.candidates.get(result.target.id)
        if picked is None:
            return
        x, t = picked
        self.mean_uncached = 0.98 * self.mean_uncached + 0.02 * x[1]
        target = result.target.id
        if self.params.session_spread_seconds > 0:
            session = session_of(state.request, self._session_params)
            if session:
                self._sessions.record(session, target, state.now_s)
        entry = _Picked(target, x, t)
        state.write(self.name, entry)
        adapter = state.request.adapter  # a base model's too: a name is known as an adapter later
        if adapter:
            self._adapter_home[adapter] = (target, state.now_s)
            self._adapter_home.move_to_end(adapter)
            if len(self._adapter_home) > _MAX_PENDING:
                self._adapter_home.popitem(last=False)
            entry.adapter = adapter
            on = self.adapters_on.setdefault(target, {})
            on[adapter] = on.get(adapter, 0) + 1

    def post_first_token(self, state: CycleState, result: PickResult, ttft_s: float) -> None:
        entry = state.read(self.name, _Picked)
        if entry is not None:
            self._observe(entry, ttft_s, state.now_s + ttft_s)

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None:
        entry = state.read(self.name, _Picked)
        if entry is None:
            return
        state.data.pop(self.name, None)
        if entry.adapter:  # its slot is free again
            on = self.adapters_on.get(entry.target, {})
            _take(on, entry.adapter, 1)
            if not on:
                self.adapters_on.pop(entry.target, None)
        if info.status < 400 and info.ttft_s is not None:
            self._observe(entry, info.ttft_s, state.now_s + info.ttft_s)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        m = endpoint.metrics
        for names, seen in ((self.lora_names, m.running_adapters | m.waiting_adapters),
                            (self.base_models, m.served_models)):  # fmt: skip
            for name in seen:
                if name not in names:
                    names[name] = None
                    if len(names) > _MAX_PENDING:
                        names.popitem(last=False)

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        self.adapters_on.pop(endpoint_id, None)
        self.speed.pop(endpoint_id, None)
        # its sessions stay counted (no longer scored) until they expire or move

    def _observe(self, entry: _Picked, ttft: float, at_s: float) -> None:
        """Learn from a request's first token (once), which came at ``at_s``."""
        if entry.observed or not math.isfinite(ttft):
            return
        entry.observed = True
        target, x, predicted = entry.target, entry.x, entry.predicted
        self.errors.add(predicted, ttft)
        if self.errors.count >= _LOG_FIRST and (now := time.monotonic()) - self._logged_s >= _LOG_PERIOD_S:
            self._logged_s = now
            c = self.coef
            log.info(
                "predicted-ttft model after %d responses: %.0f ms + %.3f ms per uncached token "
                "+ %.3f ms per queued prefill token + %.1f ms per running request + %.0f ms "
                "x KV use + %.0f ms x KV overflow + %.0f ms waiting for an adapter slot; mean abs error %.0f ms",
                self.errors.count, c[0] * 1e3, c[1] * 1e3, c[2] * 1e3, c[3] * 1e3, c[4] * 1e3,
                c[5] * 1e3, c[6] * 1e3, self.errors.abs_sum / self.errors.count * 1e3,
            )  # fmt: skip
        factor = self.speed.get(target, 1.0)
        rate = self.params.calibration_rate
        if rate > 0 and predicted > 0 and ttft > 0:
            ratio = min(10.0, max(0.1, ttft / predicted))
            self.speed[target] = min(10.0, max(0.1, factor * ratio**rate))
        if self.params.learn:  # the shared model learns the endpoint-neutral time
            self._learn(x, ttft / factor, at_s)

    def _learn(self, x: tuple[float, ...], y: float, at_s: float) -> None:
        lam = self.params.forgetting
        z = [v / s for v, s in zip(x, self._scale, strict=True)]
        shared = self.params.shared_prefill_cost
        if shared:  # one coefficient (slot 1) for own and queued prefill; slot 2 follows it
            z[1], z[2] = z[1] + z[2], 0.0
        xtx = self._xtx
        for i, zi in enumerate(z):
            xtx[i] = [lam * v + zi * zj for v, zj in zip(xtx[i], z, strict=True)]
        self._xty = [lam * v + zi * y for v, zi in zip(self._xty, z, strict=True)]
        self._unsolved += 1
        if at_s - self._solved_s >= _REFIT_INTERVAL_S or self._unsolved >= _REFIT_MOST:
            self._solved_s = at_s
            self.refit()

    def refit(self) -> None:
        """Solve the normal equations for the coefficients (see ``_REFIT_INTERVAL_S``; a
        test or the replay may call it at any time)."""
        self._unsolved = 0
        xtx, xty = self._xtx, self._xty
        shared = self.params.shared_prefill_cost
        # the prior decays with the data; a feature the traffic never sets (no KV overflow,
        # no queue) would leave a zero row after ~30k responses and freeze the whole fit, so
        # the solve keeps a fixed floor of it (_PRIOR_FLOOR observations' worth)
        a = [[v + _PRIOR_FLOOR if i == j else v for j, v in enumerate(row)] for i, row in enumerate(xtx)]
        b = [v + _PRIOR_FLOOR * z for v, z in zip(xty, self._prior_z, strict=True)]
        sol = _solve(a, b)
        if sol is None:
            return
        coef = [c / s for c, s in zip(sol, self._scale, strict=True)]
        if all(math.isfinite(c) for c in coef):
            # costs cannot be negative; a negative fit means the data cannot tell yet
            self.coef = [max(0.0, c) for c in coef]
            if shared:
                self.coef[2] = self.coef[1]
