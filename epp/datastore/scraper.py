"""Scrape each endpoint's Prometheus ``/metrics`` and store its load in the datastore.

One poll task per endpoint, each under :func:`epp.supervise.supervise` (a task that raises is
logged with its traceback, counted in ``epp_background_task_failures_total{task="scrape"}``
and restarted with backoff). A reconcile loop, itself supervised, starts and stops poll tasks
as endpoints come and go and marks endpoints whose last good scrape is too old as stale
(``Datastore.mark_stale``).

Cost is bounded as the pool grows: each endpoint is scraped every ``interval_s`` (200 ms)
but the pool as a whole at most ``budget_per_s`` times a second (default 500), so with more
than ``interval_s * budget_per_s`` endpoints (100) each one's period stretches to
``endpoints / budget_per_s``. Between scrapes the load signal is carried by the requests epp
sent since the last scrape that are still in flight (``Endpoint.pending``).

A scrape costs the server too: real vLLM (0.32, CPU) spends ~12 ms of its API server's CPU
rendering its 51 KB page, whose ``?name[]=`` filter it ignores. So an endpoint is scraped no
more often than keeps its scrapes under ``server_share`` of its time: a page that takes
``t`` to answer (a moving average) is fetched every ``t / server_share`` at least, up to
``max_interval_s``. A server that answers in a millisecond or two is scraped every
``interval_s``; real vLLM on a CPU, every ~0.6-1 s. Each endpoint's period is exported as
``epp_scrape_period_seconds{endpoint}``.

A scrape is one request on a kept-alive connection (:mod:`epp.datastore.pagefetch`) and a
read of the few families the engine's :class:`~epp.datastore.metricsparse.MetricNames` name
(:mod:`epp.datastore.metricsparse`). Failures are counted in
``epp_scrape_errors_total{endpoint,reason}`` and logged once per failure streak, with a line
when the endpoint recovers; an endpoint recovers by itself on its next good scrape.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from epp.datastore.metricsparse import (
    ENGINES,
    SGLANG,
    VLLM,
    MetricNames,
    PageParser,
    ScrapeError,
    parse_metrics,
    query_for,
)
from epp.datastore.pagefetch import DEFAULT_MAX_BYTES, PageFetcher
from epp.datastore.store import Datastore
from epp.framework.endpoint import Endpoint, EndpointId
from epp.supervise import spawn

__all__ = [
    "ENGINES",
    "SGLANG",
    "VLLM",
    "MetricNames",
    "MetricsScraper",
    "ScrapeError",
    "ScrapeOptions",
    "ScrapingConfig",
    "parse_metrics",
]  # fmt: skip

log = logging.getLogger(__name__)


class ScrapeMetrics(Protocol):
    """What the scraper reports (``epp.observability.metrics.EppMetrics`` implements it)."""

    def scrape_ok(self) -> None: ...
    def scrape_failed(self, endpoint_id: str, reason: str) -> None: ...
    def scrape_value_rejected(self, family: str, reason: str) -> None: ...
    def scrape_period(self, endpoint_id: str, seconds: float) -> None: ...
    def scrape_target_removed(self, endpoint_id: str) -> None: ...
    def task_failed(self, kind: str) -> None: ...


DEFAULT_INTERVAL_S = 0.2
DEFAULT_SERVER_SHARE = 0.02
DEFAULT_MAX_INTERVAL_S = 1.0
LATENCY_WEIGHT = 0.2
"""Weight of the newest scrape in an endpoint's moving-average page latency."""


@dataclass(slots=True, frozen=True)
class ScrapingConfig:
    """The config's ``scraping:`` section: the scrape period a scheduling profile wants, and
    how much of a server's time its scrapes may take.

    A profile that reads the scraped load directly (the default one: queue and KV-use
    scorers) needs it fresh; one that carries the load in its own accounting between scrapes
    (``predicted-ttft``, ``cache-aware``) can run at 1 s. Every scrape costs the model server
    CPU it would spend on requests: real vLLM (0.32, CPU) spends ~12 ms rendering its page, so
    at 0.2 s it gave 8-10% more server TTFT than at 1 s (docs/research/findings.md, "Scrape period");
    ``serverShare`` stretches the period of such a server, while one that answers in a
    millisecond or two keeps ``intervalSeconds``. ``epp serve --scrape-interval-s`` overrides
    ``intervalSeconds``."""

    interval_seconds: float = DEFAULT_INTERVAL_S
    """Seconds between two scrapes of an endpoint's /metrics (shorter than ``saturation.metricsStalenessSeconds``)."""
    server_share: float = DEFAULT_SERVER_SHARE
    """Most share of an endpoint's time its scrapes may take: one whose page takes longer to
    answer is scraped less often, up to ``maxIntervalSeconds`` (0: always ``intervalSeconds``)."""
    max_interval_seconds: float = DEFAULT_MAX_INTERVAL_S
    """Longest period ``serverShare`` may stretch a scrape period to (at least ``intervalSeconds``,
    at most half ``saturation.metricsStalenessSeconds``)."""


@dataclass(slots=True, frozen=True)
class ScrapeOptions:
    interval_s: float = DEFAULT_INTERVAL_S
    """Shortest period between two scrapes of one endpoint. 200 ms: the replay loses nothing
    against 50 ms, and a model server renders its page a quarter as often (docs/research/findings.md,
    "Scrape period")."""
    budget_per_s: float = 500.0
    """Most scrapes per second over the whole pool; 0 = no limit."""
    server_share: float = DEFAULT_SERVER_SHARE
    """Most share of an endpoint's time its scrapes may take (module docstring); 0 = off."""
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S
    """Longest period ``server_share`` stretches an endpoint's to."""
    timeout_s: float = 1.0
    path: str = "/metrics"
    max_bytes: int = DEFAULT_MAX_BYTES
    """Largest page accepted, before and after decompression."""
    accept_gzip: bool = False
    """Ask for compressed pages (pays across slow links; costs CPU on both sides)."""
    families_only: bool = True
    """Ask for only the metric families epp reads (``?name[]=...``, see
    ``metricsparse.query_for``): less to render, send and parse on every scrape."""


@dataclass(slots=True)
class _Target:
    fetcher: PageFetcher
    parser: PageParser
    task: asyncio.Task[None] | None = None
    latency_s: float = 0.0
    """Moving average of the time the page takes to arrive (0: not measured yet)."""


class MetricsScraper:
    def __init__(
        self,
        datastore: Datastore,
        metrics: ScrapeMetrics,
        options: ScrapeOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._datastore = datastore
        self._metrics = metrics
        self.options = options or ScrapeOptions()
        self._clock = clock
        self._rng = rng or random.Random()
        self._targets: dict[EndpointId, _Target] = {}
        self._failing: dict[EndpointId, str] = {}
        self._reconciler: asyncio.Task[None] | None = None
        self._last_tick_s: float | None = None
        self._resumed_s = -math.inf
        """When the reconcile loop last woke far later than it asked (epp's own loop stalled,
        and its scrapes with it): staleness is judged from then (``Datastore.mark_stale``)."""

    def period_s(self, eid: EndpointId | None = None) -> float:
        """Time between two scrapes of one endpoint at the current pool size; of ``eid``,
        also stretched to keep its scrapes under ``server_share`` of its time."""
        opts = self.options
        period = opts.interval_s
        if opts.budget_per_s > 0:
            period = max(period, len(self._targets) / opts.budget_per_s)
        target = self._targets.get(eid) if eid is not None else None
        if target is not None and target.latency_s and opts.server_share > 0:
            period = max(period, min(opts.max_interval_s, target.latency_s / opts.server_share))
        return period

    async def start(self) -> None:
        self.reconcile()
        self._reconciler = spawn(
            "scrape-reconcile", self._reconcile_loop, on_failure=self._metrics.task_failed
        )

    async def stop(self) -> None:
        tasks = [t.task for t in self._targets.values() if t.task is not None]
        if self._reconciler is not None:
            tasks.append(self._reconciler)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for target in self._targets.values():
            target.fetcher.close()
        self._targets.clear()

    def _target(self, endpoint: Endpoint) -> _Target:
        target = self._targets.get(endpoint.id)
        if target is None:
            opts = self.options
            names = ENGINES.get(endpoint.engine, VLLM)
            path = opts.path
            if opts.families_only and "?" not in path:
                path += query_for(names)
            target = self._targets[endpoint.id] = _Target(
                PageFetcher(
                    endpoint.address, endpoint.metrics_port or endpoint.port, path,
                    max_bytes=opts.max_bytes, accept_gzip=opts.accept_gzip,
                ),
                PageParser(names, self._metrics.scrape_value_rejected),
            )
        return target

    def reconcile(self) -> None:
        """Start a poll task for each new endpoint (or one whose task ended), stop those of
        removed ones, mark stale endpoints."""
        current = {e.id: e for e in self._datastore.snapshot()}
        for eid in [eid for eid in self._targets if eid not in current]:
            target = self._targets.pop(eid)
            if target.task is not None:
                target.task.cancel()
            target.fetcher.close()
            self._failing.pop(eid, None)
            self._metrics.scrape_target_removed(eid)
        for eid, endpoint in current.items():
            target = self._target(endpoint)
            if target.task is None or target.task.done():
                target.task = spawn(
                    "scrape", functools.partial(self._poll, eid), name=f"scrape {eid}",
                    on_failure=self._metrics.task_failed,
                )
        for eid in self._datastore.mark_stale(self._clock(), self._resumed_s):
            log.warning(
                "endpoint metrics stale: no good scrape for over %.1fs",
                self._datastore.stale_after_s, extra={"endpoint": eid},
            )

    async def _reconcile_loop(self) -> None:
        period = max(self.options.interval_s, 0.1)
        while True:
            await asyncio.sleep(period)
            self.tick(period)

    def tick(self, period_s: float) -> None:
        """One pass of the reconcile loop, which asked to wake ``period_s`` after the last.
        Woken later than that by over half the staleness limit, epp's own loop stalled: the
        scrapes could not run either, so their age is judged from now."""
        now = self._clock()
        if self._last_tick_s is not None and now - self._last_tick_s > period_s + self._datastore.stale_after_s / 2:
            self._resumed_s = now
        self._last_tick_s = now
        self.reconcile()

    async def _poll(self, eid: EndpointId) -> None:
        first = True
        while True:
            started = self._clock()
            endpoint = self._datastore.get(eid)
            if endpoint is None:
                return
            await self.scrape_once(endpoint)
            period = self.period_s(eid)
            self._metrics.scrape_period(eid, period)
            if first:  # spread the pool's scrapes evenly over the period
                period *= self._rng.random()
                first = False
            await asyncio.sleep(max(0.0, period - (self._clock() - started)))

    async def scrape_once(self, endpoint: Endpoint) -> bool:
        """One scrape; True when it stored fresh metrics."""
        target = self._target(endpoint)
        fetcher = target.fetcher
        try:
            sent = self._clock()
            page = await fetcher.fetch(self.options.timeout_s)
            took = max(0.0, self._clock() - sent)
            target.latency_s = took if not target.latency_s else \
                target.latency_s + LATENCY_WEIGHT * (took - target.latency_s)  # fmt: skip
            try:
                metrics = target.parser.parse(page, self._clock())
            except ScrapeError as exc:
                if exc.reason != "missing_metrics" or "?" not in fetcher.path:
                    raise
                # a server that does not render ?name[]= as Prometheus' client does: fetch
                # its whole page from now on
                log.info("metrics page: families filter not honoured, fetching the whole page",
                         extra={"endpoint": endpoint.id})  # fmt: skip
                fetcher.set_path(fetcher.path.partition("?")[0])
                page = await fetcher.fetch(self.options.timeout_s)
                metrics = target.parser.parse(page, self._clock())
            except Exception as exc:  # a parser bug must not cost the endpoint its traffic
                log.exception("metrics page could not be parsed", extra={"endpoint": endpoint.id})
                raise ScrapeError("parse_error", type(exc).__name__) from None
        except ScrapeError as exc:
            self._metrics.scrape_failed(endpoint.id, exc.reason)
            if self._failing.get(endpoint.id) != exc.reason:
                self._failing[endpoint.id] = exc.reason
                log.warning("metrics scrape failed: %s", exc, extra={"endpoint": endpoint.id})
            return False
        if self._failing.pop(endpoint.id, None) is not None:
            log.info("metrics scrape recovered", extra={"endpoint": endpoint.id})
        self._metrics.scrape_ok()
        self._datastore.update_metrics(endpoint.id, metrics)
        return True
