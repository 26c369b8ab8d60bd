"""Extension points of the request lifecycle, in the Inference Extension's terms.

* **Data producers** (``DataProducer.prepare``) run before scheduling and attach what they
  know to the cycle state (the prefix match). They are the only plugins that learn.
* A profile then runs its **filters** in order, every weighted **scorer** over the survivors,
  and one **picker**. Scorers return one score in [0, 1] per endpoint, aligned with the list
  they were given; a scorer that lacks data for an endpoint returns a neutral score and never
  raises. Filters, scorers and pickers only read.
* A producer may also be a **request preparer** (``RequestPreparer.prepare_request``): work
  that needs only the request (tokenizing) and may run in a worker thread before scheduling.
* **Request-control hooks**: ``PostPick`` (the pick is on the wire: record it),
  ``PostResponse`` (the response is complete: learn from its usage and text),
  ``PostStored`` (the response names an object the server stored: a stored response),
  ``EndpointListener`` (an endpoint's metrics arrived / it left the pool) and ``Sweeper``
  (periodic housekeeping, in bounded slices between requests).
* A **profile handler** (``ProfileHandler``), when the config has more than one profile,
  decides which profiles run for a request and what their picks mean: disaggregated
  serving runs the decode profile, asks a decider whether a separate prefill is worth it,
  then runs the prefill profile (``epp/plugins/disagg``). Without one, the single profile
  runs.
* **Lifecycle** (``Lifecycle.start`` / ``stop``): a plugin with background work (a
  subscription, a model it fits, metrics it exports) starts it when the server starts and
  stops it when the server stops, through the ``PluginContext`` it is handed (supervised
  tasks, the metrics registry). The server knows no plugin by name: it starts whatever
  implements the hook. The replay does not start plugins (it has no event loop of its own
  and drives their data directly).

Any plugin may implement any hooks; the scheduler sorts them out once, when it is built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import Pool
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, HandlerResult, PickResult, ProfileResult, ResponseInfo


@runtime_checkable
class Filter(Protocol):
    name: str

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Return the subset of ``endpoints`` that may take the request (may be empty)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[float]:
        """One score in [0, 1] per endpoint, in the order given."""
        ...


@runtime_checkable
class Nominator(Protocol):
    """A scorer that can name the endpoints it would score highest without scoring the rest:
    what lets its profile score a shortlist of a large pool (``epp.scheduling.profile``). A
    profile shortlists only when every scorer it weighs is one."""

    def nominate(self, state: CycleState, pool: Pool, k: int) -> Iterable[Endpoint]:
        """About ``k`` endpoints of ``pool`` (more where they tie) that this scorer would
        score highest, best first, found through ``pool``'s look-ups and the scorer's own
        state, in time that does not grow with the pool (the shortlist is the union of every
        scorer's nominees and the ``k`` least-queued endpoints). Never raises."""
        ...


@runtime_checkable
class Picker(Protocol):
    name: str

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        """Up to ``count`` endpoints, best first: the target, then fallbacks."""
        ...


RunProfile = Callable[[str, Sequence[Endpoint], int], ProfileResult]
"""Run the named profile over these endpoints for up to ``count`` targets (the scheduler
hands this to a profile handler)."""


@runtime_checkable
class ProfileHandler(Protocol):
    name: str

    @property
    def profiles(self) -> tuple[str, ...]:
        """The profiles it runs, the primary (where the request is routed) first."""
        ...

    def handle(
        self, state: CycleState, endpoints: Sequence[Endpoint], run: RunProfile, count: int
    ) -> HandlerResult:
        """Run the profiles this request needs; never raises for a missing optional stage."""
        ...


@runtime_checkable
class PostPick(Protocol):
    name: str

    def post_pick(self, state: CycleState, result: PickResult) -> None: ...


@runtime_checkable
class PostFirstToken(Protocol):
    """Told when the response's first bytes arrive (the prefill is done), before the
    response ends: what a cost model needs to track the prefill work still outstanding."""

    name: str

    def post_first_token(self, state: CycleState, result: PickResult, ttft_s: float) -> None: ...


@runtime_checkable
class PostResponse(Protocol):
    name: str

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None: ...


@runtime_checkable
class PostStored(Protocol):
    """Told, as soon as the response shows them, of the ids of objects the model server
    stored for this request (a Responses-API response with ``store``, a conversation): only
    the endpoint that answered can continue or return them. Runs before ``PostResponse``
    (a streamed response names its id in its first event)."""

    name: str

    def post_stored(self, state: CycleState, result: PickResult, ids: Sequence[str]) -> None: ...


@runtime_checkable
class DataProducer(Protocol):
    name: str

    def prepare(self, state: CycleState, endpoints: Sequence[Endpoint]) -> None:
        """Attach data for this request to ``state`` (e.g. ``state.prefix``)."""
        ...


@runtime_checkable
class RequestPreparer(Protocol):
    name: str

    def prepare_request(self, request: InferenceRequest) -> object | None:
        """Slow per-request work that needs no endpoint data (tokenizing a prompt). Runs in
        a worker thread before scheduling when the server can (``epp serve``), so it must be
        thread-safe and keep nothing itself: it returns its result, which the request carries
        to its cycle (``CycleState.data[name]``); ``prepare`` finds it there, or does the
        work itself when it was not run (the replay)."""
        ...


@runtime_checkable
class EndpointListener(Protocol):
    def observe_endpoint(self, endpoint: Endpoint) -> None:
        """The endpoint's metrics were refreshed (it may be new)."""
        ...

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        """The endpoint left the pool."""
        ...


@runtime_checkable
class Sweeper(Protocol):
    @property
    def sweep_interval_s(self) -> float:
        """How often it wants ``sweep`` called (the server and the replay take the shortest
        interval among the plugins)."""
        ...

    def sweep_steps(self, now_s: float) -> Iterator[int]:
        """Periodic cleanup, a bounded slice of work (~1k entries) per step; each step yields
        what it removed. The server runs the steps on the event loop one at a time and serves
        requests between them, so no step may be proportional to what the plugin holds; the
        replay runs them all at once."""
        ...


@dataclass(slots=True, frozen=True)
class PluginContext:
    """What the server hands a plugin's ``Lifecycle.start``."""

    spawn: Callable[[str, Callable[[], Awaitable[None]]], asyncio.Task[None]]
    """Run a long-lived loop under supervision (a failure is logged, counted in
    ``epp_background_task_failures_total{task}`` and the loop restarted with backoff); the
    server cancels it when it stops."""
    register: Callable[[Collector], None]
    """Add a Prometheus collector to epp's /metrics."""
    on_failure: Callable[[str], None]
    """Count a failure of kind ``kind`` in ``epp_background_task_failures_total``."""


@runtime_checkable
class Lifecycle(Protocol):
    name: str

    async def start(self, ctx: PluginContext) -> None:
        """Start background work; a raise fails the server's start with the error."""
        ...

    async def stop(self) -> None:
        """Stop it (called once, in reverse start order, after requests drained)."""
        ...
