"""Endpoint roles for disaggregated serving, and the filters that keep each role.

An endpoint's role is its ``llm-d.ai/role`` label (llm-d's convention, so pools labelled for
llm-d's router work unchanged): ``prefill``, ``decode``, or one that does both
(``prefill-decode``, and the deprecated ``both``); the encode variants
(``encode-prefill``, ``encode-prefill-decode``...) count for the stages they name. An
endpoint without the label does both. Static endpoints carry it as ``role:`` (or in
``labels``), pods as a label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.framework.endpoint import ROLE_LABEL, Endpoint
from epp.framework.types import CycleState

BOTH_ROLES = "prefill-decode"
_ALIASES = {"both": BOTH_ROLES}


def stages(role: str | None) -> frozenset[str]:
    """The stages (``prefill``, ``decode``) an endpoint with this role label serves."""
    if role is None or not role.strip():
        return frozenset({"prefill", "decode"})
    role = _ALIASES.get(role.strip(), role.strip())
    return frozenset(part for part in role.split("-") if part in ("prefill", "decode"))


@dataclass(slots=True, frozen=True)
class RoleFilterParams:
    label: str = ROLE_LABEL
    """The label that carries the role (another key for pools labelled their own way)."""


class _RoleFilter:
    stage = ""

    def __init__(self, name: str, params: RoleFilterParams) -> None:
        self.name = name
        self.label = params.label

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        label, stage = self.label, self.stage
        return [e for e in endpoints if stage in stages(e.labels.get(label))]


class PrefillFilter(_RoleFilter):
    """Keep the endpoints that may prefill (role prefill, prefill-decode, or none); may
    leave none, and the handler then serves the request on the decoder alone."""

    stage = "prefill"


class DecodeFilter(_RoleFilter):
    """Keep the endpoints that may decode (role decode, prefill-decode, or none)."""

    stage = "decode"
