"""vLLM's Prometheus metrics, same names, labels and meanings, on a per-server registry.

State gauges and the prefix-cache counters are read from the engine at scrape time (a
collector); latency histograms and request counters are updated as requests finish.
Latencies are in *modelled* seconds (wall-clock seconds times ``speedup``), so a replica
run 100x fast still reports the TTFTs of the GPU it models.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from simulator.model.engine import Engine

# vLLM's own bucket boundaries.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineState(Collector):
    def __init__(
        self, engine: Engine, model: str, max_loras: int, sleep_level: Callable[[], int | None],
        started_s: float,
    ) -> None:  # fmt: skip
        self._engine = engine
        self._model = model
        self._max_loras = str(max_loras)
        self._sleep_level = sleep_level
        self._started_s = started_s

    def collect(self) -> Iterator[Metric]:
        e = self._engine
        m = [self._model]
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                e.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                e.num_waiting,
            ),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage),
            (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                e.kv_usage,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        for name, doc, count in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                e.prefix_cache_queries_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                e.prefix_cache_hits_tokens,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
                e.external_queries_tokens,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in "
                "terms of number of cached tokens.",
                e.external_hits_tokens,
            ),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, count)
            yield c
        cache = e.cache
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "model_name",
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "cache_dtype",
            ],
        )
        info.add_metric(
            [self._model, str(cache.block_size_tokens), str(cache.num_blocks), "True", "auto"], 1.0
        )
        yield info
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(
            [
                self._model,
                ",".join(e.running_adapters()),
                ",".join(e.waiting_adapters()),
                self._max_loras,
            ],
            time.time(),
        )
        yield lora
        # vLLM's sleep mode: awake 1, or awake 0 and the level's series 1 (level 0: the KV
        # cache released, level 1: weights offloaded, level 2: discarded)
        level = self._sleep_level()
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.", labels=["engine", "model_name", "sleep_state"],
        )  # fmt: skip
        for state, value in (("awake", level is None), ("weights_offloaded", level == 1),
                             ("discard_all", level == 2)):  # fmt: skip
            sleep.add_metric(["0", self._model, state], 1.0 if value else 0.0)
        yield sleep
        # as Prometheus' client writes for the process: a restarted server has a new one
        started = GaugeMetricFamily("process_start_time_seconds",
                                    "Start time of the process since unix epoch in seconds.")
        started.add_metric([], self._started_s)
        yield started


class VllmMetrics:
    """The emulator's metrics. Label children are bound once; hot paths only observe/inc."""

    def __init__(
        self, registry: CollectorRegistry, engine: Engine, model: str, max_loras: int,
        sleep_level: Callable[[], int | None] = lambda: None, started_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.registry = registry
        registry.register(_EngineState(engine, model, max_loras, sleep_level,
                                       started_s or time.time()))  # fmt: skip
        self.ttft_s = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["model_name"],
            registry=registry,
            buckets=TTFT_BUCKETS_S,
        ).labels(model)
        self.e2e_s = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            ["model_name"],
            registry=registry,
            buckets=E2E_BUCKETS_S,
        ).labels(model)
        self.success_length = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=registry,
        ).labels(model, "length")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            ["model_name"],
            registry=registry,
        ).labels(model)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            ["model_name"],
            registry=registry,
        ).labels(model)


def restrict_page(page: bytes, names: set[str]) -> bytes:
    """The page as Prometheus' Python client renders it for ``?name[]=...`` (vLLM serves its
    page with it): only the families with a sample of one of those names."""
    out: list[bytes] = []
    family: list[bytes] = []
    keep = False
    for line in page.splitlines(keepends=True):
        if line.startswith(b"# HELP "):
            if keep:
                out += family
            family, keep = [line], False
            continue
        family.append(line)
        if not line.startswith(b"#"):
            name = line.split(b"{", 1)[0].split(b" ", 1)[0].decode("utf-8", "replace")
            keep = keep or name in names
    if keep:
        out += family
    return b"".join(out)
