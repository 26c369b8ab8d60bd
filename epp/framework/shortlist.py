"""The ``shortlist:`` config section: which candidates a profile's scorers see in a large
pool. A value type of the config; the profile that applies it is ``epp.scheduling.profile``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["ShortlistConfig"]


@dataclass(slots=True, frozen=True)
class ShortlistConfig:
    """The ``shortlist:`` config section."""

    enabled: bool = True
    """Score a shortlist when a profile has more than ``minCandidates`` candidates and every
    scorer it weighs nominates (false: every candidate is scored, at a cost that grows with
    the pool)."""
    min_candidates: int = 16
    """A profile with at most this many candidates (after its filters) scores every one."""
    per_scorer: int = 4
    """How many endpoints each scorer nominates (its best, by its own measure), and how many
    of the least-queued the profile adds to them."""

    __config_min__: ClassVar[dict[str, float]] = {"per_scorer": 1}
