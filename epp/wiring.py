"""Wiring: builds the plugins a config names and the scheduler that runs them.

The one module that knows both the config and the plugin registry; the command line, the
server and the simulator build schedulers through it and nowhere else.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TypeVar

from epp.config.loader import EppConfig
from epp.framework.interfaces import DataProducer, ProfileHandler
from epp.plugins.registry import (
    DECIDERS,
    FILTERS,
    HANDLERS,
    PICKERS,
    PRODUCERS,
    SCORERS,
    PluginType,
)
from epp.scheduling.profile import Profile, WeightedScorer
from epp.scheduling.scheduler import Scheduler

T = TypeVar("T")


def build_profile(cfg: EppConfig) -> Profile:
    """The config's (primary) profile, its filters, scorers and picker built from the
    registry."""
    return _build_profiles(cfg, {})[0]


def _build_profiles(cfg: EppConfig, built: dict[str, object]) -> list[Profile]:
    """Every profile of ``cfg``, the primary first. A plugin named by several profiles is
    built once (``built``: name -> instance) and shared."""
    specs = cfg.plugins

    def one(name: str, registry: Mapping[str, PluginType[T]]) -> T:
        if name not in built:
            built[name] = registry[specs[name].type].factory(name, specs[name].params)
        return built[name]  # type: ignore[return-value]

    profiles = []
    for p in (cfg.profile, *cfg.other_profiles):
        filters = [one(n, FILTERS) for n in p.filters]
        scorers = [WeightedScorer(one(n, SCORERS), w) for n, w in p.scorers]
        profiles.append(Profile(p.name, filters, scorers, one(p.picker, PICKERS), cfg.shortlist))
    return profiles


def _build_handler(cfg: EppConfig, built: dict[str, object]) -> ProfileHandler | None:
    if not cfg.handler:
        return None
    specs = cfg.plugins
    for name, spec in specs.items():
        if spec.kind == "decider":
            built[name] = DECIDERS[spec.type].factory(name, spec.params)
    spec = specs[cfg.handler]
    handler = HANDLERS[spec.type].factory(cfg.handler, spec.params)
    bind = getattr(handler, "bind", None)
    if bind is not None:
        bind(built)
    return handler


def build_producers(cfg: EppConfig) -> list[DataProducer]:
    specs = cfg.plugins
    return [PRODUCERS[specs[n].type].factory(n, specs[n].params) for n in cfg.producers]


def build_scheduler(
    cfg: EppConfig,
    rng: random.Random | None = None,
    *,
    producers: Sequence[DataProducer] | None = None,
) -> Scheduler:
    """A scheduler for ``cfg``. ``producers`` replaces the configured data producers (the
    simulator's oracle producer reads the emulated replicas' true caches)."""
    made = build_producers(cfg) if producers is None else list(producers)
    built: dict[str, object] = {}
    profiles = _build_profiles(cfg, built)
    handler = _build_handler(cfg, built)
    return Scheduler(profiles[0], made, rng or random.Random(), profiles=profiles[1:],
                     handler=handler)  # fmt: skip
