"""The Inference Extension's conformance hooks through real Envoy: with ``--config
conformance`` the endpoint named in ``test-epp-endpoint-selection`` is chosen and reported in
``x-conformance-test-served-endpoint``; with any other profile the header steers nothing."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from epp.envoyconfig import UPSTREAM_HOST_HEADER
from tests.envoy.conftest import chat, pool

pytestmark = pytest.mark.e2e

SELECT, SERVED = "test-epp-endpoint-selection", "x-conformance-test-served-endpoint"


async def test_the_named_endpoint_is_chosen_and_reported_back(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=3, epp_args=("--config", "conformance")) as p:
        a, b, c = p.endpoints()
        for named, expected in [(b, b), (f"{c},{a}", c), (c.split(":")[0] + ":1," + a, a)]:
            for i in range(3):
                async with http.post(p.url + "/v1/chat/completions", json=chat(f"q {named} {i}"),
                                     headers={SELECT: named}) as r:  # fmt: skip
                    assert r.status == 200
                    assert r.headers[UPSTREAM_HOST_HEADER] == expected
                    assert r.headers[SERVED] == expected
        async with http.post(p.url + "/v1/chat/completions", json=chat("nobody"),
                             headers={SELECT: "192.0.2.1:8000"}) as r:  # fmt: skip
            assert r.status == 503  # names no endpoint of the pool
        async with http.post(p.url + "/v1/chat/completions", json=chat("free")) as r:
            assert r.status == 200 and r.headers[SERVED] in p.endpoints()


async def test_without_the_conformance_profile_the_header_steers_nothing(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    async with pool(tmp_path, replicas=3) as p:
        named = p.endpoints()[0]
        served = []
        for i in range(12):
            async with http.post(p.url + "/v1/chat/completions",
                                 json=chat(f"question {i} " + "about a different topic " * i),
                                 headers={SELECT: named}) as r:  # fmt: skip
                assert r.status == 200 and SERVED not in r.headers
                served.append(r.headers[UPSTREAM_HOST_HEADER])
    assert set(served) != {named}
