"""llm-d's metric names: the reference picker (llm-d's router, where the Inference
Extension's picker now lives) exports ``llm_d_epp_*`` and keeps the ``inference_*`` names as
deprecated aliases. epp does the same, so dashboards and alerts built for either work.

The ``llm_d_epp_*`` families are not a second set of counters: ``LlmdNames`` reads the
``inference_*`` collectors when Prometheus scrapes and yields each family again under its
llm-d name (labels renamed where llm-d renamed them), so the request path updates one
counter per event and a scrape costs one extra pass over these families.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

LLMD_NAMES: Mapping[str, str] = {
    # family name (as prometheus_client reports it: no _total) -> llm-d's
    "inference_objective_request": "llm_d_epp_request",
    "inference_objective_request_error": "llm_d_epp_request_error",
    "inference_objective_request_duration_seconds": "llm_d_epp_request_duration_seconds",
    "inference_objective_normalized_time_per_output_token_seconds": "llm_d_epp_request_ntpot_seconds",
    "inference_objective_request_sizes": "llm_d_epp_request_size_bytes",
    "inference_objective_response_sizes": "llm_d_epp_response_size_bytes",
    "inference_objective_input_tokens": "llm_d_epp_request_input_tokens",
    "inference_objective_output_tokens": "llm_d_epp_request_output_tokens",
    "inference_objective_running_requests": "llm_d_epp_request_running",
    "inference_pool_average_kv_cache_utilization": "llm_d_epp_average_kv_cache_utilization",
    "inference_pool_average_queue_size": "llm_d_epp_average_queue_size",
    "inference_pool_per_pod_queue_size": "llm_d_epp_per_endpoint_queue_size",
    "inference_pool_ready_pods": "llm_d_epp_ready_endpoints",
    "inference_extension_info": "llm_d_epp_info",
    "inference_extension_scheduler_attempts": "llm_d_epp_scheduler_attempts",
    "epp_scheduling_duration_seconds": "llm_d_epp_scheduler_e2e_duration_seconds",
    "inference_extension_flow_control_queue_size": "llm_d_epp_flow_control_queue_size",
    "inference_extension_flow_control_queue_bytes": "llm_d_epp_flow_control_queue_bytes",
    "inference_extension_flow_control_request_queue_duration_seconds":
        "llm_d_epp_flow_control_request_queue_duration_seconds",
    "inference_extension_flow_control_dispatch_cycle_duration_seconds":
        "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
    "inference_extension_flow_control_pool_saturation": "llm_d_epp_flow_control_pool_saturation",
}  # fmt: skip

LLMD_LABELS: Mapping[str, str] = {"model_server_pod": "model_server_endpoint"}
"""Labels llm-d renamed (the per-endpoint queue gauge)."""


def renamed(family: Metric, name: str) -> Metric:
    """``family`` under ``name``: its samples' names and labels renamed, values shared."""
    out = Metric(name, family.documentation, family.type, family.unit)
    old = family.name
    for s in family.samples:
        labels = {LLMD_LABELS.get(k, k): v for k, v in s.labels.items()}
        out.samples.append(Sample(name + s.name[len(old):], labels, s.value, s.timestamp, s.exemplar))
    return out


class LlmdNames(Collector):
    """Yields the ``inference_*`` (and scheduling) families of ``sources`` under llm-d's
    names (``LLMD_NAMES``), at scrape time."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self._sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                name = LLMD_NAMES.get(family.name)
                if name is not None:
                    yield renamed(family, name)

    def describe(self) -> Iterator[Metric]:
        return iter(())
