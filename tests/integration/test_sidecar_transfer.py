"""A decoder that refuses the transferred KV does not fail the request: the P/D sidecar (NIXL)
sends the original body again and the request is decoded in full.

Real sockets: the sidecar's app, a prefiller answering with ``kv_transfer_params`` and a
decoder that answers 503 to a body carrying them (what a failed NIXL handshake gives).
"""

from __future__ import annotations

from typing import Any

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
    """503 to the first ``refuse`` bodies carrying transfer params (to every body with
    ``always``), 200 otherwise."""

    def __init__(self, refuse: int, always: bool = False) -> None:
        super().__init__()
        self.refuse, self.always = refuse, always

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.always or (body.get("kv_transfer_params") and self.refuse > 0):
            self.refuse -= 1
            return web.json_response({"error": {"message": "NIXL handshake failed"}}, status=503)
        return web.json_response({"id": "d", "choices": [{"text": "decoded"}]})


async def split(decoder: RefusingDecoder) -> tuple[int, dict[str, Any], Sidecar, Prefiller]:
    """One request split by a NIXL sidecar: its status and answer, the sidecar, the prefiller."""
    prefiller = Prefiller()
    async with serve(recorder_app(prefiller)) as pre, serve(recorder_app(decoder)) as dec:
        side = Sidecar(SidecarConfig(decoder=f"http://{dec}", connector="nixlv2",
                                     allowed_prefillers=("127.0.0.1/32",)))  # fmt: skip
        async with serve(side.app()) as url, aiohttp.ClientSession() as http, http.post(
            f"http://{url}/v1/completions", json=BODY, headers={"x-prefiller-host-port": pre}
        ) as r:  # fmt: skip
            return r.status, await r.json(), side, prefiller


@pytest.mark.parametrize("refuse", [0, 1])
async def test_a_refused_transfer_is_decoded_again_in_full(refuse: int) -> None:
    decoder = RefusingDecoder(refuse)
    status, answer, side, prefiller = await split(decoder)
    assert status == 200 and answer["choices"][0]["text"] == "decoded"
    assert len(prefiller.bodies) == 1 and splits(side)["yes"] == 1
    assert decoder.bodies[0]["kv_transfer_params"] == PARAMS
    assert len(decoder.bodies) == 1 + refuse
    if refuse:
        assert decoder.bodies[1] == BODY  # the original: no transfer params
    assert side.registry.get_sample_value("epp_sidecar_decode_retries_total") == refuse


async def test_a_decoder_failing_in_full_too_answers_its_own_error() -> None:
    decoder = RefusingDecoder(refuse=0, always=True)
    status, answer, _, _ = await split(decoder)
    assert status == 503 and answer["error"]["message"] == "NIXL handshake failed"
    assert len(decoder.bodies) == 2  # one retry, not a loop
