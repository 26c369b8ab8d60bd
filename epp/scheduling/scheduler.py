"""The scheduler: one entry point the request-control layer and the simulator call.

``schedule`` hashes the prompt, asks the prefix index what each candidate holds, runs the
profile (filters -> weighted scorers -> picker) and records the pick in the index (the
producer; scorers only read). ``on_response`` feeds what the response taught us back.
Never blocks on I/O: endpoints and their metrics are passed in as values.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from epp.config.loader import EppConfig, PluginSpec
from epp.datastore.endpoint import Endpoint, EndpointId
from epp.errors import Unavailable
from epp.plugins.registry import PLUGIN_TYPES
from epp.prefix.hasher import ChunkHasher
from epp.prefix.index import PrefixIndex
from epp.prefix.producer import PrefixProducer
from epp.request.types import InferenceRequest
from epp.scheduling.profile import Profile, WeightedScorer
from epp.scheduling.types import CycleState, PickResult, ResponseInfo


def build_plugin(spec: PluginSpec) -> object:
    return PLUGIN_TYPES[spec.type].factory(spec.name, spec.params)


def build_profile(cfg: EppConfig) -> Profile:
    built = {name: build_plugin(spec) for name, spec in cfg.plugins.items()}
    p = cfg.profile
    return Profile(
        p.name,
        filters=[built[n] for n in p.filters],  # type: ignore[misc]
        scorers=[WeightedScorer(built[n], w) for n, w in p.scorers],  # type: ignore[arg-type]
        picker=built[p.picker],  # type: ignore[arg-type]
    )


class Scheduler:
    def __init__(self, profile: Profile, producer: PrefixProducer, rng: random.Random) -> None:
        self.profile = profile
        self.producer = producer
        self.index = producer.index
        self.rng = rng

    @classmethod
    def from_config(cls, cfg: EppConfig, rng: random.Random | None = None) -> Scheduler:
        pc = cfg.prefix
        index = PrefixIndex(
            capacity_chunks=pc.capacity_per_endpoint_chunks,
            max_entries=pc.max_entries,
            ttl_s=pc.ttl_seconds,
        )
        producer = PrefixProducer(
            ChunkHasher(pc.block_chars, pc.max_chunks),
            index,
            chars_per_token=pc.chars_per_token,
            learn_from_responses=pc.learn_from_responses,
        )
        return cls(build_profile(cfg), producer, rng or random.Random())

    def schedule(
        self,
        request: InferenceRequest,
        endpoints: Sequence[Endpoint],
        now_s: float,
        fallbacks: int = 0,
        *,
        commit: bool = True,
    ) -> PickResult:
        """Pick an endpoint (and up to ``fallbacks`` more) for ``request``.

        With ``commit`` (the default) the post-pick hooks run at once (the pick is recorded in
        the prefix index). A server may pass ``commit=False`` and call ``commit(result)``
        once its reply is on the wire, taking that work off the request's critical path.
        Raises ``Unavailable`` when ``endpoints`` is empty or the filters leave none.
        """
        if not endpoints:
            raise Unavailable("no ready endpoint in the pool")
        state = CycleState(request, now_s, self.rng)
        t0 = time.perf_counter()
        self.producer.prepare(state, endpoints)
        state.timings["prefix"] = time.perf_counter() - t0
        outcome = self.profile.run(state, endpoints, 1 + max(0, fallbacks))
        if not outcome.targets:
            raise Unavailable("no endpoint passed the filters")
        result = PickResult(tuple(outcome.targets), state, outcome.candidates, outcome.totals)
        if commit:
            self.producer.post_pick(state, result)
        return result

    def commit(self, result: PickResult) -> None:
        """Run the post-pick hooks of a ``schedule(..., commit=False)`` result."""
        self.producer.post_pick(result.state, result)

    def on_response(self, result: PickResult, info: ResponseInfo) -> None:
        self.producer.post_response(result.state, result, info)

    def observe_endpoint(self, endpoint: Endpoint) -> None:
        self.producer.observe_endpoint(endpoint)

    def remove_endpoint(self, endpoint_id: EndpointId) -> None:
        self.producer.remove_endpoint(endpoint_id)

    def sweep(self, now_s: float) -> int:
        return self.index.sweep(now_s)
