"""Load and validate the scheduling config (YAML).

Format (an ``EndpointPickerConfig``, as the Gateway API Inference Extension uses)::

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:                      # instances: a type, an optional name, parameters
    - type: prefix-cache-scorer
      parameters: {minMatchChunks: 1}
    - type: max-score-picker
    schedulingProfiles:           # one profile, referring to instances by name (several
                                  # with a profile handler: disaggregated serving)
    - name: default
      plugins:
      - pluginRef: prefix-cache-scorer
        weight: 3
      - pluginRef: max-score-picker
    prefixIndex: {...}            # optional, see PrefixIndexConfig
    saturation: {...}             # optional, see SaturationConfig
    shortlist: {...}              # optional, see ShortlistConfig
    scraping: {intervalSeconds: 1} # optional, see ScrapingConfig (default 0.2)

Filters run in the order the profile lists them; scorers need a ``weight``; exactly one
picker; data producers (``approx-prefix-cache-producer``) run for every request and are not
referenced by the profile. With more than one profile, exactly one profile handler
(``disagg-profile-handler``) names which profile is primary and which deciders it asks; deciders
and handlers are not referenced by profiles either. Parameter names are camelCase in YAML (snake_case is accepted too).
Sections and parameters are validated by pydantic (``epp.schema``, strict: no silent
coercion), and every error names the field, e.g.
``config field 'plugins[2].parameters.minMatchChunks': expected an integer, got true``.
The document is parsed once: ``requestControl`` and ``staticEndpoints`` are parsed here too,
into ``EppConfig.request_control`` and ``EppConfig.static_endpoints``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from epp import schema
from epp.datastore.scraper import ScrapingConfig
from epp.datastore.static import endpoints_from_config
from epp.errors import ConfigError
from epp.flowcontrol.controller import FlowControlConfig
from epp.framework.endpoint import Endpoint
from epp.framework.saturation import SaturationConfig
from epp.framework.shortlist import ShortlistConfig
from epp.plugins.registry import DEFAULT_PRODUCERS, PLUGIN_TYPES
from epp.request.settings import RequestControlConfig, parse_request_control

__all__ = ["EppConfig", "PluginSpec", "ProfileSpec", "SaturationConfig", "ShortlistConfig",
           "default_config", "load_config", "loads_config", "parse_config", "shipped_config"]


@dataclass(slots=True, frozen=True)
class PluginSpec:
    name: str
    type: str
    kind: str
    params: Any


@dataclass(slots=True, frozen=True)
class ProfileSpec:
    name: str
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str


@dataclass(slots=True, frozen=True)
class EppConfig:
    plugins: Mapping[str, PluginSpec]
    profile: ProfileSpec
    """The primary profile: the only one, or the one the handler routes with."""
    other_profiles: tuple[ProfileSpec, ...] = ()
    """With a profile handler: the profiles it may run besides the primary one."""
    handler: str = ""
    """The profile handler's plugin name, when the config has several profiles."""
    producers: tuple[str, ...] = ()
    """Data producers (by plugin name): they run for every request, before the profile."""
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    shortlist: ShortlistConfig = field(default_factory=ShortlistConfig)
    """The ``shortlist`` section: which candidates a profile scores in a large pool."""
    scraping: ScrapingConfig = field(default_factory=ScrapingConfig)
    """The ``scraping`` section: the scrape period this profile wants, and the share of a server's time its scrapes may take."""
    request_control: RequestControlConfig = field(default_factory=RequestControlConfig)
    """The ``requestControl`` section."""
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    """The ``flowControl`` section (off by default)."""
    static_endpoints: tuple[Endpoint, ...] = ()
    """The ``staticEndpoints`` section."""
    raw: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<default>"


log = logging.getLogger(__name__)

_SECTIONS = {pt.section: pt for pt in PLUGIN_TYPES.values() if pt.section}
"""Top-level sections that give a plugin type's parameters (``prefixIndex``)."""
_KNOWN_TOP = {"apiVersion", "kind", "plugins", "schedulingProfiles", "saturation",
              "flowControl", "scraping", "shortlist", *_SECTIONS}
_OTHER_LAYERS = {"requestControl", "staticEndpoints"}
"""Top-level sections read by other layers (``epp.request.settings``,
``epp.datastore.static``) from ``EppConfig.raw``."""

SHIPPED = ("default", "prefix-load", "predicted-blend", "filter-chain", "predicted-ttft", "cache-aware",
           "conformance", "pd", "agentic", "sticky")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _coerce_weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(where, f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(where, f"expected a finite number, got {value!r}")
    return float(value)


build_params = schema.build
"""A frozen parameter dataclass from a YAML mapping, naming any bad field (pydantic)."""


def parse_config(data: Any, source: str = "<config>") -> EppConfig:
    data = _top_level(data, source)
    plugins = _plugins(data)
    producers = _producers(plugins, data, source)
    profile, others, handler = _profiles(data.get("schedulingProfiles"), plugins)
    for section, pt in _SECTIONS.items():  # validated even when no plugin uses it
        _checked(build_params(pt.params, data.get(section), section), section)
    saturation = build_params(SaturationConfig, data.get("saturation"), "saturation")
    shortlist = build_params(ShortlistConfig, data.get("shortlist"), "shortlist")
    scraping = build_params(ScrapingConfig, data.get("scraping"), "scraping")
    _check_scraping(scraping, saturation)
    return EppConfig(
        plugins=plugins,
        profile=profile,
        other_profiles=others,
        handler=handler,
        producers=producers,
        saturation=saturation,
        shortlist=shortlist,
        scraping=scraping,
        request_control=parse_request_control(data),
        flow_control=build_params(FlowControlConfig, data.get("flowControl"), "flowControl"),
        static_endpoints=tuple(endpoints_from_config(data)),
        raw=dict(data),
        source=source,
    )


def _top_level(data: Any, source: str) -> Mapping[str, Any]:
    """The document's mapping, with the shipped default profile when it names none."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", "expected a mapping at the top level")
    kind = data.get("kind", "EndpointPickerConfig")
    if kind != "EndpointPickerConfig":
        raise ConfigError("kind", f"expected EndpointPickerConfig, got {kind!r}")
    for key in data:
        if key not in _KNOWN_TOP and key not in _OTHER_LAYERS:
            # A warning, not an error: configs written for the Go EPP carry sections epp
            # does not implement. A misspelt section is still visible at start-up.
            log.warning(
                "config %s: unknown top-level section %r ignored (known: %s)",
                source, key, ", ".join(sorted(_KNOWN_TOP | _OTHER_LAYERS)),
            )
    if "plugins" not in data and "schedulingProfiles" not in data:
        # A config that only sets other sections (prefixIndex, requestControl, ...) keeps the
        # shipped default scheduling profile.
        default = yaml.safe_load(shipped_text("default"))
        return {**data, "plugins": default["plugins"],
                "schedulingProfiles": default["schedulingProfiles"]}  # fmt: skip
    if "plugins" not in data:
        raise ConfigError("plugins", "missing: schedulingProfiles refers to plugins listed here")
    return data


def _plugins(data: Mapping[str, Any]) -> dict[str, PluginSpec]:
    raw_plugins = data.get("plugins", [])
    if not isinstance(raw_plugins, list) or not raw_plugins:
        raise ConfigError("plugins", "expected a non-empty list of plugins")
    plugins: dict[str, PluginSpec] = {}
    for i, item in enumerate(raw_plugins):
        where = f"plugins[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(where, "expected a mapping with 'type'")
        ptype = item.get("type")
        if ptype not in PLUGIN_TYPES:
            known = ", ".join(sorted(PLUGIN_TYPES))
            raise ConfigError(f"{where}.type", f"unknown plugin type {ptype!r} (known: {known})")
        extra = set(item) - {"type", "name", "parameters"}
        if extra:
            raise ConfigError(f"{where}.{min(extra)}", "unknown key (use type, name, parameters)")
        name = item.get("name", ptype)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name", "expected a non-empty string")
        if name in plugins:
            raise ConfigError(f"{where}.name", f"duplicate plugin name {name!r}")
        pt = PLUGIN_TYPES[ptype]
        raw_params = item.get("parameters")
        if pt.section:  # the type's section, overridden by these
            raw_params = _merged(data.get(pt.section), raw_params, f"{where}.parameters")
        params = _checked(build_params(pt.params, raw_params, f"{where}.parameters"),
                          f"{where}.parameters")  # fmt: skip
        plugins[name] = PluginSpec(name, ptype, pt.kind, params)
    return plugins


def _producers(
    plugins: dict[str, PluginSpec], data: Mapping[str, Any], source: str
) -> tuple[str, ...]:
    """The data producers, in the order they run: every producer after those providing what
    it reads. The producer the registry names as the default for some data is added (to
    ``plugins`` too, its parameters from its section) when a plugin reads that data and no
    configured producer provides it."""
    producers = [n for n, sp in plugins.items() if sp.kind == "producer"]
    pending = list(plugins.values())
    while pending:  # an added producer may read data of its own
        sp = pending.pop(0)
        for data_key in PLUGIN_TYPES[sp.type].reads(sp.params):
            if any(data_key in _provides(plugins[n]) for n in producers):
                continue
            ptype = DEFAULT_PRODUCERS[data_key]
            pt = PLUGIN_TYPES[ptype]
            where = pt.section or ptype
            # the usual case, by design (as llm-d registers default producers by the data
            # they produce): debug, so a shipped config starts without a line that reads
            # like a warning
            log.debug("config %s: %s reads %s, which %s produces (settings: %s)",
                      source, sp.name, data_key, ptype, where)  # fmt: skip
            params = _checked(build_params(pt.params, data.get(pt.section), where), where)
            added = PluginSpec(ptype, ptype, "producer", params)
            plugins[ptype] = added
            producers.append(ptype)
            pending.append(added)
    ordered: list[str] = []
    while producers:  # next: the first producer that reads nothing a remaining one provides
        ready = next((n for n in producers if not _waits(plugins[n], producers, plugins)),
                     producers[0])  # fmt: skip
        producers.remove(ready)
        ordered.append(ready)
    return tuple(ordered)


def _waits(spec: PluginSpec, producers: list[str], plugins: Mapping[str, PluginSpec]) -> bool:
    reads = set(PLUGIN_TYPES[spec.type].reads(spec.params))
    return any(reads & _provides(plugins[m]) for m in producers if m != spec.name)


def _provides(spec: PluginSpec) -> set[str]:
    return set(PLUGIN_TYPES[spec.type].provides)


def _checked(params: Any, where: str) -> Any:
    """Run the parameters' own ``check(where)`` (rules the field types cannot say)."""
    check = getattr(params, "check", None)
    if check is not None:
        check(where)
    return params


def _profiles(
    profiles: Any, plugins: Mapping[str, PluginSpec]
) -> tuple[ProfileSpec, tuple[ProfileSpec, ...], str]:
    """The primary profile, the others, and the handler's name ("" with one profile)."""
    if not isinstance(profiles, list) or not profiles:
        raise ConfigError("schedulingProfiles", "expected a non-empty list of profiles")
    specs: dict[str, ProfileSpec] = {}
    for i, prof in enumerate(profiles):
        spec = _profile(prof, plugins, f"schedulingProfiles[{i}]", len(profiles) == 1)
        if spec.name in specs:
            raise ConfigError(f"schedulingProfiles[{i}].name", f"duplicate profile name {spec.name!r}")
        specs[spec.name] = spec
    handlers = [sp for sp in plugins.values() if sp.kind == "handler"]
    if len(handlers) > 1:
        raise ConfigError("plugins", f"more than one profile handler: {', '.join(h.name for h in handlers)}")
    if not handlers:
        if len(specs) > 1:
            raise ConfigError("schedulingProfiles", "several profiles need a profile handler "
                              "in 'plugins' (e.g. disagg-profile-handler) to choose between them")
        return next(iter(specs.values())), (), ""
    handler = handlers[0]
    where = f"plugin {handler.name!r} parameters"
    names = handler.params.profile_names()
    for name in names:
        if name not in specs:
            raise ConfigError(where, f"names profile {name!r}, which schedulingProfiles does not define "
                              f"(defined: {', '.join(specs)})")
    for name, kind in handler.params.plugin_refs():
        ref = plugins.get(name)
        if ref is None or ref.kind != kind:
            raise ConfigError(where, f"names {kind} {name!r}, which 'plugins' does not list as a {kind}")
    unused = [n for n in specs if n not in names]
    if unused:
        raise ConfigError("schedulingProfiles", f"profile(s) {', '.join(unused)} not run by {handler.name}")
    return specs[names[0]], tuple(specs[n] for n in names[1:]), handler.name


def _profile(prof: Any, plugins: Mapping[str, PluginSpec], at: str, only: bool) -> ProfileSpec:
    if not isinstance(prof, Mapping):
        raise ConfigError(at, "expected a mapping")
    if not only and not isinstance(prof.get("name"), str):
        raise ConfigError(f"{at}.name", "each of several profiles needs a name")
    refs = prof.get("plugins")
    if not isinstance(refs, list) or not refs:
        raise ConfigError(f"{at}.plugins", "expected a non-empty list")
    filters: list[str] = []
    scorers: list[tuple[str, float]] = []
    pickers: list[str] = []
    for j, ref in enumerate(refs):
        where = f"{at}.plugins[{j}]"
        spec = _ref(ref, plugins, where)
        if spec.kind == "scorer":
            weight = _coerce_weight(ref.get("weight", 1), f"{where}.weight")
            if weight < 0:
                raise ConfigError(f"{where}.weight", f"must not be negative, got {weight}")
            scorers.append((spec.name, weight))
        elif "weight" in ref:
            raise ConfigError(f"{where}.weight", f"{spec.type} is a {spec.kind}; only scorers take a weight")
        elif spec.kind == "filter":
            filters.append(spec.name)
        else:
            if pickers:
                raise ConfigError(f"{where}.pluginRef", f"a second picker {spec.name!r}; a profile has one")
            pickers.append(spec.name)
    if not pickers:
        raise ConfigError(f"{at}.plugins", "no picker (add e.g. max-score-picker)")
    return ProfileSpec(str(prof.get("name", "default")), tuple(filters), tuple(scorers), pickers[0])


def _ref(ref: Any, plugins: Mapping[str, PluginSpec], where: str) -> PluginSpec:
    if not isinstance(ref, Mapping) or "pluginRef" not in ref:
        raise ConfigError(where, "expected a mapping with 'pluginRef'")
    name = ref["pluginRef"]
    spec = plugins.get(name)
    if spec is None:
        raise ConfigError(f"{where}.pluginRef", f"no plugin named {name!r} in 'plugins'")
    if spec.kind == "producer":
        raise ConfigError(
            f"{where}.pluginRef",
            f"{name!r} is a data producer: producers run for every request, list them "
            "under 'plugins' only",
        )
    if spec.kind in ("decider", "handler"):
        raise ConfigError(
            f"{where}.pluginRef",
            f"{name!r} is a {spec.kind}: the profile handler uses it, list it under 'plugins' only",
        )
    return spec


def _merged(section: Any, params: Any, where: str) -> Any:
    if section is None:
        return params
    if params is None:
        return section
    if not isinstance(section, Mapping):
        return section  # build_params names the field
    if not isinstance(params, Mapping):
        return params
    return {**section, **params}


def _check_scraping(scraping: ScrapingConfig, saturation: SaturationConfig) -> None:
    interval = scraping.interval_seconds
    if interval <= 0:
        raise ConfigError("scraping.intervalSeconds", "must be positive")
    if interval >= saturation.metrics_staleness_seconds:
        raise ConfigError(
            "scraping.intervalSeconds",
            f"{interval:g} s is not shorter than saturation.metricsStalenessSeconds "
            f"({saturation.metrics_staleness_seconds:g} s): every endpoint would look stale "
            "between two scrapes",
        )
    if not 0 <= scraping.server_share < 1:
        raise ConfigError("scraping.serverShare", f"must be in [0, 1), got {scraping.server_share:g}")


def load_config(path: str | Path) -> EppConfig:
    """Read a config file; a shipped profile name (``SHIPPED``) works too."""
    text_path = Path(path)
    if not text_path.exists() and str(path) in SHIPPED:
        return shipped_config(str(path))
    try:
        text = text_path.read_text(encoding="utf-8")
    except OSError as exc:
        hint = "" if text_path.suffix or text_path.parent != Path(".") else (
            f" (nor is it a shipped profile: {', '.join(SHIPPED)})")
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}{hint}") from None
    return loads_config(text, str(path))


def loads_config(text: str, source: str = "<config>") -> EppConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        detail = str(exc).replace('"<unicode string>"', source)
        raise ConfigError("<yaml>", f"{source} is not valid YAML: {detail}") from None
    return parse_config(data, source)


def shipped_config(name: str) -> EppConfig:
    if name not in SHIPPED:
        raise ConfigError("--config", f"no shipped config {name!r} (shipped: {', '.join(SHIPPED)})")
    return loads_config(shipped_text(name), f"shipped:{name}")


def shipped_text(name: str) -> str:
    """The YAML text of a shipped profile (``SHIPPED``)."""
    return resources.files("epp.config").joinpath(f"profiles/{name}.yaml").read_text("utf-8")


def default_config() -> EppConfig:
    return shipped_config("default")
