"""Wiring: builds the plugins a config names and the scheduler that runs them.

The one module that knows both the config and the plugin registry; the command line, the
server and the simulator build schedulers through it and nowhere else.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from epp.config.loader import EppConfig
from epp.framework.interfaces import DataProducer
from epp.plugins.registry import FILTERS, PICKERS, PRODUCERS, SCORERS
from epp.scheduling.profile import Profile, WeightedScorer
from epp.scheduling.scheduler import Scheduler


def build_profile(cfg: EppConfig) -> Profile:
    """The config's profile, its filters, scorers and picker built from the registry."""
    specs = cfg.plugins
    p = cfg.profile
    filters = [FILTERS[specs[n].type].factory(n, specs[n].params) for n in p.filters]
    scorers = [
        WeightedScorer(SCORERS[specs[n].type].factory(n, specs[n].params), w) for n, w in p.scorers
    ]
    picker = PICKERS[specs[p.picker].type].factory(p.picker, specs[p.picker].params)
    return Profile(p.name, filters, scorers, picker)


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
    built = build_producers(cfg) if producers is None else list(producers)
    return Scheduler(build_profile(cfg), built, rng or random.Random())
