"""The one place plugin types are named. Config files refer to these type names.

One registry per plugin kind, each typed by the kind's protocol, so building a profile needs
no casts; ``PLUGIN_TYPES`` is their union for the config loader.

Producers are matched to their readers by the data they provide, not by name: a plugin
declares what it ``reads`` (e.g. ``PREFIX_MATCH``), a producer what it ``provides``, and
``DEFAULT_PRODUCERS`` names the producer the loader adds when a plugin reads data no
configured producer provides. Adding a plugin is one entry here (docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from epp.framework.interfaces import DataProducer, Filter, Picker, ProfileHandler, Scorer
from epp.plugins import (
    cacheaware,
    conformance,
    disagg,
    filters,
    pickers,
    prefixhome,
    responseaffinity,
    scorers,
    session,
    tokenload,
    ttft,
)
from epp.plugins.approxprefix import APPROX_PREFIX_PRODUCER, PrefixIndexConfig, PrefixProducer
from epp.plugins.preciseprefix import (
    KEYING_S_PER_BODY_BYTE,
    PRECISE_PREFIX_PRODUCER,
    PreciseIndexConfig,
    PrecisePrefixProducer,
)

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class PluginType(Generic[T]):
    factory: Callable[[str, Any], T]
    params: type
    kind: str  # "producer" | "filter" | "scorer" | "picker" | "decider" | "handler"
    summary: str
    reads: Callable[[Any], tuple[str, ...]] = lambda _params: ()
    """The data it reads, given its parameters: a producer providing each must run (the
    default one is added when the config has none)."""
    provides: tuple[str, ...] = ()
    """A producer: the data it attaches to the cycle state."""
    section: str = ""
    """A top-level config section whose fields are the defaults of its parameters (the
    plugin's own ``parameters`` override them)."""
    prepare_s_per_body_byte: float = 0.0
    """Work it does on a request before it is scheduled (tokenizing), in seconds per byte of
    body: Envoy's per-message timeout must allow for it (``epp.envoyconfig``)."""


PREFIX_MATCH = "prefix-match"
"""``CycleState.prefix``: the leading prompt chunks each endpoint holds."""
APPROX_INDEX = "approximate-prefix-index"
"""The index learnt from routing and replies (what index sync shares)."""


def _reads_prefix(_params: Any) -> tuple[str, ...]:
    return (PREFIX_MATCH,)


def _precise_reads(params: PreciseIndexConfig) -> tuple[str, ...]:
    return (APPROX_INDEX,) if params.approximate_fallback else ()

PRODUCERS: dict[str, PluginType[DataProducer]] = {
    APPROX_PREFIX_PRODUCER: PluginType(
        PrefixProducer.from_params, PrefixIndexConfig, "producer",
        "hashes the prompt in chunks, looks up which endpoint recently received them, records "
        "each pick and reply (parameters: the prefixIndex section's fields)",
        provides=(PREFIX_MATCH, APPROX_INDEX), section="prefixIndex",
    ),
    PRECISE_PREFIX_PRODUCER: PluginType(
        PrecisePrefixProducer.from_params, PreciseIndexConfig, "producer",
        "tokenizes the request, keys its blocks as vLLM does and matches them against the "
        "servers' KV-cache events; the approximate index covers servers without events "
        "(docs/precise-prefix.md)",
        reads=_precise_reads, provides=(PREFIX_MATCH,),
        prepare_s_per_body_byte=KEYING_S_PER_BODY_BYTE,
    ),
}

DEFAULT_PRODUCERS: dict[str, str] = {
    PREFIX_MATCH: APPROX_PREFIX_PRODUCER,
    APPROX_INDEX: APPROX_PREFIX_PRODUCER,
}
"""Data -> the producer type added when a plugin reads it and no configured producer
provides it."""

_ALL: dict[str, PluginType[Any]] = {
    "prefix-cache-scorer": PluginType(
        scorers.PrefixCacheScorer, scorers.PrefixCacheScorerParams, "scorer",
        "matched leading chunks / request chunks, from the prefix index", reads=_reads_prefix,
    ),
    "predicted-ttft-scorer": PluginType(
        ttft.PredictedTtftScorer, ttft.PredictedTtftParams, "scorer",
        "lowest predicted time to first token (uncached tokens, queued prefill, running "
        "requests; cost model fitted online)", reads=_reads_prefix,
    ),
    "cache-aware-scorer": PluginType(
        cacheaware.CacheAwareScorer, cacheaware.CacheAwareParams, "scorer",
        "the SGLang router's cache_aware rule: the endpoint holding a prefix match over 0.3 of "
        "the prompt, else the one sent the least uncached text; load alone when imbalanced",
        reads=_reads_prefix,
    ),
    "queue-scorer": PluginType(
        scorers.QueueScorer, scorers.QueueScorerParams, "scorer",
        "shorter queue (waiting + sent since the last scrape, in flight) scores higher, min-max "
        "normalised",
    ),
    "kv-cache-utilization-scorer": PluginType(
        scorers.KvCacheUtilizationScorer, scorers.KvCacheScorerParams, "scorer",
        "1 - KV-cache use",
    ),
    "prefix-home-scorer": PluginType(
        prefixhome.PrefixHomeScorer, prefixhome.PrefixHomeParams, "scorer",
        "a prefix no endpoint is known to hold goes where its hash says, so that epp replicas "
        "agree on a new prefix's home without sync", reads=_reads_prefix,
    ),
    "session-affinity-scorer": PluginType(
        session.SessionAffinityScorer, session.SessionAffinityParams, "scorer",
        "the endpoint that served the session's last request (session id from a header or "
        "the body) until it saturates",
    ),
    "token-load-scorer": PluginType(
        tokenload.TokenLoadScorer, tokenload.TokenLoadParams, "scorer",
        "fewer tokens in flight (held in KV, prefill weighted higher) scores higher",
    ),
    "token-load-filter": PluginType(
        tokenload.TokenLoadFilter, tokenload.TokenLoadParams, "filter",
        "keep endpoints whose tokens in flight are under maxTokens / maxShare of KV (all if none)",
    ),
    "lora-affinity-scorer": PluginType(
        scorers.LoraAffinityScorer, scorers.LoraAffinityScorerParams, "scorer",
        "adapter running > free slot > waiting > none",
    ),
    "response-affinity-filter": PluginType(
        responseaffinity.ResponseAffinityFilter, responseaffinity.ResponseAffinityParams,
        "filter",
        "a request naming a stored response or conversation (previous_response_id, "
        "GET/DELETE /v1/responses/{id}, .../cancel) goes to the endpoint that produced it; "
        "ids learnt from the replies, shared by index sync",
    ),
    "lora-affinity-filter": PluginType(
        filters.LoraAffinityFilter, filters.NoParams, "filter",
        "keep the best LoRA tier",
    ),
    "load-threshold-filter": PluginType(
        filters.LoadThresholdFilter, filters.LoadThresholdParams, "filter",
        "keep queue <= 5 and KV use <= 0.8 (all if none)",
    ),
    "bounded-load-filter": PluginType(
        filters.BoundedLoadFilter, filters.BoundedLoadParams, "filter",
        "keep endpoints within 1.25 x the mean in-flight load (KubeAI's bounded loads)",
    ),
    "least-queue-filter": PluginType(
        filters.LeastQueueFilter, filters.NoParams, "filter", "keep the shortest-queue band",
    ),
    "least-kv-cache-filter": PluginType(
        filters.LeastKvCacheFilter, filters.NoParams, "filter", "keep the lowest-KV-use band",
    ),
    "longest-prefix-filter": PluginType(
        filters.LongestPrefixFilter, filters.LongestPrefixParams, "filter",
        "keep the endpoints holding the longest prefix", reads=_reads_prefix,
    ),
    "max-score-picker": PluginType(
        pickers.MaxScorePicker, pickers.PickerParams, "picker", "highest score, random tie-break",
    ),
    "weighted-random-picker": PluginType(
        pickers.WeightedRandomPicker, pickers.PickerParams, "picker",
        "random, proportional to score",
    ),
    "random-picker": PluginType(
        pickers.RandomPicker, pickers.PickerParams, "picker", "uniformly random",
    ),
    "round-robin-picker": PluginType(
        pickers.RoundRobinPicker, pickers.PickerParams, "picker", "cycle through endpoints",
    ),
    # prefill/decode disaggregation (epp/plugins/disagg, docs/disaggregation.md)
    "prefill-filter": PluginType(
        disagg.PrefillFilter, disagg.RoleFilterParams, "filter",
        "keep endpoints that may prefill (llm-d.ai/role prefill, prefill-decode, or unlabelled)",
    ),
    "decode-filter": PluginType(
        disagg.DecodeFilter, disagg.RoleFilterParams, "filter",
        "keep endpoints that may decode (llm-d.ai/role decode, prefill-decode, or unlabelled)",
    ),
    "always-disagg-pd-decider": PluginType(
        disagg.AlwaysDecider, disagg.NoDeciderParams, "decider", "split every request",
    ),
    "never-disagg-pd-decider": PluginType(
        disagg.NeverDecider, disagg.NoDeciderParams, "decider", "split no request",
    ),
    "prefix-based-pd-decider": PluginType(
        disagg.PrefixBasedDecider, disagg.PrefixDeciderParams, "decider",
        "split when the decoder lacks more than nonCachedTokens of the prompt",
        reads=_reads_prefix,
    ),
    "cache-aware-pd-decider": PluginType(
        disagg.CacheAwareDecider, disagg.CacheAwareDeciderParams, "decider",
        "as prefix-based, and only when the prefiller holds as much of the prompt as the decoder",
        reads=_reads_prefix,
    ),
    "load-aware-pd-decider": PluginType(
        disagg.LoadAwareDecider, disagg.LoadAwareDeciderParams, "decider",
        "as prefix-based, and only while the prefiller's waiting prompt tokens exceed the "
        "decoder's by at most slackTokens (a busy prefiller stops taking prefills)",
        reads=_reads_prefix,
    ),
    "disagg-profile-handler": PluginType(
        disagg.DisaggProfileHandler, disagg.DisaggParams, "handler",
        "decode profile, then the prefill profile when the decider splits the request; the "
        "prefiller goes to the decoder in x-prefiller-host-port",
    ),
    # the conformance profile's test hooks (epp/plugins/conformance.py): never in production
    "header-endpoint-selection-filter": PluginType(
        conformance.HeaderEndpointSelectionFilter, conformance.SelectionParams, "filter",
        "conformance tests only: keep the endpoints the test-epp-endpoint-selection header "
        "names, in its order",
    ),
    "first-picker": PluginType(
        conformance.FirstPicker, pickers.PickerParams, "picker",
        "the candidates in the order given (the first is the target)",
    ),
}

FILTERS: dict[str, PluginType[Filter]] = {k: v for k, v in _ALL.items() if v.kind == "filter"}
SCORERS: dict[str, PluginType[Scorer]] = {k: v for k, v in _ALL.items() if v.kind == "scorer"}
PICKERS: dict[str, PluginType[Picker]] = {k: v for k, v in _ALL.items() if v.kind == "picker"}
DECIDERS: dict[str, PluginType[disagg.handler.Decider]] = {
    k: v for k, v in _ALL.items() if v.kind == "decider"
}
HANDLERS: dict[str, PluginType[ProfileHandler]] = {k: v for k, v in _ALL.items() if v.kind == "handler"}
PLUGIN_TYPES: dict[str, PluginType[Any]] = {**PRODUCERS, **_ALL}
