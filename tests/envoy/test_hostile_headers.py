"""Client headers that steer epp, sent through real Envoy with the bootstrap ``epp
envoy-config`` generates (fail-open): a bad value is answered by epp, never passed through
unrouted (as it would be if it ended epp's ext_proc stream and Envoy failed open)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from epp.config.loader import shipped_text
from tests.envoy.conftest import MODEL, Pool, chat, pool, until_epp_routes


def served(p: Pool) -> list[float]:
    """Requests each server completed (its own ``vllm:request_success_total``)."""
    return [r.emulator.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": MODEL, "finished_reason": "length"}) or 0.0
        for r in p.replicas]  # fmt: skip


def flow_control_config(tmp_path: Path) -> Path:
    path = tmp_path / "flow.yaml"
    text = shipped_text("default")
    path.write_text(text + "\nflowControl:\n  enabled: true\n  maxQueueSeconds: 12\n")
    return path


@pytest.mark.parametrize("deadline", ["²", "9" * 5000, "soon"])
async def test_a_bad_deadline_header_is_answered_400_by_epp_not_passed_through(
    tmp_path: Path, http: aiohttp.ClientSession, deadline: str
) -> None:
    config = flow_control_config(tmp_path)
    async with pool(tmp_path, replicas=2, epp_args=("--config", str(config))) as p:
        await until_epp_routes(p, http)
        before = served(p)
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello"),
                             headers={"x-gateway-request-deadline-ms": deadline}) as r:  # fmt: skip
            body = await r.json()
            assert r.status == 400, body
        assert "x-gateway-request-deadline-ms" in body["error"]["message"]
        assert served(p) == before  # no server saw it
        async with http.post(p.url + "/v1/chat/completions", json=chat("hello"),
                             headers={"x-gateway-request-deadline-ms": "20000"}) as r:  # fmt: skip
            assert r.status == 200
        assert await p.epps[0].metric("epp_internal_errors_total") == 0
