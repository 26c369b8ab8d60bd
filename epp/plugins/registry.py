"""The one place plugin types are named. Config files refer to these type names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epp.plugins import filters, pickers, scorers


@dataclass(slots=True, frozen=True)
class PluginType:
    factory: Callable[[str, Any], Any]
    params: type
    kind: str  # "filter" | "scorer" | "picker"
    summary: str


PLUGIN_TYPES: dict[str, PluginType] = {
    "prefix-cache-scorer": PluginType(
        scorers.PrefixCacheScorer, scorers.PrefixCacheScorerParams, "scorer",
        "matched leading chunks / request chunks, from the prefix index",
    ),
    "queue-scorer": PluginType(
        scorers.QueueScorer, scorers.QueueScorerParams, "scorer",
        "shorter queue (waiting + sent since last scrape) scores higher, min-max normalised",
    ),
    "kv-cache-utilization-scorer": PluginType(
        scorers.KvCacheUtilizationScorer, scorers.KvCacheScorerParams, "scorer",
        "1 - KV-cache use",
    ),
    "lora-affinity-scorer": PluginType(
        scorers.LoraAffinityScorer, scorers.LoraAffinityScorerParams, "scorer",
        "adapter running > free slot > waiting > none",
    ),
    "lora-affinity-filter": PluginType(
        filters.LoraAffinityFilter, filters.NoParams, "filter",
        "keep the best LoRA tier",
    ),
    "load-threshold-filter": PluginType(
        filters.LoadThresholdFilter, filters.LoadThresholdParams, "filter",
        "keep queue <= 5 and KV use <= 0.8 (all if none)",
    ),
    "least-queue-filter": PluginType(
        filters.LeastQueueFilter, filters.NoParams, "filter", "keep the shortest-queue band",
    ),
    "least-kv-cache-filter": PluginType(
        filters.LeastKvCacheFilter, filters.NoParams, "filter", "keep the lowest-KV-use band",
    ),
    "longest-prefix-filter": PluginType(
        filters.LongestPrefixFilter, filters.LongestPrefixParams, "filter",
        "keep the endpoints holding the longest prefix",
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
}
