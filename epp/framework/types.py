"""Values passed through one scheduling cycle."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import Pool
from epp.framework.request import InferenceRequest

_NO_MATCH: Mapping[EndpointId, int] = MappingProxyType({})
_NO_PREFILL: Mapping[EndpointId, float] = MappingProxyType({})
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The request's chunk hashes and, per endpoint, how many leading chunks it holds."""

    hashes: Sequence[int]
    matched: Mapping[EndpointId, int] = field(default_factory=lambda: _NO_MATCH)
    block_chars: int = 64
    fill: Callable[[Sequence[EndpointId]], Sequence[float]] | None = None
    """The producer's view of how full each endpoint's cache is (0..1), read on demand by
    the scorers that weigh cache room (None: the producer keeps no such view)."""
    least_filled: Callable[[int, Container[EndpointId]], Sequence[EndpointId]] | None = None
    """With ``fill``: up to ``k`` of the given endpoints whose cache is the least full, found
    without reading every endpoint's (a shortlist's nominees)."""

    @property
    def total(self) -> int:
        return len(self.hashes)

    def ratio(self, endpoint_id: EndpointId) -> float:
        total = len(self.hashes)
        return self.matched.get(endpoint_id, 0) / total if total else 0.0

    def holders(self, pool: Pool, k: int, min_chunks: int = 1) -> list[Endpoint]:
        """The (up to) ``k`` endpoints of ``pool`` holding the most leading chunks, at least
        ``min_chunks``, most first; ties to the shorter queue, then the fewer running, then
        the less KV used (a shortlist's nominees: a pass over the holders, not the pool)."""
        get = pool.get
        held = [(m, e) for eid, m in self.matched.items()
                if m >= min_chunks and (e := get(eid)) is not None]  # fmt: skip
        if len(held) > k:
            held = heapq.nsmallest(k, held, key=_longest_first)
        else:
            held.sort(key=_longest_first)
        return [e for _, e in held]


def _longest_first(held: tuple[int, Endpoint]) -> tuple[int, int, int, float]:
    e = held[1]
    m = e.metrics
    return -held[0], e.queue, m.running, m.kv_usage


_EMPTY_PREFIX = PrefixMatch(hashes=())


@dataclass(slots=True)
class CycleState:
    """What one scheduling cycle knows: the request, the clock, and shared precomputation;
    and, for the request's whole life (it travels with the pick to the first-token and
    post-response hooks), what each plugin keeps for it (``read`` / ``write``).

    Mutable so that the scheduler can attach the prefix match once and every plugin reads it.
    Per-request plugin state lives here, never in a table of the plugin's keyed by the
    request's or the cycle's ``id()``: it dies with the request, with no cap, expiry or
    "identity reused" repair to get wrong.
    """

    request: InferenceRequest
    now_s: float
    rng: random.Random
    prefix: PrefixMatch = _EMPTY_PREFIX
    """The match scorers and filters read (the last producer that set it wins)."""
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    """Each prefix producer's own match, by producer name (for its post-pick and
    post-response hooks, which must not read another producer's keys)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each plugin (and in ``prefix``) during this cycle."""
    in_flight: Mapping[EndpointId, int] = field(default_factory=lambda: _NO_MATCH)
    """Requests epp has in flight per endpoint (the Director's, ``Datastore.in_flight_view``;
    empty when the caller keeps none)."""
    runs: list[ProfileRun] | None = None
    """When a list: each profile run appends what it did (``ProfileRun``), for a trace, the
    pick-reason header or ``epp dry-run``; None (the default): nothing is recorded."""
    prefill: Mapping[EndpointId, float] = field(default_factory=lambda: _NO_PREFILL)
    """Prompt characters sent to each endpoint to prefill and not prefilled yet (no first
    token back), with index sync the other replicas' too: one accounting, kept by the
    Director (``epp.datastore.prefill.PrefillLedger``), read by every plugin that weighs
    queued prefill (divide by its characters per token). Empty when the caller keeps none."""
    data: dict[str, object] = field(default_factory=dict)
    """Per-request plugin state by key (``read`` / ``write``); seeded with what the request
    preparers computed (``RequestPreparer.prepare_request``, by preparer name)."""
    pool: Pool | None = None
    """While a profile scores a shortlist of its candidates: all of them (after its filters),
    indexed, for scorers that normalise over the candidates (the queue scorer's shortest and
    longest queue); None while the scorers are handed every candidate."""

    def read(self, key: str, kind: type[T]) -> T | None:
        """The state ``key`` holds if it is a ``kind``, else None."""
        value = self.data.get(key)
        return value if isinstance(value, kind) else None

    def write(self, key: str, value: object) -> None:
        """Keep ``value`` for this request under ``key`` (a plugin's name, or its name and
        a suffix)."""
        self.data[key] = value


@dataclass(slots=True, frozen=True)
class FilterStep:
    """A filter's outcome in a recorded run: the endpoints it let through, in order."""

    name: str
    survivors: tuple[EndpointId, ...]


@dataclass(slots=True, frozen=True)
class ScorerColumn:
    """A scorer's scores (0..1, before its weight) for a recorded run's candidates, aligned
    with ``ProfileRun.candidates``."""

    name: str
    weight: float
    scores: tuple[float, ...]


@dataclass(slots=True, frozen=True)
class ProfileRun:
    """What one profile did for one request (recorded when ``CycleState.runs`` is a list):
    the endpoints it was given, each filter's survivors, each scorer's column for the
    candidates that survived them all, their weighted totals and the picker's choice.
    ``start_ns`` / ``end_ns``: wall clock (``time.time_ns``), for a trace's span."""

    profile: str
    endpoints: tuple[EndpointId, ...]
    filters: tuple[FilterStep, ...]
    candidates: tuple[EndpointId, ...]
    scorers: tuple[ScorerColumn, ...]
    totals: tuple[float, ...]
    picker: str
    picked: tuple[EndpointId, ...]
    start_ns: int
    end_ns: int


@dataclass(slots=True, frozen=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@dataclass(slots=True, frozen=True)
class ProfileResult:
    """What one profile's run chose: ``targets`` best first (empty: the filters left none);
    ``candidates`` survived the filters, ``totals`` their weighted scores, aligned."""

    targets: list[Endpoint]
    candidates: Sequence[Endpoint]
    totals: Sequence[float]


@dataclass(slots=True, frozen=True)
class HandlerResult:
    """A profile handler's outcome: the primary profile's result (where the request is
    routed), and, for disaggregated serving, the endpoint(s) chosen to prefill it elsewhere
    and the decision taken (a metrics label: ``split``, ``local``, ...)."""

    primary: ProfileResult
    prefill: tuple[Endpoint, ...] = ()
    decision: str = ""


@dataclass(slots=True, frozen=True)
class PickResult:
    """The outcome of a cycle: ``targets[0]`` is the pick, the rest are fallbacks in order.

    ``candidates`` are the endpoints that survived the filters and ``totals`` their weighted
    scores, aligned; ``scored()`` pairs them for logs and tests.
    """

    targets: tuple[Endpoint, ...]
    state: CycleState
    candidates: Sequence[Endpoint] = ()
    totals: Sequence[float] = ()
    prefill: tuple[Endpoint, ...] = ()
    """Disaggregated serving: the endpoint to run the prefill on (first), when the profile
    handler chose to split the request; empty otherwise (the target does it all)."""
    decision: str = ""
    """The profile handler's decision, when one runs (``split``, ``local``, ...)."""

    @property
    def prefiller(self) -> Endpoint | None:
        return self.prefill[0] if self.prefill else None

    @property
    def target(self) -> Endpoint:
        return self.targets[0]

    @property
    def target_ids(self) -> tuple[EndpointId, ...]:
        return tuple(e.id for e in self.targets)

    def scored(self) -> list[ScoredEndpoint]:
        return [ScoredEndpoint(e, s) for e, s in zip(self.candidates, self.totals, strict=True)]


@dataclass(slots=True, frozen=True)
class ResponseInfo:
    """What epp learned from the model server's response (all optional)."""

    status: int = 200
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    generated_text: str = ""
    response_bytes: int = 0
    """Size of the response body as it left the model server."""
    ttft_s: float | None = None
    """Seconds from the pick to the response's first body bytes (the first token of a
    stream), when known."""
