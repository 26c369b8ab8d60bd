"""epp exports the Inference Extension's metric names, so its users' dashboards and alerts work."""

from __future__ import annotations

import json

import grpc

from epp.observability.llmd import LLMD_LABELS, LLMD_NAMES
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import start_epp, stop_epp

LLMD_LABELS_BACK = {v: k for k, v in LLMD_LABELS.items()}
BODY = json.dumps({"model": "m", "prompt": "hello " * 100}).encode()
ANSWER = json.dumps({"choices": [{"text": "ok"}],
                     "usage": {"prompt_tokens": 120, "completion_tokens": 8}}).encode()  # fmt: skip


async def test_a_request_moves_the_inference_extension_metrics() -> None:
    e = await start_epp()
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(), ec.request_body(BODY, True))
        await s.recv_n(2)
        reg = e.handle.registry
        labels = {"model_name": "m", "target_model_name": "m"}
        assert reg.get_sample_value("inference_objective_running_requests", {"model_name": "m"}) == 1
        await s.send(ec.response_headers(), ec.response_body(ANSWER, True))
        await s.recv_n(2)
        assert await s.close() == grpc.StatusCode.OK
        assert reg.get_sample_value("inference_objective_request_total", labels) == 1
        assert reg.get_sample_value("inference_objective_request_duration_seconds_count", labels) == 1
        assert reg.get_sample_value("inference_objective_request_sizes_sum", labels) == len(BODY)
        assert reg.get_sample_value("inference_objective_response_sizes_sum", labels) == len(ANSWER)
        assert reg.get_sample_value("inference_objective_input_tokens_sum", labels) == 120
        assert reg.get_sample_value("inference_objective_output_tokens_sum", labels) == 8
        assert reg.get_sample_value(
            "inference_objective_normalized_time_per_output_token_seconds_count", labels) == 1
        assert reg.get_sample_value("inference_objective_running_requests", {"model_name": "m"}) == 0
        assert reg.get_sample_value("inference_extension_scheduler_attempts_total", {"status": "success"}) == 1

        s = ec.Stream(e.channel)  # an error epp answers itself
        await s.send(ec.request_headers(), ec.request_body(b"{", True))
        await s.recv()
        err = {"model_name": "", "target_model_name": "", "error_code": "400"}
        assert reg.get_sample_value("inference_objective_request_error_total", err) == 1

        e.handle.metrics.refresh_pool(e.handle.datastore.snapshot())
        assert reg.get_sample_value("inference_pool_ready_pods", {"name": "static"}) == 4
        pods = [s for m in reg.collect() if m.name == "inference_pool_per_pod_queue_size" for s in m.samples]
        assert len(pods) == 4
        info = [s for m in reg.collect() if m.name == "inference_extension_info" for s in m.samples]
        assert len(info) == 1 and info[0].value == 1

        # llm-d's names carry the same samples (labels renamed where llm-d renamed them)
        families = {m.name: m for m in reg.collect()}
        for old_name, new_name in LLMD_NAMES.items():
            assert new_name in families, new_name
            old_samples = sorted((x.name.replace(old_name, ""), sorted(x.labels.items()), x.value)
                                 for x in families[old_name].samples)
            new_samples = sorted((x.name.replace(new_name, ""),
                                  sorted((LLMD_LABELS_BACK.get(k, k), v) for k, v in x.labels.items()),
                                  x.value) for x in families[new_name].samples)
            assert old_samples == new_samples, new_name
        assert reg.get_sample_value("llm_d_epp_request_total", labels) == 1
        assert reg.get_sample_value("llm_d_epp_request_input_tokens_sum", labels) == 120
        assert reg.get_sample_value("llm_d_epp_ready_endpoints", {"name": "static"}) == 4
        assert len([x for x in families["llm_d_epp_per_endpoint_queue_size"].samples
                    if "model_server_endpoint" in x.labels]) == 4
    finally:
        await stop_epp(e)


async def test_with_response_body_mode_none_a_request_ends_with_its_status_not_cancelled() -> None:
    """Envoy sends no response body to epp in mode NONE and ends the stream with the exchange:
    the request is done with the status of its response headers."""
    e = await start_epp()
    try:
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(modes=(ec.FULL_DUPLEX, ec.NONE)), ec.request_body(BODY, True))
        await s.recv_n(2)
        reg = e.handle.registry
        await s.send(ec.response_headers(status=200))
        await s.recv()
        assert reg.get_sample_value("inference_objective_running_requests", {"model_name": "m"}) == 1
        assert await s.close() == grpc.StatusCode.OK
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "200"}) == 1
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) is None
        labels = {"model_name": "m", "target_model_name": "m"}
        assert reg.get_sample_value("inference_objective_request_duration_seconds_count", labels) == 1
        assert reg.get_sample_value("inference_objective_running_requests", {"model_name": "m"}) == 0
        assert sum(e.handle.datastore.in_flight().values()) == 0

        s = ec.Stream(e.channel)  # an upstream error status is that status
        await s.send(ec.request_headers(modes=(ec.FULL_DUPLEX, ec.NONE)), ec.request_body(BODY, True))
        await s.recv_n(2)
        await s.send(ec.response_headers(status=503))
        await s.recv()
        assert await s.close() == grpc.StatusCode.OK
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "503"}) == 1
        # the server's 503, not epp's: EppShedding reads epp_answered_requests_total
        assert not [s for m in reg.collect() if m.name == "epp_answered_requests" for s in m.samples
                    if s.name.endswith("_total")]  # fmt: skip

        # a stream that ends before any response headers: Envoy ends it so both when the
        # client leaves and, with response headers SKIP (``--response none``), once the
        # request is routed; epp cannot tell them apart and reports it routed, outcome unknown
        s = ec.Stream(e.channel)
        await s.send(ec.request_headers(modes=(ec.FULL_DUPLEX, ec.NONE)), ec.request_body(BODY, True))
        await s.recv_n(2)
        assert await s.close() == grpc.StatusCode.OK
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "routed"}) == 1
        assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) is None
        assert sum(e.handle.datastore.in_flight().values()) == 0
    finally:
        await stop_epp(e)
