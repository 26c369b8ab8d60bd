"""``epp serve``'s endpoints: the static pool or Kubernetes discovery, and how their
``/metrics`` pages are scraped (the "endpoints and metrics scraping" flags)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from epp.cli.flags import byte_size, number, seconds
from epp.config.loader import EppConfig
from epp.datastore.pagefetch import DEFAULT_MAX_BYTES as DEFAULT_MAX_PAGE_BYTES
from epp.datastore.scraper import ScrapeOptions
from epp.datastore.static import parse_endpoint_list
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.framework.endpoint import Endpoint
from epp.request.parse import ObjectiveLookup
from epp.server.runner import SourceStarter

log = logging.getLogger("epp.cli")

# Kubernetes discovery is optional: epp serves a static pool without it.
try:
    from epp.datastore import kubernetes as _k8s
except ImportError:  # pragma: no cover - module absent or kubernetes client not installed
    _k8s = None  # type: ignore[assignment]


def _metrics_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL path (it must start with /)")
    return text


def add_endpoint_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("endpoints and metrics scraping")
    g.add_argument("--endpoints", default="",
                   help="static pool: comma-separated ip:port (also: config staticEndpoints)")
    g.add_argument("--engine", default="", choices=["vllm", "sglang"],
                   help="engine of the --endpoints servers: vllm or sglang (chooses the metric "
                   "names scraped; default vllm)")
    g.add_argument("--scrape-interval-s", type=seconds(), default=None,
                   help="seconds between /metrics scrapes of each endpoint (default: the "
                   "config's scraping.intervalSeconds: 0.2, 1 for --config predicted-ttft and "
                   "cache-aware); "
                   "between scrapes the requests epp sent carry the load signal, and a model "
                   "server renders its page on every scrape")
    g.add_argument("--scrape-budget-per-s", type=number(0, strict=False), default=500.0,
                   help="most scrapes per second over the whole pool (0 = no limit): past "
                   "interval x budget endpoints (100 at the defaults) each endpoint's period "
                   "stretches to endpoints / budget, so scraping cost stays bounded")
    g.add_argument("--scrape-timeout-s", type=seconds(), default=1.0,
                   help="timeout of one scrape, in seconds")
    g.add_argument("--scrape-max-bytes", type=byte_size, default=DEFAULT_MAX_PAGE_BYTES,
                   help="largest /metrics page accepted, before and after decompression "
                   "(a larger one is a 'too_large' scrape error)")
    g.add_argument("--scrape-gzip", action="store_true",
                   help="ask endpoints for gzip-compressed pages (saves bandwidth across slow "
                   "links; costs CPU on the server and here, so off by default)")
    g.add_argument("--metrics-path", type=_metrics_path, default="/metrics",
                   help="path scraped on each endpoint")
    g.add_argument("--scrape-full-page", action="store_true",
                   help="fetch the whole /metrics page (default: ask for only the families epp "
                   "reads with ?name[]=..., which vLLM and SGLang honour)")
    g.add_argument("--no-scrape", action="store_true",
                   help="do not scrape endpoints (load then comes only from in-flight counts)")


def add_kubernetes_flags(serve: argparse.ArgumentParser) -> None:
    """Kubernetes discovery's flags (epp.datastore.kubernetes), when its client is installed."""
    if _k8s is not None:
        _k8s.add_kubernetes_flags(serve)


@dataclass(slots=True, frozen=True)
class EndpointSources:
    """Where ``epp serve`` finds its endpoints: a static list, or sources started with it."""

    static: list[Endpoint]
    sources: list[SourceStarter]
    objective_lookup: ObjectiveLookup | None = None


def endpoint_sources(args: argparse.Namespace, cfg: EppConfig) -> EndpointSources:
    """``--endpoints`` (else the config's staticEndpoints) or Kubernetes discovery; raises
    ConfigError when both or neither are given."""
    static = list(cfg.static_endpoints)
    if args.endpoints:
        static = parse_endpoint_list(args.endpoints, engine=args.engine)
    sources: list[SourceStarter] = []
    objective_lookup: ObjectiveLookup | None = None
    if _k8s is not None:
        objectives = _k8s.ObjectivePriorities(cfg.request_control.objective_priorities)
        objective_lookup = objectives.priority_of
        probe = Datastore()
        if _k8s.source_from_args(args, probe, objectives=objectives) is not None:
            if static:
                raise ConfigError("--endpoints", "give a static pool or Kubernetes discovery, not both")

            async def start_k8s(ds: Datastore) -> Any:
                src = _k8s.source_from_args(args, ds, objectives=objectives)
                assert src is not None
                log.info("discovering endpoints from %s", src.describe())
                await src.start()
                return src

            sources.append(start_k8s)
    if not static and not sources:
        raise ConfigError("--endpoints", "no endpoints: give --endpoints, config staticEndpoints "
                          "or Kubernetes discovery flags")
    return EndpointSources(static, sources, objective_lookup)


def scrape_options(args: argparse.Namespace, cfg: EppConfig) -> ScrapeOptions:
    """The scraper's settings: the flags, over the config's ``scraping`` section."""
    interval = _scrape_interval(args, cfg)
    return ScrapeOptions(
        interval_s=interval,
        budget_per_s=args.scrape_budget_per_s,
        server_share=cfg.scraping.server_share,
        max_interval_s=max(interval, min(cfg.scraping.max_interval_seconds,
                                         cfg.saturation.metrics_staleness_seconds / 2)),
        timeout_s=args.scrape_timeout_s,
        path=args.metrics_path,
        max_bytes=args.scrape_max_bytes,
        accept_gzip=args.scrape_gzip,
        families_only=not args.scrape_full_page,
    )


def _scrape_interval(args: argparse.Namespace, cfg: EppConfig) -> float:
    """``--scrape-interval-s`` when given, else the config's ``scraping.intervalSeconds``."""
    interval: float = cfg.scraping.interval_seconds
    if args.scrape_interval_s is not None:
        interval = args.scrape_interval_s
        stale_s = cfg.saturation.metrics_staleness_seconds
        if interval >= stale_s:
            log.warning("--scrape-interval-s %g is not shorter than the config's "
                        "saturation.metricsStalenessSeconds (%g): endpoints will look stale "
                        "between scrapes", interval, stale_s)
    if args.no_scrape:
        log.info("not scraping (--no-scrape): load comes only from in-flight counts")
    else:
        log.info("scraping each endpoint every %g s (%s)", interval,
                 "--scrape-interval-s" if args.scrape_interval_s is not None
                 else f"{cfg.source} scraping.intervalSeconds")
    return interval
