"""Real vLLM started with ``--otlp-traces-endpoint``: its span of a request lands in the trace
the client started, under epp's ``epp.upstream`` (whose context epp put in the ``traceparent``
Envoy sent to vLLM), next to epp's spans naming the pick. The same run as
``python -m simulator.vllm.tracedemo``, which prints it."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import vllm
from simulator.vllm.tracedemo import trace_one_request

pytestmark = [pytest.mark.vllm]


async def test_vllms_span_lands_in_the_clients_trace_under_epps(tmp_path: Path) -> None:
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        pytest.skip(reason)
    traced = await trace_one_request(tmp_path)
    by_name = {(s.service, s.name): s for s in traced.spans}
    root = by_name["epp", "epp.request"]
    assert root.parent_span_id == traced.client_span_id
    upstream = by_name["epp", "epp.upstream"]
    served = [s for s in traced.spans if s.service == "vllm"]
    assert served, traced.tree()
    (request,) = [s for s in served if s.name == "llm_request"]
    assert request.parent_span_id == upstream.span_id, traced.tree()
    assert request.attributes["gen_ai.usage.completion_tokens"] == 8
    picked = by_name["epp", "epp.schedule"].attributes["epp.pick.endpoint"]
    assert upstream.attributes["server.port"] == int(str(picked).rsplit(":", 1)[1])
    assert upstream.attributes["gen_ai.usage.output_tokens"] == 8
