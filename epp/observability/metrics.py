"""Prometheus metrics of epp. Names are an interface: the Grafana dashboard queries them.

Every metric lives in the ``CollectorRegistry`` passed in, so tests build a fresh one and two
servers in one process never collide. Hot-path children are bound once and cached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epp.framework.endpoint import Endpoint, EndpointId
from epp.observability.hotpath import LightCounter, LightHistogram
from epp.observability.llmd import LlmdNames

_DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300)
_NTPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1, 5)
_SIZE_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)

MAX_MODEL_LABELS = 100
"""Distinct ``model`` label values; models first seen after that count under ``other``."""
MAX_FLOW_LABELS = 100
"""Distinct flow-control ``fairness_id`` label values (a budget of their own: the header is
the client's, and its values must not use up the models' labels); later ones as ``other``."""
MAX_LABEL_CHARS = 128
OTHER_MODEL = "other"

_LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class EppMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        # request-path metrics: light implementations (epp/observability/hotpath.py)
        self.requests = LightCounter(
            "epp_requests",
            "Requests by client model and final status (HTTP code, or 'cancelled' when the stream "
            "ended before the response completed).",
            ["model", "status"],
            registry=r,
        )
        self.scheduling_duration = LightHistogram(
            "epp_scheduling_duration_seconds",
            "Time to pick an endpoint (parse excluded).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.plugin_duration = LightHistogram(
            "epp_plugin_duration_seconds",
            "Time spent in each scheduling plugin per request.",
            ["plugin"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.loop_lag = LightHistogram(
            "epp_event_loop_lag_seconds",
            "How much later than asked epp's event loop ran a 0.1 s timer: every stream through "
            "epp (in full-duplex response mode, every streamed reply's chunks) waits as long.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.index_entries = Gauge(
            "epp_prefix_index_entries", "Chunk entries held by the prefix index.", registry=r
        )
        self.index_hit_ratio = Gauge(
            "epp_prefix_index_hit_ratio",
            "Share of looked-up prompt chunks found in the index since the previous refresh.",
            registry=r,
        )
        self.index_evictions = Gauge(
            "epp_prefix_index_evictions", "Entries evicted by LRU so far.", registry=r
        )
        self.pool_queue = Gauge(
            "epp_pool_average_queue_size", "Mean waiting requests over ready endpoints.", registry=r
        )
        self.pool_kv = Gauge(
            "epp_pool_average_kv_cache_utilization",
            "Mean KV-cache use (0..1) over ready endpoints.",
            registry=r,
        )
        self.pool_ready = Gauge(
            "epp_pool_ready_endpoints", "Endpoints with fresh metrics.", registry=r
        )
        self.pool_endpoints = Gauge("epp_pool_endpoints", "Endpoints known.", registry=r)
        self.endpoint_in_flight = Gauge(
            "epp_endpoint_in_flight_requests",
            "Requests epp routed to the endpoint that have not finished.",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_queue = Gauge(
            "epp_endpoint_queue_size", "Waiting requests reported by the endpoint.", ["endpoint"],
            registry=r,
        )
        self.endpoint_kv = Gauge(
            "epp_endpoint_kv_cache_utilization", "KV-cache use (0..1) reported by the endpoint.",
            ["endpoint"], registry=r,
        )
        self.endpoint_stale = Gauge(
            "epp_endpoint_metrics_stale", "1 when the endpoint's metrics are stale.", ["endpoint"],
            registry=r,
        )
        self.prompt_tokens = LightCounter(
            "epp_usage_prompt_tokens", "Prompt tokens reported by model servers.", ["model"],
            registry=r,
        )
        self.cached_tokens = LightCounter(
            "epp_usage_cached_tokens", "Prompt tokens the server reported as served from cache.",
            ["model"], registry=r,
        )
        self.completion_tokens = LightCounter(
            "epp_usage_completion_tokens", "Completion tokens reported by model servers.",
            ["model"], registry=r,
        )
        self.first_token_time = LightHistogram(
            "epp_time_to_first_token_seconds",
            "Seconds from epp's pick to the response's first body bytes (a streamed answer's "
            "first token), as epp saw them.",
            ["model"], buckets=_DURATION_BUCKETS, registry=r,
        )
        self.scrape_errors = Counter(
            "epp_scrape_errors", "Failed metrics scrapes.", ["endpoint", "reason"], registry=r
        )
        self.scrapes = Counter("epp_scrapes", "Successful metrics scrapes.", registry=r)
        self.scrape_periods = Gauge(
            "epp_scrape_period_seconds",
            "Seconds between two scrapes of the endpoint: scraping.intervalSeconds, stretched "
            "to keep its scrapes under scraping.serverShare of its time.", ["endpoint"], registry=r,
        )  # fmt: skip
        self.scrape_values_rejected = Counter(
            "epp_scrape_values_rejected",
            "Sample values read from model servers' /metrics pages that were rejected "
            "(not_a_number, not_finite) or clamped (negative, too_large); see "
            "epp/datastore/metricsparse.py.",
            ["family", "reason"],
            registry=r,
        )
        self.internal_errors = Counter(
            "epp_internal_errors",
            "Requests epp answered 500 because of a fault of its own (an exception that is no "
            "domain error), by the stage that raised: the ext_proc message being handled "
            "(request_headers, request_body, response_body...), admission (preparation and "
            "flow control) or routing (a prepared request). Each is logged with its traceback; "
            "the stream keeps serving.",
            ["stage"],
            registry=r,
        )
        self.endpoint_resets = Counter(
            "epp_endpoint_identity_changes",
            "Times the server behind an endpoint address changed and epp dropped what it "
            "believed about it (prefix index, metrics, in-flight counts): 'replaced' (a new "
            "pod at the same address), 'restarted' (a new process start time, or counters "
            "that went backwards), 'model_changed' (it serves another model).",
            ["reason"], registry=r,
        )
        self.endpoint_not_serving = Gauge(
            "epp_endpoint_not_serving",
            "1 while the endpoint reports it cannot serve now and is out of the candidates "
            "(vLLM's sleep mode: weights offloaded or discarded).", ["endpoint"], registry=r,
        )
        self.endpoint_not_serving_transitions = Counter(
            "epp_endpoint_not_serving_transitions",
            "Times an endpoint left the candidates because it reported it cannot serve "
            "(its prefix-cache entries are forgotten then).", ["reason"], registry=r,
        )
        self.answered = Counter(
            "epp_answered_requests",
            "Requests epp answered itself with an error status instead of routing them (or "
            "after routing them: a response over its limits), by HTTP status and reason: the "
            "answer's error.reason (queue-full, band-full, displaced, queue-timeout, shed, "
            "no-endpoints, shutting-down), max-open-streams, else the error's type "
            "(invalid_request_error...). A model "
            "server's own error statuses are never counted here (epp_requests_total has them).",
            ["status", "reason"],
            registry=r,
        )
        self.held_bytes = Gauge(
            "epp_held_bytes",
            "Bytes epp holds for requests, by kind, each under its own bound: request bodies "
            "being read (--max-buffered-bytes), responses being read (--max-buffered-response-"
            "bytes), prompts and chain hashes kept to learn from replies (--max-learning-bytes).",
            ["kind"], registry=r,
        )
        self.learning_dropped = Gauge(
            "epp_learning_dropped_requests",
            "Requests routed with --max-learning-bytes spent: their replies were not learnt "
            "from (a running total).", registry=r,
        )
        self.task_failures = Counter(
            "epp_background_task_failures",
            "Background task runs that raised and were restarted by the supervisor.",
            ["task"],
            registry=r,
        )
        # --- index sync between replicas (epp/sync, docs/sync.md) ---
        self.sync_published = Counter(
            "epp_sync_records_published",
            "Index writes this replica made itself and offered to its peers.",
            registry=r,
        )
        self.sync_sent = Counter(
            "epp_sync_records_sent", "Records streamed to subscribed peers (summed over peers).",
            registry=r,
        )
        self.sync_applied = Counter(
            "epp_sync_records_applied", "Records received from peers and written to the index.",
            registry=r,
        )
        self.sync_dropped = Counter(
            "epp_sync_records_dropped",
            "Records lost: 'slow_subscriber' (a peer read too slowly and the bounded buffer "
            "overwrote them, counted by the publisher) or 'unknown_endpoint' (received for an "
            "endpoint not in this replica's pool).",
            ["reason"],
            registry=r,
        )
        self.sync_peers = Gauge("epp_sync_peers", "Peers this replica subscribes to.", registry=r)
        self.sync_follow_failures = Counter(
            "epp_sync_follow_failures", "Subscriptions to a peer that failed or ended (each "
            "is retried with backoff): a peer down, refusing this replica, or unreachable.",
            registry=r,
        )
        self.sync_peers_connected = Gauge(
            "epp_sync_peers_connected", "Peers with an open subscription stream.", registry=r
        )
        self.sync_subscribers = Gauge(
            "epp_sync_subscribers", "Peers currently subscribed to this replica.", registry=r
        )
        self.sync_peer_prefill = Gauge(
            "epp_sync_peer_prefill_tokens",
            "Uncached prompt tokens the other replicas report in flight (sent, no first token "
            "yet), summed over the endpoints: what this replica adds to its own queue estimates.",
            registry=r,
        )
        # --- responses on an observer filter's stream (--response-observer) ---
        self.observer = Counter(
            "epp_response_observer_requests",
            "Routed requests by how their response was observed (--response-observer): "
            "'claimed' (an observer stream on this replica), 'claimed_by_peer' (on a peer, "
            "reported over sync), 'unobserved' (none came in time: released), 'foreign' "
            "(an observer stream or access log entry here named another replica's request "
            "and sync is off), 'forwarded' (observations of peers' requests sent to them); "
            "with the response summary (epp envoy-config's default): 'handed_over' (a streamed "
            "answer left to the access log after its first bytes), 'summarized' (ended by an "
            "access log entry here).",
            ["outcome"],
            registry=r,
        )
        self._observer_seen: dict[str, int] = {}
        self._inference_extension_metrics(r)
        self.sync_dropped_slow = self.sync_dropped.labels("slow_subscriber")
        self.sync_dropped_unknown = self.sync_dropped.labels("unknown_endpoint")
        self._request_children: dict[tuple[str, str], Any] = {}
        self._plugin_children: dict[str, Any] = {}
        self._usage_children: dict[str, tuple[Any, Any, Any]] = {}
        self._endpoint_labels: set[str] = set()
        self._models: set[str] = set()
        self._flows: set[str] = set()
        self._last_lookup_chunks = 0
        self._last_hit_chunks = 0
        self.observe_scheduling: Callable[[float], None] = self.scheduling_duration.observe

    # --- the Inference Extension's names (docs/serve.md), so its dashboards and alerts work ---

    def _inference_extension_metrics(self, r: CollectorRegistry) -> None:
        objective = ["model_name", "target_model_name"]
        self.objective_requests = LightCounter(
            "inference_objective_request", "Requests per client model and served (target) model.",
            objective, registry=r,
        )
        self.objective_errors = LightCounter(
            "inference_objective_request_error",
            "Requests that ended with an error status (from epp or the model server).",
            [*objective, "error_code"], registry=r,
        )
        self.objective_duration = LightHistogram(
            "inference_objective_request_duration_seconds",
            "Time from routing to the end of the response.", objective, registry=r,
            buckets=_DURATION_BUCKETS,
        )
        self.objective_ntpot = LightHistogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            "Request duration divided by the output tokens.", objective, registry=r,
            buckets=_NTPOT_BUCKETS,
        )
        self.objective_request_sizes = LightHistogram(
            "inference_objective_request_sizes", "Request body sizes, bytes.", objective,
            registry=r, buckets=_SIZE_BUCKETS,
        )
        self.objective_response_sizes = LightHistogram(
            "inference_objective_response_sizes", "Response body sizes, bytes.", objective,
            registry=r, buckets=_SIZE_BUCKETS,
        )
        self.objective_input_tokens = LightHistogram(
            "inference_objective_input_tokens", "Prompt tokens (from usage).", objective,
            registry=r, buckets=_TOKEN_BUCKETS,
        )
        self.objective_output_tokens = LightHistogram(
            "inference_objective_output_tokens", "Output tokens (from usage).", objective,
            registry=r, buckets=_TOKEN_BUCKETS,
        )
        self.objective_running = Gauge(
            "inference_objective_running_requests", "Requests in flight per client model.",
            ["model_name"], registry=r,
        )
        self.pool_average_kv = Gauge(
            "inference_pool_average_kv_cache_utilization",
            "Mean KV-cache use (0..1) over ready endpoints.", ["name"], registry=r,
        )
        self.pool_average_queue = Gauge(
            "inference_pool_average_queue_size", "Mean waiting requests over ready endpoints.",
            ["name"], registry=r,
        )
        self.pool_pod_queue = Gauge(
            "inference_pool_per_pod_queue_size", "Waiting requests per endpoint.",
            ["name", "model_server_pod"], registry=r,
        )
        self.pool_ready_pods = Gauge(
            "inference_pool_ready_pods", "Endpoints with fresh metrics.", ["name"], registry=r,
        )
        self.extension_info = Gauge(
            "inference_extension_info", "Build information (value 1).", ["commit", "build_ref"],
            registry=r,
        )
        self.scheduler_attempts = Counter(
            "inference_extension_scheduler_attempts",
            "Scheduling attempts: success, or failure (no endpoint, shed).", ["status"],
            registry=r,
        )
        self.scheduled = self.scheduler_attempts.labels("success").inc
        self.schedule_failed = self.scheduler_attempts.labels("failure").inc
        flow = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]
        self.flow_queue_size = Gauge(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in epp's flow-control queue.", flow, registry=r,
        )
        self.flow_queue_bytes = Gauge(
            "inference_extension_flow_control_queue_bytes",
            "Body bytes of the requests waiting in the flow-control queue.", flow, registry=r,
        )
        self.flow_queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time a request spent in the flow-control queue, by how it left (dispatched, "
            "expired, displaced, cancelled, shutdown).", [*flow[:2], "outcome", *flow[2:]],
            registry=r, buckets=_DURATION_BUCKETS,
        )
        self.flow_dispatch_cycle = Histogram(
            "inference_extension_flow_control_dispatch_cycle_duration_seconds",
            "Duration of one dispatch cycle (expiry and release).", ["inference_pool"],
            registry=r, buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1),
        )
        self.flow_pool_saturation = Gauge(
            "inference_extension_flow_control_pool_saturation",
            "How full the pool is for flow control: the share of endpoints over a threshold, "
            "or of the concurrency slots in use (1: requests queue).", ["inference_pool"],
            registry=r,
        )
        # llm-d's names for all of the above, read from them at scrape time (llmd.py)
        r.register(LlmdNames([
            self.objective_requests, self.objective_errors, self.objective_duration,
            self.objective_ntpot, self.objective_request_sizes, self.objective_response_sizes,
            self.objective_input_tokens, self.objective_output_tokens, self.objective_running,
            self.pool_average_kv, self.pool_average_queue, self.pool_pod_queue,
            self.pool_ready_pods, self.extension_info, self.scheduler_attempts,
            self.scheduling_duration, self.flow_queue_size, self.flow_queue_bytes,
            self.flow_queue_duration, self.flow_dispatch_cycle, self.flow_pool_saturation,
        ]))  # fmt: skip
        self.pool_waiting = Gauge(
            "epp_pool_waiting_requests",
            "Requests waiting in epp's flow-control queue for this pool now, whether the pool "
            "is saturated or has no ready endpoint (scale from zero): the demand an "
            "autoscaler (KEDA, HPA) should scale the pool on. Read live at every scrape.",
            ["inference_pool"], registry=r,
        )
        self._flow_labels: set[tuple[str, ...]] = set()
        self.pool_name = "static"
        self._objective_children: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._running_children: dict[str, Any] = {}

    def flow_left(self, flow: str, band: int, outcome: str, model: str, target: str,
                  wait_s: float) -> None:  # fmt: skip
        """A request left the flow-control queue after ``wait_s``."""
        self.flow_queue_duration.labels(
            self.flow_label(flow), str(band), outcome, self.pool_name, self.model_label(model),
            self.model_label(target),
        ).observe(wait_s)

    def flow_refresh(
        self, queued: Mapping[tuple[str, int, str, str], tuple[int, int]], saturation: float
    ) -> None:
        """Queue gauges from ``(flow, band, model, target) -> (requests, bytes)``."""
        seen: set[tuple[str, ...]] = set()
        for (flow, band, model, target), (n, size) in queued.items():
            key = (self.flow_label(flow), str(band), self.pool_name, self.model_label(model),
                   self.model_label(target))  # fmt: skip
            seen.add(key)
            self.flow_queue_size.labels(*key).set(n)
            self.flow_queue_bytes.labels(*key).set(size)
        for gone in self._flow_labels - seen:
            self.flow_queue_size.labels(*gone).set(0)
            self.flow_queue_bytes.labels(*gone).set(0)
        self._flow_labels |= seen
        self.flow_pool_saturation.labels(self.pool_name).set(saturation)

    def endpoint_reset(self, endpoint_id: str, reason: str) -> None:
        """Another server is behind ``endpoint_id``: what epp knew of the old one is gone."""
        self.endpoint_resets.labels(reason).inc()

    def endpoint_serving(self, endpoint_id: str, reason: str) -> None:
        """The endpoint stopped serving (``reason``) or serves again ('')."""
        if reason:
            self.endpoint_not_serving_transitions.labels(reason).inc()
        self.endpoint_not_serving.labels(endpoint_id).set(1 if reason else 0)

    def set_build(self, commit: str, build_ref: str) -> None:
        self.extension_info.labels(commit, build_ref).set(1)

    def request_running(self, model: str, delta: int) -> None:
        label = self.model_label(model)  # bounded: the dict below cannot grow past 101 keys
        child = self._running_children.get(label)
        if child is None:
            child = self._running_children[label] = self.objective_running.labels(label)
        child.inc(delta)

    def objective_done(
        self, model: str, target: str, status: int, duration_s: float, request_bytes: int,
        response_bytes: int, input_tokens: int, output_tokens: int,
    ) -> None:
        """One request's Inference Extension metrics (the request has finished)."""
        key = (self.model_label(model), self.model_label(target))
        c = self._objective_children.get(key)
        if c is None:
            c = self._objective_children[key] = (
                self.objective_requests.labels(*key), self.objective_duration.labels(*key),
                self.objective_ntpot.labels(*key), self.objective_request_sizes.labels(*key),
                self.objective_response_sizes.labels(*key),
                self.objective_input_tokens.labels(*key),
                self.objective_output_tokens.labels(*key),
            )  # fmt: skip
        c[0].inc()
        if status >= 400:
            self.objective_errors.labels(*key, str(status)).inc()
            return
        c[1].observe(duration_s)
        c[3].observe(request_bytes)
        c[4].observe(response_bytes)
        if input_tokens:
            c[5].observe(input_tokens)
        if output_tokens:
            c[6].observe(output_tokens)
            c[2].observe(duration_s / output_tokens)

    # --- background --------------------------------------------------------------------

    def scrape_ok(self) -> None:
        self.scrapes.inc()

    def scrape_failed(self, endpoint_id: str, reason: str) -> None:
        self.scrape_errors.labels(endpoint_id, reason).inc()

    def task_failed(self, kind: str) -> None:
        self.task_failures.labels(kind).inc()

    def scrape_value_rejected(self, family: str, reason: str) -> None:
        self.scrape_values_rejected.labels(family, reason).inc()

    def scrape_period(self, endpoint_id: str, seconds: float) -> None:
        self.scrape_periods.labels(endpoint_id).set(seconds)

    def scrape_target_removed(self, endpoint_id: str) -> None:
        with contextlib.suppress(KeyError):
            self.scrape_periods.remove(endpoint_id)

    # --- request path ------------------------------------------------------------------

    def model_label(self, model: str) -> str:
        """``model`` as a label value: the first MAX_MODEL_LABELS names as they are (cut to
        MAX_LABEL_CHARS), any later one as ``other``, so clients cannot mint series."""
        return _bounded_label(self._models, MAX_MODEL_LABELS, model)

    def flow_label(self, flow: str) -> str:
        """A flow-control fairness id as a label value: bounded as ``model_label``, with a
        budget of its own (``MAX_FLOW_LABELS``)."""
        return _bounded_label(self._flows, MAX_FLOW_LABELS, flow)

    def request_done(self, model: str, status: str) -> None:
        model = self.model_label(model)
        key = (model, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(model, status)
        child.inc()

    def answered_by_epp(self, status: int, reason: str) -> None:
        """Label values come from epp's code (the error table and the errors' reasons), a
        bounded set."""
        self.answered.labels(str(status), reason).inc()

    def plugin_timings(self, timings: Mapping[str, float]) -> None:
        children = self._plugin_children
        for name, seconds in timings.items():
            child = children.get(name)
            if child is None:
                child = children[name] = self.plugin_duration.labels(name)
            child.observe(seconds)

    def usage(self, model: str, prompt: int, cached: int | None, completion: int) -> None:
        model = self.model_label(model)
        c = self._usage_children.get(model)
        if c is None:
            c = self._usage_children[model] = (
                self.prompt_tokens.labels(model),
                self.cached_tokens.labels(model),
                self.completion_tokens.labels(model),
            )
        c[0].inc(prompt)
        if cached:
            c[1].inc(cached)
        c[2].inc(completion)

    def first_token(self, model: str, seconds: float) -> None:
        self.first_token_time.labels(self.model_label(model)).observe(seconds)

    # --- periodic refresh --------------------------------------------------------------

    def observer_refresh(self, counts: dict[str, int]) -> None:
        """Periodic: the observer handoff's running counts (plain ints on the request
        path) into ``epp_response_observer_requests``."""
        seen = self._observer_seen
        for outcome, total in counts.items():
            delta = total - seen.get(outcome, 0)
            if delta > 0:
                self.observer.labels(outcome).inc(delta)
                seen[outcome] = total

    def refresh_pool(
        self,
        endpoints: Iterable[Endpoint],
        index_stats: Any = None,
        in_flight: Mapping[EndpointId, int] | None = None,
    ) -> None:
        """Recompute pool and per-endpoint gauges (called by a background task, not per request).
        ``in_flight``: requests in flight per endpoint (``Datastore.in_flight()``)."""
        in_flight = in_flight or {}
        seen: set[str] = set()
        ready = total = 0
        queue_sum = 0
        kv_sum = 0.0
        for e in endpoints:
            total += 1
            seen.add(e.id)
            self.endpoint_in_flight.labels(e.id).set(in_flight.get(e.id, 0))
            self.endpoint_queue.labels(e.id).set(e.metrics.waiting)
            self.endpoint_kv.labels(e.id).set(e.metrics.kv_usage)
            self.endpoint_stale.labels(e.id).set(1 if e.stale else 0)
            self.endpoint_not_serving.labels(e.id).set(1 if e.metrics.not_serving else 0)
            self.pool_pod_queue.labels(self.pool_name, e.id).set(e.metrics.waiting)
            if not e.stale and e.metrics.known and not e.metrics.not_serving:
                ready += 1
                queue_sum += e.metrics.waiting
                kv_sum += e.metrics.kv_usage
        for gone in self._endpoint_labels - seen:
            with contextlib.suppress(KeyError):
                self.pool_pod_queue.remove(self.pool_name, gone)
            for g in (self.endpoint_in_flight, self.endpoint_queue, self.endpoint_kv,
                      self.endpoint_stale, self.endpoint_not_serving):
                with contextlib.suppress(KeyError):
                    g.remove(gone)
        self._endpoint_labels = seen
        self.pool_endpoints.set(total)
        self.pool_ready.set(ready)
        self.pool_queue.set(queue_sum / ready if ready else 0.0)
        self.pool_kv.set(kv_sum / ready if ready else 0.0)
        name = self.pool_name
        self.pool_ready_pods.labels(name).set(ready)
        self.pool_average_queue.labels(name).set(queue_sum / ready if ready else 0.0)
        self.pool_average_kv.labels(name).set(kv_sum / ready if ready else 0.0)
        if index_stats is not None:
            self.index_entries.set(getattr(index_stats, "entries", 0))
            self.index_evictions.set(getattr(index_stats, "evictions", 0))
            lookups = getattr(index_stats, "lookup_chunks", 0)
            hits = getattr(index_stats, "hit_chunks", 0)
            d_lookups = lookups - self._last_lookup_chunks
            if d_lookups > 0:
                self.index_hit_ratio.set((hits - self._last_hit_chunks) / d_lookups)
            self._last_lookup_chunks = lookups
            self._last_hit_chunks = hits


def _bounded_label(seen: set[str], most: int, value: str) -> str:
    """``value`` cut to MAX_LABEL_CHARS, as it is among the first ``most`` values ``seen``,
    else ``other`` (the cut value is what is kept and looked up)."""
    if len(value) > MAX_LABEL_CHARS:
        value = value[:MAX_LABEL_CHARS]
    if value in seen:
        return value
    if len(seen) >= most:
        return OTHER_MODEL
    seen.add(value)
    return value
