"""Scrape each endpoint's Prometheus ``/metrics`` and store its load in the datastore.

One asyncio task per endpoint polls every ``interval_s`` (50 ms by default) with a timeout;
a supervisor task starts and stops tasks as endpoints come and go and marks endpoints whose
last good scrape is too old as stale (``Datastore.mark_stale``). Failures are counted in
``epp_scrape_errors_total{endpoint,reason}`` and logged once per failure streak, with a line
when the endpoint recovers.

The engine (``Endpoint.engine``: ``vllm`` or ``sglang``) chooses the metric names. The parser
does not tokenize the whole exposition: it searches for the few metric names it needs, so a
100 KB vLLM page (mostly histograms) costs tens of microseconds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from epp.datastore.endpoint import Endpoint, EndpointId, Metrics
from epp.datastore.store import Datastore
from epp.observability.metrics import EppMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class MetricNames:
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]
    """Alternatives, first present wins (vLLM renamed gpu_cache_usage_perc in v0.10)."""
    lora_info: str = ""
    cache_config: str = ""
    kv_capacity_tokens: str = ""
    """Engines that report KV capacity in tokens rather than blocks (SGLang)."""


VLLM = MetricNames(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    lora_info="vllm:lora_requests_info",
    cache_config="vllm:cache_config_info",
)
SGLANG = MetricNames(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    kv_capacity_tokens="sglang:max_total_num_tokens",
)
ENGINES: dict[str, MetricNames] = {"vllm": VLLM, "sglang": SGLANG}

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ScrapeError(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class _Sample:
    labels: str
    value: float


def _samples(text: str, name: str) -> list[_Sample]:
    """Every sample of metric ``name`` (exact name, not a prefix of a longer one)."""
    out: list[_Sample] = []
    needle = "\n" + name
    if text.startswith(name):
        start = 0
    else:
        pos = text.find(needle)
        if pos < 0:
            return out
        start = pos + 1
    while True:
        end = text.find("\n", start)
        line = text[start:] if end < 0 else text[start:end]
        rest = line[len(name) :]
        if rest[:1] in ("{", " ", "\t"):
            labels = ""
            if rest[:1] == "{":
                close = rest.rfind("}")
                labels, rest = rest[1:close], rest[close + 1 :]
            parts = rest.split()
            if parts:
                try:
                    out.append(_Sample(labels, float(parts[0])))
                except ValueError:
                    pass
        if end < 0:
            break
        nxt = text.find(needle, end)
        if nxt < 0:
            break
        start = nxt + 1
    return out


def _labels(text: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text)}


def _adapters(value: str) -> frozenset[str]:
    return frozenset(a.strip() for a in value.split(",") if a.strip())


def parse_metrics(text: str, names: MetricNames, now_s: float) -> Metrics:
    """Read one exposition; raises ScrapeError('missing_metrics') if no load metric is there.

    Several series of one gauge (data-parallel ranks, several model names) add up for queue
    and running counts; KV use takes the largest.
    """
    waiting = running = None
    kv = None
    for n in names.waiting:
        s = _samples(text, n)
        if s:
            waiting = int(sum(x.value for x in s))
            break
    for n in names.running:
        s = _samples(text, n)
        if s:
            running = int(sum(x.value for x in s))
            break
    for n in names.kv_usage:
        s = _samples(text, n)
        if s:
            kv = max(x.value for x in s)
            break
    if waiting is None and running is None and kv is None:
        raise ScrapeError("missing_metrics", "none of the engine's load metrics present")

    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters = 0
    if names.lora_info:
        lora = _samples(text, names.lora_info)
        if lora:
            # one series per state change; the value is its timestamp: the newest wins
            latest = _labels(max(lora, key=lambda s: s.value).labels)
            running_adapters = _adapters(latest.get("running_lora_adapters", ""))
            waiting_adapters = _adapters(latest.get("waiting_lora_adapters", ""))
            max_lora = latest.get("max_lora", "0")
            max_adapters = int(max_lora) if max_lora.isdigit() else 0
    block_size = gpu_blocks = 0
    if names.cache_config:
        cc = _samples(text, names.cache_config)
        if cc:
            labels = _labels(cc[0].labels)
            bs, nb = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
            block_size = int(bs) if bs.isdigit() else 0
            gpu_blocks = int(nb) if nb.isdigit() else 0
    if names.kv_capacity_tokens:
        cap = _samples(text, names.kv_capacity_tokens)
        if cap:
            block_size, gpu_blocks = 1, int(max(x.value for x in cap))
    return Metrics(
        waiting=waiting or 0,
        running=running or 0,
        kv_usage=float(kv or 0.0),
        running_adapters=running_adapters,
        waiting_adapters=waiting_adapters,
        max_adapters=max_adapters,
        block_size_tokens=block_size,
        num_gpu_blocks=gpu_blocks,
        scraped_at_s=now_s,
    )


def metrics_url(endpoint: Endpoint, path: str = "/metrics") -> str:
    host = endpoint.address
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{endpoint.metrics_port or endpoint.port}{path}"


class MetricsScraper:
    def __init__(
        self,
        datastore: Datastore,
        metrics: EppMetrics,
        interval_s: float = 0.05,
        timeout_s: float = 1.0,
        path: str = "/metrics",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._datastore = datastore
        self._metrics = metrics
        self.interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._path = path
        self._clock = clock
        self._tasks: dict[EndpointId, asyncio.Task[None]] = {}
        self._failing: dict[EndpointId, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._supervisor: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        )
        self._supervisor = asyncio.create_task(self._supervise(), name="epp-scrape-supervisor")

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        if self._supervisor is not None:
            tasks.append(self._supervisor)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    def reconcile(self) -> None:
        """Start a poll task for each new endpoint, stop those of removed ones, mark stale."""
        current = {e.id for e in self._datastore.snapshot()}
        for eid in list(self._tasks):
            if eid not in current:
                self._tasks.pop(eid).cancel()
                self._failing.pop(eid, None)
        for eid in current:
            if eid not in self._tasks:
                self._tasks[eid] = asyncio.create_task(self._poll(eid), name=f"epp-scrape-{eid}")
        for eid in self._datastore.mark_stale(self._clock()):
            log.warning(
                "endpoint metrics stale: no good scrape for over %.1fs",
                self._datastore.stale_after_s, extra={"endpoint": eid},
            )

    async def _supervise(self) -> None:
        period = max(self.interval_s, 0.1)
        while True:
            self.reconcile()
            await asyncio.sleep(period)

    async def _poll(self, eid: EndpointId) -> None:
        while True:
            started = self._clock()
            endpoint = self._datastore.get(eid)
            if endpoint is None:
                return
            await self.scrape_once(endpoint)
            await asyncio.sleep(max(0.0, self.interval_s - (self._clock() - started)))

    async def scrape_once(self, endpoint: Endpoint) -> bool:
        """One scrape; True when it stored fresh metrics."""
        assert self._session is not None, "start() first"
        names = ENGINES.get(endpoint.engine, VLLM)
        try:
            try:
                async with self._session.get(metrics_url(endpoint, self._path)) as resp:
                    if resp.status != 200:
                        raise ScrapeError("http_status", str(resp.status))
                    text = await resp.text()
            except TimeoutError:
                raise ScrapeError("timeout") from None
            except aiohttp.ClientError as exc:
                raise ScrapeError("connection", type(exc).__name__) from None
            metrics = parse_metrics(text, names, self._clock())
        except ScrapeError as exc:
            self._metrics.scrape_errors.labels(endpoint.id, exc.reason).inc()
            if self._failing.get(endpoint.id) != exc.reason:
                self._failing[endpoint.id] = exc.reason
                log.warning("metrics scrape failed: %s", exc, extra={"endpoint": endpoint.id})
            return False
        if self._failing.pop(endpoint.id, None) is not None:
            log.info("metrics scrape recovered", extra={"endpoint": endpoint.id})
        self._metrics.scrapes.inc()
        self._datastore.update_metrics(endpoint.id, metrics)
        return True
