"""The pools behind one gateway and the adapters of their models: the ``--pool`` flag, the
``--pools`` YAML file and the adapter lists (the llm-d payload processor's ConfigMap format),
shared by ``epp envoy-config`` and ``epp model-router``.

``--pool NAME=MODEL[,MODEL...]@ADDR[,ADDR...]`` (repeated, one per pool): the pool's base
models (requests for them and their LoRA adapters go to it) and its model servers,
``host:port`` (a DNS name stands for all its records, e.g. a headless Service).

The file::

    pools:
    - name: chat
      models: [meta-llama/Llama-3.1-8B-Instruct]
      servers: [10.0.0.11:8000, 10.0.0.12:8000]
      epp: [10.0.1.5:9002]              # epp envoy-config only: this pool's epp
    - name: coder
      models: [Qwen/Qwen2.5-Coder-7B-Instruct]
      servers: [vllm-coder.default.svc.cluster.local:8000]
      epp: [epp-coder.default.svc.cluster.local:9002]
    adapters:                           # LoRA adapter -> base model, as IPP's ConfigMaps say
    - baseModel: meta-llama/Llama-3.1-8B-Instruct
      adapters: [sql-lora, support-lora]

Errors are ``ConfigError`` naming the flag or the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from epp.envoyconfig import POOL_NAME, PoolRoute, split_host_port
from epp.errors import ConfigError
from epp.schema import STRICT, validate

MAX_POOLS = 64
MAX_MODEL_CHARS = 256
"""A model or adapter name longer than this is refused (vLLM's served names are far shorter)."""


@dataclass(slots=True, frozen=True)
class AdapterSet:
    """The payload processor's ConfigMap ``data.config``: ``{baseModel, adapters}``."""

    base_model: str
    adapters: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class Pools:
    """What ``--pool`` / ``--pools`` configured."""

    pools: tuple[PoolRoute, ...]
    adapters: tuple[AdapterSet, ...] = ()

    def adapter_map(self) -> dict[str, str]:
        """Adapter -> base model, the first listing of an adapter winning."""
        out: dict[str, str] = {}
        for entry in self.adapters:
            for name in entry.adapters:
                out.setdefault(name, entry.base_model)
        return out


Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_MODEL_CHARS)]


class _AdapterSet(BaseModel):
    model_config = STRICT
    base_model: Name
    adapters: list[Name] = Field(default_factory=list, max_length=10_000)


class _Pool(BaseModel):
    model_config = STRICT
    name: Annotated[str, StringConstraints(pattern=POOL_NAME.pattern)]
    models: list[Name] = Field(min_length=1, max_length=1000)
    servers: list[str] = Field(default_factory=list, max_length=10_000)
    epp: list[str] = Field(default_factory=list, max_length=64)


class _File(BaseModel):
    model_config = STRICT
    pools: list[_Pool] = Field(min_length=1, max_length=MAX_POOLS)
    adapters: list[_AdapterSet] = Field(default_factory=list, max_length=10_000)


def parse_pool_flag(text: str, flag: str = "--pool") -> PoolRoute:
    """``NAME=MODEL[,MODEL...]@ADDR[,ADDR...]`` -> a pool (its epp left empty)."""
    name, eq, rest = text.strip().partition("=")
    models, at, servers = rest.partition("@")
    if not eq or not at:
        raise ConfigError(flag, f"{text!r} is not NAME=MODEL[,MODEL...]@HOST:PORT[,HOST:PORT...]")
    name = name.strip()
    if not POOL_NAME.match(name):
        raise ConfigError(flag, f"pool name {name!r}: lower-case letters, digits and '-' (a DNS label)")
    names = tuple(m.strip() for m in models.split(",") if m.strip())
    if not names:
        raise ConfigError(flag, f"pool {name!r}: name the base models it serves before '@'")
    for m in names:
        _check_model(m, flag)
    addrs = _addresses(servers, f"{flag} {name}")
    if not addrs:
        raise ConfigError(flag, f"pool {name!r}: list its servers after '@'")
    return PoolRoute(name, names, addrs)


def parse_adapter_flag(text: str, flag: str = "--adapters") -> AdapterSet:
    """``BASE=ADAPTER[,ADAPTER...]`` -> the adapters of one base model."""
    base, eq, rest = text.strip().partition("=")
    adapters = tuple(a.strip() for a in rest.split(",") if a.strip())
    if not eq or not base.strip() or not adapters:
        raise ConfigError(flag, f"{text!r} is not BASE_MODEL=ADAPTER[,ADAPTER...]")
    _check_model(base.strip(), flag)
    for a in adapters:
        _check_model(a, flag)
    return AdapterSet(base.strip(), adapters)


def parse_epp_flag(text: str, flag: str = "--epp") -> tuple[str, tuple[str, ...]]:
    """``NAME=HOST:PORT[,HOST:PORT...]``: a pool's epp replicas."""
    name, eq, rest = text.strip().partition("=")
    if not eq:
        raise ConfigError(flag, f"{text!r} is not NAME=HOST:PORT (one per pool, with several pools)")
    addrs = _addresses(rest, f"{flag} {name.strip()}")
    if not addrs:
        raise ConfigError(flag, f"{text!r}: no address after '='")
    return name.strip(), addrs


def load_pools_file(path: str | Path) -> Pools:
    """The ``--pools`` YAML file, checked (``ConfigError`` names the field)."""
    import yaml

    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--pools", f"cannot read {where}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("--pools", f"{where} is not YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError("--pools", f"{where}: expected a mapping with 'pools'")
    parsed: _File = validate(_File, dict(raw), where)
    pools = []
    for i, p in enumerate(parsed.pools):
        field = f"{where}: pools[{i}]"
        pools.append(PoolRoute(p.name, tuple(p.models), _addresses(",".join(p.servers), f"{field}.servers"),
                               _addresses(",".join(p.epp), f"{field}.epp")))  # fmt: skip
    adapters = tuple(AdapterSet(a.base_model, tuple(a.adapters)) for a in parsed.adapters)
    return check_pools(Pools(tuple(pools), adapters), "--pools")


def from_flags(
    pool_flags: Sequence[str], adapter_flags: Sequence[str] = (), epp_flags: Sequence[str] = (),
    pools_file: str = "",
) -> Pools | None:  # fmt: skip
    """The pools of ``--pool NAME=...`` (repeated) or ``--pools FILE``, plus ``--adapters``
    and, for envoy-config, ``--epp NAME=...``; None when neither names a pool."""
    if pools_file and pool_flags:
        raise ConfigError("--pools", "give --pools FILE or --pool NAME=..., not both")
    if pools_file:
        loaded = load_pools_file(pools_file)
    elif pool_flags:
        loaded = Pools(tuple(parse_pool_flag(t) for t in pool_flags))
    else:
        if adapter_flags:
            raise ConfigError("--adapters", "adapters belong to the models of --pool/--pools")
        return None
    adapters = loaded.adapters + tuple(parse_adapter_flag(t) for t in adapter_flags)
    pools = loaded.pools
    if epp_flags:
        epps = dict(parse_epp_flag(t) for t in epp_flags)
        unknown = set(epps) - {p.name for p in pools}
        if unknown:
            raise ConfigError("--epp", f"no pool named {', '.join(sorted(unknown))}")
        pools = tuple(PoolRoute(p.name, p.models, p.servers, epps.get(p.name, p.epp)) for p in pools)
    return check_pools(Pools(pools, adapters), "--pool")


def check_pools(pools: Pools, flag: str) -> Pools:
    """Unique pool names, each base model in one pool, adapters of known base models."""
    if len(pools.pools) > MAX_POOLS:
        raise ConfigError(flag, f"{len(pools.pools)} pools; at most {MAX_POOLS}")
    names: set[str] = set()
    owner: dict[str, str] = {}
    for p in pools.pools:
        if p.name in names:
            raise ConfigError(flag, f"pool {p.name!r} is named twice")
        names.add(p.name)
        for m in p.models:
            if m in owner:
                raise ConfigError(flag, f"model {m!r} is in pools {owner[m]!r} and {p.name!r}: a "
                                  "request for it must have one pool")  # fmt: skip
            owner[m] = p.name
    for entry in pools.adapters:
        if entry.base_model not in owner:
            raise ConfigError("adapters", f"base model {entry.base_model!r} is in no pool "
                              f"(pools serve {', '.join(sorted(owner))})")  # fmt: skip
        for a in entry.adapters:
            if a in owner:
                raise ConfigError("adapters", f"{a!r} is a base model, not an adapter")
    return pools


def _check_model(name: str, flag: str) -> None:
    if len(name) > MAX_MODEL_CHARS:
        raise ConfigError(flag, f"model name of {len(name)} characters; at most {MAX_MODEL_CHARS}")


def _addresses(text: str, what: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in out:
        try:
            split_host_port(a, what)
        except ValueError as exc:
            raise ConfigError(what, str(exc)) from None
    return out


def describe(pools: Iterable[PoolRoute]) -> str:
    """``chat (2 servers: m1), coder (1 server: m2)`` for a log line."""
    return ", ".join(f"{p.name} ({len(p.servers)} server{'s' * (len(p.servers) != 1)}: "
                     f"{', '.join(p.models)})" for p in pools)  # fmt: skip


def as_mapping(pools: Pools) -> dict[str, Any]:
    """The ``--pools`` file's form of ``pools`` (what the chart writes)."""
    out: dict[str, Any] = {"pools": [
        {"name": p.name, "models": list(p.models), "servers": list(p.servers),
         **({"epp": list(p.epp)} if p.epp else {})} for p in pools.pools]}  # fmt: skip
    if pools.adapters:
        out["adapters"] = [{"baseModel": a.base_model, "adapters": list(a.adapters)}
                           for a in pools.adapters]  # fmt: skip
    return out
