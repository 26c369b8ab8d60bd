"""Envoy's access log (``EnvoyOptions.access_log``): one JSON line per request, keyed by the
client's ``x-request-id``, with where the time went (epp's pick, the server's first body
bytes), read back by ``simulator.envoy.read_access_log``."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from simulator.envoy import read_access_log
from tests.envoy.conftest import chat, pool


async def test_the_access_log_times_each_request_by_its_id(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    seen: dict[str, tuple[str, float]] = {}
    async with pool(tmp_path, replicas=2, access_log=str(log)) as p, aiohttp.ClientSession() as http:
        for i in range(6):
            rid = f"req-{i}"
            t0 = time.perf_counter()
            first = None
            async with http.post(p.url + "/v1/chat/completions", headers={"x-request-id": rid},
                                 json=chat(f"question {i}", stream=True, max_tokens=8)) as r:  # fmt: skip
                assert r.status == 200
                async for _ in r.content.iter_any():
                    first = first or time.perf_counter() - t0
            assert first is not None
            seen[rid] = (r.headers[UPSTREAM_HOST_HEADER], first)
    lines = read_access_log(log)  # Envoy flushed it when it stopped
    assert set(seen) <= set(lines)
    for rid, (upstream, client_first) in seen.items():
        line = lines[rid]
        assert (line.status, line.upstream) == (200, upstream)
        assert line.routed_s is not None and line.upstream_first_body_s is not None
        assert line.client_first_byte_s is not None
        # Envoy's clock starts at the request's first byte, after the client's
        assert 0 <= line.routed_s <= line.upstream_first_body_s <= client_first


def test_lines_that_are_not_the_generators_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    log.write_text('not json\n{"request_id": ""}\n[1]\n'
                   '{"request_id": "a", "status": 200, "upstream": "10.0.0.1:8000", '
                   '"upstream_sent_us": 1500, "upstream_first_body_us": null, '
                   '"client_first_byte_us": 2500}\n')  # fmt: skip
    lines = read_access_log(log)
    assert list(lines) == ["a"]
    assert lines["a"].routed_s == 0.0015 and lines["a"].upstream_first_body_s is None
    assert read_access_log(tmp_path / "missing.jsonl") == {}
