"""The Inference Extension's conformance hooks, as plugins of the shipped ``conformance``
profile (``epp serve --config conformance``) and of no other: with them a client chooses the
endpoint, which production traffic must never do.

* ``header-endpoint-selection-filter``: the request header ``test-epp-endpoint-selection``
  lists ``ip`` or ``ip:port`` entries, comma-separated; the filter keeps the endpoints they
  name, in that order (an ``ip`` alone names every port of that address). None named: no
  endpoint (the request gets 503). Header absent: every endpoint.
* ``first-picker``: takes the candidates in the order it gets them (the filter's order), so
  the first named endpoint is the target and the next ones the fallbacks.

The response header the suite reads back (``x-conformance-test-served-endpoint``) is set by
the request-control layer when ``requestControl.servedEndpointHeader`` names it (the profile
does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import Endpoint
from epp.framework.types import CycleState
from epp.plugins.pickers import PickerParams

SELECTION_HEADER = "test-epp-endpoint-selection"


@dataclass(slots=True, frozen=True)
class SelectionParams:
    header: str = SELECTION_HEADER
    """The request header listing the endpoints (ip or ip:port, comma-separated, in order)."""


class HeaderEndpointSelectionFilter:
    """Keep the endpoints the request header names, in the header's order."""

    def __init__(self, name: str, params: SelectionParams) -> None:
        self.name = name
        self.header = params.header.lower()

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        value = state.request.headers.get(self.header)
        if value is None:
            return endpoints
        kept: list[Endpoint] = []
        for entry in (e.strip() for e in value[:4096].split(",")):
            for e in endpoints:
                named = entry == f"{e.address}:{e.port}" or entry == e.address
                if named and e not in kept:
                    kept.append(e)
        return kept


class FirstPicker:
    """The candidates in the order given: the first is the target, the next the fallbacks."""

    def __init__(self, name: str, params: PickerParams) -> None:
        self.name = name

    def pick(
        self, state: CycleState, endpoints: Sequence[Endpoint], scores: Sequence[float], count: int
    ) -> list[Endpoint]:
        return list(endpoints[:count])
