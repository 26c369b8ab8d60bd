"""``--sweep param=v1,v2,...``: replay once per value, one line per (value, policy).

Parameters: ``rate`` (requests/s; a time scale for traces), ``time_scale`` (traces),
``replicas``, ``kv_blocks``, ``block_size``, ``scrape_interval_s``, and
``weight.<scorer>`` (a weight of the epp config's profile, e.g. ``weight.queue-scorer``;
applies to ``epp`` and ``precise``, which are built from that config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from epp.config.loader import EppConfig
from simulator.replay.replayer import ReplayConfig
from simulator.replay.workload import Workload, scaled_rate

_CONFIG_FIELDS = {
    "replicas": ("replicas", int),
    "kv_blocks": ("kv_blocks", int),
    "block_size": ("block_size_tokens", int),
    "scrape_interval_s": ("scrape_interval_s", float),
    "scrape_interval": ("scrape_interval_s", float),  # the old spelling, for one release
}


@dataclass(slots=True, frozen=True)
class SweepSpec:
    param: str
    values: tuple[str, ...]


def parse_sweep(text: str) -> SweepSpec:
    param, sep, values = text.partition("=")
    param = param.strip().replace("-", "_") if not param.startswith("weight.") else param.strip()
    vals = tuple(v.strip() for v in values.split(",") if v.strip())
    if not sep or not vals:
        raise ValueError(f"--sweep expects param=v1,v2,... got {text!r}")
    known = {"rate", "time_scale", *_CONFIG_FIELDS}
    if param not in known and not param.startswith("weight."):
        raise ValueError(f"cannot sweep {param!r} (known: {', '.join(sorted(known))}, weight.<scorer>)")
    return SweepSpec(param, vals)


@dataclass(slots=True, frozen=True)
class SweepPoint:
    label: str
    workload: Workload
    config: ReplayConfig
    epp_config: EppConfig


def with_weight(cfg: EppConfig, scorer: str, weight: float) -> EppConfig:
    names = [n for n, _ in cfg.profile.scorers]
    if scorer not in names:
        raise ValueError(f"the epp profile has no scorer {scorer!r} (has: {', '.join(names)})")
    scorers = tuple((n, weight if n == scorer else w) for n, w in cfg.profile.scorers)
    return dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, scorers=scorers))


def sweep_points(
    spec: SweepSpec, workload: Workload, config: ReplayConfig, epp_config: EppConfig
) -> list[SweepPoint]:
    points: list[SweepPoint] = []
    for raw in spec.values:
        label = f"{spec.param}={raw}"
        w, c, e = workload, config, epp_config
        value: Any
        if spec.param == "rate":
            w = scaled_rate(workload, _sweep_value(spec.param, raw, float, positive=True))
        elif spec.param == "time_scale":
            rescale = getattr(workload, "with_time_scale", None)
            if rescale is None:
                raise ValueError("time_scale applies to traces; use rate for generators")
            w = rescale(_sweep_value(spec.param, raw, float, positive=True))
        elif spec.param.startswith("weight."):
            e = with_weight(epp_config, spec.param.removeprefix("weight."), _sweep_value(spec.param, raw, float))
        else:
            field_name, typ = _CONFIG_FIELDS[spec.param]
            value = _sweep_value(spec.param, raw, typ)
            c = dataclasses.replace(config, **{field_name: value})
        points.append(SweepPoint(label, w, c, e))
    return points


def _sweep_value(param: str, raw: str, typ: Any, positive: bool = False) -> Any:
    try:
        value = typ(raw)
    except ValueError:
        kind = "an integer" if typ is int else "a number"
        raise ValueError(f"--sweep {param}: {raw!r} is not {kind}") from None
    if positive and value <= 0:
        raise ValueError(f"--sweep {param}: must be > 0, got {raw}")
    if value < 0:
        raise ValueError(f"--sweep {param}: must not be negative, got {raw}")
    return value
