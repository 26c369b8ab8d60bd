"""Endpoint values: identity, labels and the latest load metrics with their timestamp."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NewType

EndpointId = NewType("EndpointId", str)
"""``ip:port`` of a model server; the value epp writes into ``x-gateway-destination-endpoint``."""

ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
ROLE_LABEL = "llm-d.ai/role"
"""Disaggregated serving: ``prefill``, ``decode`` or ``prefill-decode`` (llm-d's label)."""

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(slots=True, frozen=True)
class Metrics:
    """One scrape of a model server's ``/metrics``. ``scraped_at_s`` is on the monotonic clock.

    ``scraped_at_s == 0`` means the endpoint was never scraped: scorers treat its load as
    unknown (neutral) and the saturation detector treats it as stale.
    """

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size_tokens: int = 0
    num_gpu_blocks: int = 0
    scraped_at_s: float = 0.0
    served_models: frozenset[str] = frozenset()
    """The model names the server's load gauges carry (vLLM's ``model_name`` label): its base
    model, never one of its LoRA adapters."""
    started_s: float = 0.0
    """The server process's start time (``process_start_time_seconds``, Unix seconds; 0:
    not reported). A new value means a new process behind the address."""
    lifetime_total: float = -1.0
    """A counter that only grows while the server process lives (vLLM's
    ``prefix_cache_queries_total``, summed; -1: not reported): a smaller value means the
    server restarted."""
    not_serving: str = ""
    """Why the server says it cannot serve now ('' = it can): ``asleep`` (vLLM's sleep mode:
    ``vllm:engine_sleep_state`` not awake, weights offloaded or discarded, KV cache gone)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0:  # servers report odd values; scorers rely on [0, 1]
            object.__setattr__(self, "kv_usage", min(1.0, max(0.0, self.kv_usage or 0.0)))

    @property
    def known(self) -> bool:
        return self.scraped_at_s > 0.0

    def serves(self, model: str) -> bool:
        """``model`` is one this server names: its base model, or a LoRA adapter it has
        loaded (running or waiting)."""
        return model in self.served_models or model in self.running_adapters or (
            model in self.waiting_adapters)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the server holds, or 0 when it did not report its cache config."""
        return self.block_size_tokens * self.num_gpu_blocks


@dataclass(slots=True, frozen=True)
class Endpoint:
    """A model server as the scheduler sees it at one instant.

    ``pending`` counts the requests epp routed there since the last scrape and that are still
    in flight, which ``metrics`` cannot see yet: it covers a burst between two scrapes so that
    it does not pile onto one endpoint, and a request that finished no longer counts (a
    session's quick turns between two scrapes do not make its endpoint look queued).
    (Requests in flight are counted by the datastore, ``Datastore.in_flight``: the scheduler
    does not read them; ``pending`` changes when one finishes only while it exceeds them.)
    """

    id: EndpointId
    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    metrics: Metrics = field(default_factory=Metrics)
    pending: int = 0
    metrics_port: int = 0
    stale: bool = False
    rank: int = 0
    """Data-parallel rank: the endpoint's index among its pod's ports (an InferencePool's
    ``targetPorts``, one per rank). vLLM offsets a rank's KV-event and replay ports by it."""
    instance: str = ""
    """Who is behind the address (a pod's UID; '' when the source does not know): another
    value for the same ``id`` is another server, and what epp knew of the old one is dropped."""
    queue: int = field(init=False, default=0, compare=False)
    """Waiting requests, plus those epp sent, still in flight, since the last scrape (derived;
    stored because every scheduling cycle reads it for every endpoint)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "queue", self.metrics.waiting + self.pending)

    @property
    def engine(self) -> str:
        return self.labels.get(ENGINE_LABEL, "vllm")


def identity_change(old: Metrics, new: Metrics) -> str:
    """Why ``new`` cannot come from the same server process as ``old`` ('' when it can):
    ``model_changed`` (it serves other models: the more specific reason, also when the
    process restarted to serve them), ``restarted`` (another process start time, or a
    lifetime counter that went backwards)."""
    if not old.known:
        return ""
    if old.served_models and new.served_models and old.served_models != new.served_models:
        return "model_changed"
    if old.started_s and new.started_s and new.started_s != old.started_s:
        return "restarted"
    if 0 <= new.lifetime_total < old.lifetime_total:
        return "restarted"
    return ""


def endpoint_id(address: str, port: int) -> EndpointId:
    if ":" in address and not address.startswith("["):
        return EndpointId(f"[{address}]:{port}")
    return EndpointId(f"{address}:{port}")


def parse_endpoint_id(text: str) -> tuple[str, int]:
    """Split ``ip:port`` (or ``[v6]:port``); raises ValueError naming the bad value."""
    host, sep, port_s = text.strip().rpartition(":")
    if not sep or not host or not (port_s.isascii() and port_s.isdigit()) or len(port_s) > 5:
        raise ValueError(f"endpoint {text!r} is not of the form ip:port")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"endpoint {text!r} has port outside 1..65535")
    return host.strip("[]"), port
