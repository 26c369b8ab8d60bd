"""Metrics of the precise prefix producer, read from its counters when Prometheus scrapes
(nothing is done on the request path or per event).

``epp_kv_events_total{endpoint,type}`` events applied; ``epp_kv_events_dropped_total
{endpoint,reason}`` batches or events not applied (bad-message, duplicate, medium,
block-size, index-full, unknown-topic, unknown-endpoint, unknown-type, reader-error);
``epp_kv_events_gaps_total{endpoint}``, ``epp_kv_events_resyncs_total{endpoint}``,
``epp_kv_events_restarts_total{endpoint}``, ``epp_kv_events_replays_total{outcome}``;
``epp_precise_index_blocks`` entries held, ``epp_precise_index_blocks_refused_total``,
``epp_precise_speculative_expired_total``; ``epp_precise_unkeyed_requests_total{reason}``
(requests the approximate index scored instead); ``epp_precise_tokenize_seconds`` (a summary:
tokenizing and keying, per keyed request); the key cache's
``epp_precise_key_cache_tokens_total{source}`` (prompt tokens whose keys were ``reused`` or
``encoded``), ``epp_precise_key_cache_tokens_held``, ``epp_precise_key_cache_nodes``,
``epp_precise_key_cache_evictions_total``, ``epp_precise_key_cache_verifications_total
{outcome}`` (``match`` / ``mismatch``: piecewise keying then turned off for that tokenizer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from epp.plugins.preciseprefix.keyer import BlockKeyer, TokenizingKeyer
from epp.prefix.kvindex import KvBlockIndex


@dataclass(slots=True)
class PreciseStats:
    """Counters read by the metrics collector at scrape time (never on the request path)."""

    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(endpoint, event type) -> events applied."""
    dropped: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(endpoint, reason) -> batches or events dropped."""
    gaps: Counter[str] = field(default_factory=Counter)
    resyncs: Counter[str] = field(default_factory=Counter)
    replays: Counter[str] = field(default_factory=Counter)
    """Outcome (``complete``, ``incomplete``, ``failed``) -> count."""
    restarts: Counter[str] = field(default_factory=Counter)
    unkeyed: Counter[str] = field(default_factory=Counter)
    """Reason -> requests scored by the approximate index instead."""


class PreciseSource(Protocol):
    """What the collector reads of the producer (``PrecisePrefixProducer``), at scrape time."""

    @property
    def stats(self) -> PreciseStats: ...
    @property
    def index(self) -> KvBlockIndex: ...
    @property
    def keyer(self) -> BlockKeyer: ...


class PreciseCollector(Collector):
    def __init__(self, producer: PreciseSource) -> None:
        self.producer = producer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        p = self.producer
        st = p.stats
        events = CounterMetricFamily(
            "epp_kv_events", "KV-cache events applied, by endpoint and type.",
            labels=["endpoint", "type"],
        )  # fmt: skip
        for (eid, kind), n in sorted(st.events.items()):
            events.add_metric([eid, kind], n)
        yield events
        dropped = CounterMetricFamily(
            "epp_kv_events_dropped", "KV-event batches or events not applied, by reason.",
            labels=["endpoint", "reason"],
        )  # fmt: skip
        for (eid, reason), n in sorted(st.dropped.items()):
            dropped.add_metric([eid, reason], n)
        yield dropped
        for name, help_text, counter in (
            ("epp_kv_events_gaps", "Sequence gaps seen per endpoint.", st.gaps),
            ("epp_kv_events_resyncs", "Gaps not repaired by replay (index rebuilt).", st.resyncs),
            ("epp_kv_events_restarts", "Publishers whose numbering restarted.", st.restarts),
        ):
            fam = CounterMetricFamily(name, help_text, labels=["endpoint"])
            for eid, n in sorted(counter.items()):
                fam.add_metric([eid], n)
            yield fam
        replays = CounterMetricFamily(
            "epp_kv_events_replays", "Replay requests by outcome.", labels=["outcome"]
        )
        for outcome, n in sorted(st.replays.items()):
            replays.add_metric([outcome], n)
        yield replays
        unkeyed = CounterMetricFamily(
            "epp_precise_unkeyed_requests",
            "Requests the precise producer could not key (scored by the approximate index).",
            labels=["reason"],
        )
        for reason, n in sorted(st.unkeyed.items()):
            unkeyed.add_metric([reason], n)
        yield unkeyed
        index = p.index
        yield GaugeMetricFamily(
            "epp_precise_index_blocks", "(block, endpoint) entries in the precise index.",
            value=index.entries,
        )  # fmt: skip
        yield CounterMetricFamily(
            "epp_precise_index_blocks_refused", "Entries refused because the index was full.",
            value=index.counts.refused,
        )  # fmt: skip
        yield CounterMetricFamily(
            "epp_precise_speculative_expired",
            "Speculative entries that lapsed without a confirming event.",
            value=index.counts.speculative_expired,
        )
        keyer = p.keyer
        if isinstance(keyer, TokenizingKeyer):
            yield SummaryMetricFamily(
                "epp_precise_tokenize_seconds",
                "Tokenizing, templating and keying a request.",
                count_value=keyer.count, sum_value=keyer.seconds,
            )  # fmt: skip
            cache = keyer.cache
            if cache is not None:
                cs = cache.stats
                tokens = CounterMetricFamily(
                    "epp_precise_key_cache_tokens",
                    "Prompt tokens keyed, by whether their keys were reused from the key cache "
                    "or tokenized and hashed.", labels=["source"],
                )  # fmt: skip
                tokens.add_metric(["reused"], cs.tokens_reused)
                tokens.add_metric(["encoded"], cs.tokens_encoded)
                yield tokens
                yield GaugeMetricFamily("epp_precise_key_cache_tokens_held",
                                        "Tokens (with node overhead) the key cache holds.",
                                        value=cache.size)  # fmt: skip
                yield GaugeMetricFamily("epp_precise_key_cache_nodes",
                                        "Prompt pieces the key cache holds.", value=cache.nodes)  # fmt: skip
                yield CounterMetricFamily("epp_precise_key_cache_evictions",
                                          "Pieces evicted from the key cache.",
                                          value=cs.evicted_nodes)  # fmt: skip
                checks = CounterMetricFamily(
                    "epp_precise_key_cache_verifications",
                    "Cached keyings checked against the whole prompt, by outcome.",
                    labels=["outcome"],
                )  # fmt: skip
                checks.add_metric(["match"], cs.verified - cs.mismatches)
                checks.add_metric(["mismatch"], cs.mismatches)
                yield checks
