"""The scheduler: one entry point the request-control layer calls (in ``epp serve`` and in
``epp-sim replay`` alike).

``schedule`` runs the data producers (the prefix match), then the profile (filters ->
weighted scorers -> picker), or, with several profiles, the profile handler that runs them
(disaggregated serving: decode, then an optional prefill); ``commit`` runs the post-pick hooks (recording the pick);
``on_stored`` and ``on_response`` the response hooks. Which plugin implements which hook is
sorted out once, here, from the protocols in ``epp.framework.interfaces``. Plugins are built from the
config by ``epp.wiring``. Never blocks on I/O: endpoints and their metrics are values.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

from epp.errors import DROPPED_NO_ENDPOINTS, Unavailable
from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.interfaces import (
    DataProducer,
    EndpointListener,
    Lifecycle,
    PostFirstToken,
    PostPick,
    PostResponse,
    PostStored,
    ProfileHandler,
    RequestPreparer,
    Sweeper,
)
from epp.framework.pool import as_pool
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PickResult, ProfileResult, ProfileRun, ResponseInfo
from epp.scheduling.profile import Profile

P = TypeVar("P")


class Scheduler:
    def __init__(
        self,
        profile: Profile,
        producers: Sequence[DataProducer],
        rng: random.Random,
        *,
        profiles: Sequence[Profile] = (),
        handler: ProfileHandler | None = None,
    ) -> None:
        """``profile`` runs for every request, unless a ``handler`` is given: it then runs
        the ``profiles`` (by name; ``profile`` is its primary one) as it decides."""
        self.profile = profile
        self.profiles = {p.name: p for p in (profile, *profiles)}
        self.handler = handler
        if handler is not None:
            missing = [n for n in handler.profiles if n not in self.profiles]
            if missing:
                raise ValueError(f"{handler.name} runs profiles that are not built: {missing}")
        self.producers = tuple(producers)
        self.rng = rng
        plugins: list[object] = list(self.producers)
        seen: set[int] = {id(p) for p in plugins}
        for prof in self.profiles.values():  # a plugin shared by two profiles is hooked once
            for p in prof.plugins():
                if id(p) not in seen:
                    seen.add(id(p))
                    plugins.append(p)
        if handler is not None:
            plugins.append(handler)
            for p in getattr(handler, "bound", ()):  # its decider: hooked like the others
                if id(p) not in seen:
                    seen.add(id(p))
                    plugins.append(p)
        self.plugins = tuple(plugins)
        self._post_pick = [p for p in plugins if isinstance(p, PostPick)]
        self._post_response = [p for p in plugins if isinstance(p, PostResponse)]
        self._post_first_token = [p for p in plugins if isinstance(p, PostFirstToken)]
        self._post_stored = [p for p in plugins if isinstance(p, PostStored)]
        self._listeners = [p for p in plugins if isinstance(p, EndpointListener)]
        self._sweepers = [p for p in plugins if isinstance(p, Sweeper)]
        self._preparers = [p for p in self.producers if isinstance(p, RequestPreparer)]
        self.lifecycle = tuple(p for p in plugins if isinstance(p, Lifecycle))
        """Plugins with background work: the server starts and stops them."""

    @property
    def prepares(self) -> bool:
        """Some producer has per-request work worth running off the event loop."""
        return bool(self._preparers)

    def prepare_request(self, request: InferenceRequest) -> dict[str, object]:
        """The producers' request preparation (thread-safe; see ``RequestPreparer``): what
        each computed, by its name, for ``schedule(..., prepared=)``."""
        out: dict[str, object] = {}
        for p in self._preparers:
            value = p.prepare_request(request)
            if value is not None:
                out[p.name] = value
        return out

    def plugin(self, cls: type[P]) -> P | None:
        """The first plugin of the given class (e.g. the approximate prefix producer)."""
        for p in self.plugins:
            if isinstance(p, cls):
                return p
        return None

    def schedule(
        self,
        request: InferenceRequest,
        endpoints: Sequence[Endpoint],
        now_s: float,
        fallbacks: int = 0,
        *,
        commit: bool = True,
        in_flight: Mapping[EndpointId, int] | None = None,
        runs: list[ProfileRun] | None = None,
        prefill: Mapping[EndpointId, float] | None = None,
        prepared: Mapping[str, object] | None = None,
    ) -> PickResult:
        """Pick an endpoint (and up to ``fallbacks`` more) for ``request``.

        With ``commit`` (the default) the post-pick hooks run at once (the pick is recorded in
        the prefix index). ``commit=False`` leaves that to the caller's ``commit(result)``
        (the director commits before its reply: the next pick must see this one).
        ``in_flight``: the caller's requests in flight per endpoint, for plugins that read
        them (``CycleState.in_flight``); ``prefill``: its prefill in flight
        (``CycleState.prefill``); ``prepared``: what ``prepare_request`` returned for this
        request (it seeds ``CycleState.data``). ``runs``: a list each profile run is appended
        to (``ProfileRun``: filters' survivors, scorers' columns, the pick), also
        ``result.state.runs``; the caller keeps it when the filters leave none.
        Raises ``Unavailable`` when ``endpoints`` is empty or the filters leave none.
        """
        if not endpoints:
            raise Unavailable("no ready endpoint in the pool", "no-endpoints", DROPPED_NO_ENDPOINTS)
        endpoints = as_pool(endpoints)  # the datastore's is indexed; a plain list is scanned
        state = CycleState(request, now_s, self.rng)
        state.runs = runs
        if in_flight is not None:
            state.in_flight = in_flight
        if prefill is not None:
            state.prefill = prefill
        if prepared:
            state.data.update(prepared)
        t0 = time.perf_counter()
        for producer in self.producers:
            producer.prepare(state, endpoints)
        state.timings["prefix"] = time.perf_counter() - t0
        count = 1 + max(0, fallbacks)
        if self.handler is None:
            outcome = self.profile.run(state, endpoints, count)
            prefillers: tuple[Endpoint, ...] = ()
            decision = ""
        else:
            handled = self.handler.handle(state, endpoints, self._run_profile(state), count)
            outcome, prefillers, decision = handled.primary, handled.prefill, handled.decision
        if not outcome.targets:
            raise Unavailable("no endpoint passed the filters", "no-endpoints", DROPPED_NO_ENDPOINTS)
        result = PickResult(tuple(outcome.targets), state, outcome.candidates, outcome.totals,
                            prefillers, decision)  # fmt: skip
        if commit:
            self.commit(result)
        return result

    def _run_profile(self, state: CycleState) -> Callable[[str, Sequence[Endpoint], int], ProfileResult]:
        profiles = self.profiles

        def run(name: str, endpoints: Sequence[Endpoint], count: int) -> ProfileResult:
            return profiles[name].run(state, endpoints, count)

        return run

    def commit(self, result: PickResult) -> None:
        """Run the post-pick hooks of a ``schedule(..., commit=False)`` result."""
        for hook in self._post_pick:
            hook.post_pick(result.state, result)

    @property
    def wants_first_token(self) -> bool:
        return bool(self._post_first_token)

    def on_first_token(self, result: PickResult, ttft_s: float) -> None:
        for hook in self._post_first_token:
            hook.post_first_token(result.state, result, ttft_s)

    def on_stored(self, result: PickResult, ids: Sequence[str]) -> None:
        for hook in self._post_stored:
            hook.post_stored(result.state, result, ids)

    def on_response(self, result: PickResult, info: ResponseInfo) -> None:
        for hook in self._post_response:
            hook.post_response(result.state, result, info)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            listener.observe_endpoint(endpoint)

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        for listener in self._listeners:
            listener.remove_endpoint(endpoint_id)

    @property
    def sweep_interval_s(self) -> float:
        """The shortest interval a sweeper asks for (5 s when none sweeps)."""
        return min((s.sweep_interval_s for s in self._sweepers), default=5.0)

    def sweep(self, now_s: float) -> int:
        """Every sweeper's whole pass at once (the replay); returns what they removed."""
        return sum(self.sweep_steps(now_s))

    def sweep_steps(self, now_s: float) -> Iterator[int]:
        """The sweepers' passes, one bounded step at a time (``Sweeper.sweep_steps``)."""
        for s in self._sweepers:
            yield from s.sweep_steps(now_s)
