"""A decoder that refuses the transferred KV does not fail the request: the P/D sidecar (NIXL)
sends the original body again and the request is decoded in full.

Real sockets: the sidecar's app, a prefiller answering with ``kv_transfer_params`` and a
decoder that answers 503 to a body carrying them (what a failed NIXL handshake gives).
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from epp.sidecar.proxy import Sidecar, SidecarConfig
from tests.integration.test_sidecar_security import BODY, Recorder, recorder_app, serve, splits

pytestmark = pytest.mark.asyncio

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "10.0.0.9", "remote_port": 5600}


class Prefiller(Recorder):
    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": PARAMS})


class RefusingDecoder(Recorder):
    """503 to a body with transfer params (``refuse`` of them), 200 otherwise."""

    def __init__(self, refuse: int) -> None:
        super().__init__()
        self.refuse = refuse

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if body.get("kv_transfer_params") and self.refuse > 0:
            self.refuse -= 1
            return web.json_response({"error": {"message": "NIXL handshake failed"}}, status=503)
        return web.json_response({"id": "d", "choices": [{"text": "decoded"}]})


@pytest.mark.parametrize("refuse", [0, 1])
async def test_a_refused_transfer_is_decoded_again_in_full(refuse: int) -> None:
    prefiller, decoder = Prefiller(), RefusingDecoder(refuse)
    async with serve(recorder_app(prefiller)) as pre, serve(recorder_app(decoder)) as dec:
        side = Sidecar(SidecarConfig(decoder=f"http://{dec}", connector="nixlv2",
                                     allowed_prefillers=("127.0.0.1/32",)))  # fmt: skip
        async with serve(side.app()) as url, aiohttp.ClientSession() as http, http.post(
            f"http://{url}/v1/completions", json=BODY, headers={"x-prefiller-host-port": pre}
        ) as r:  # fmt: skip
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == "decoded"
    assert len(prefiller.bodies) == 1 and splits(side)["yes"] == 1
    assert decoder.bodies[0]["kv_transfer_params"] == PARAMS
    assert len(decoder.bodies) == 1 + refuse
    if refuse:
        assert decoder.bodies[1] == BODY  # the original: no transfer params
    assert side.registry.get_sample_value("epp_sidecar_decode_retries_total") == refuse


async def test_a_decoder_failing_in_full_too_answers_its_own_error() -> None:
    prefiller, decoder = Prefiller(), RefusingDecoder(refuse=0)

    async def always_503(request: web.Request) -> web.Response:
        decoder.bodies.append(await request.json())
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    decoder.handle = always_503  # type: ignore[method-assign]
    async with serve(recorder_app(prefiller)) as pre, serve(recorder_app(decoder)) as dec:
        side = Sidecar(SidecarConfig(decoder=f"http://{dec}", connector="nixlv2",
                                     allowed_prefillers=("127.0.0.1/32",)))  # fmt: skip
        async with serve(side.app()) as url, aiohttp.ClientSession() as http, http.post(
            f"http://{url}/v1/completions", json=BODY, headers={"x-prefiller-host-port": pre}
        ) as r:  # fmt: skip
            assert r.status == 503
            assert (await r.json())["error"]["message"] == "overloaded"
    assert len(decoder.bodies) == 2  # one retry, not a loop
