"""Extension points of the scheduling pipeline.

A profile runs its filters in order, then every weighted scorer over the survivors, then one
picker. Scorers return one score in [0, 1] per endpoint, aligned with the list they were given;
a scorer that lacks data for an endpoint returns a neutral score and never raises. Plugins that
need to hear about the outcome implement ``PostPick`` (after the pick, e.g. recording the
request's chunks in the prefix index) or ``PostResponse`` (when the response is complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from epp.datastore.endpoint import Endpoint
from epp.scheduling.types import CycleState, PickResult, ResponseInfo


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
class Picker(Protocol):
    name: str

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        """Up to ``count`` endpoints, best first: the target, then fallbacks."""
        ...


@runtime_checkable
class PostPick(Protocol):
    name: str

    def post_pick(self, state: CycleState, result: PickResult) -> None: ...


@runtime_checkable
class PostResponse(Protocol):
    name: str

    def post_response(self, state: CycleState, result: PickResult, info: ResponseInfo) -> None: ...
