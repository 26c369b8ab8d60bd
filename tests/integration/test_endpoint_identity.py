"""A model server restarted at the same address, seen by epp's scraper (issue 69): within one
scrape, what epp learnt of the old process (its prefix-index entries, metrics, in-flight
count) is dropped and counted; a server that goes to sleep leaves the candidates on its next
scrape and comes back when awake."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import pytest

from epp.datastore.scraper import MetricsScraper
from epp.framework.endpoint import Endpoint, EndpointId
from simulator.emulator import EmulatorConfig, RunningEmulator, start_emulator
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, start_epp, stop_epp

pytestmark = pytest.mark.asyncio


MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def emulator(port: int = 0, model: str = MODEL) -> RunningEmulator:
    return await start_emulator(EmulatorConfig(port=port, speedup=50.0, model=model))


async def two_servers(
    *servers: RunningEmulator,
) -> tuple[Epp, list[EndpointId], MetricsScraper, Callable[[], Awaitable[None]]]:
    """epp over ``servers`` (static endpoints), its scraper and a scrape of every endpoint."""
    ids = [EndpointId(f"127.0.0.1:{r.port}") for r in servers]
    epp = await start_epp([Endpoint(i, "127.0.0.1", r.port) for i, r in zip(ids, servers, strict=True)])
    scraper = MetricsScraper(epp.handle.datastore, epp.handle.metrics)

    async def scrape() -> None:
        for e in epp.handle.datastore.snapshot():
            assert await scraper.scrape_once(e)

    return epp, ids, scraper, scrape


async def route(epp: Epp, n: int, model: str = MODEL) -> str | None:
    s = ec.Stream(epp.channel)
    body = json.dumps({"model": model,
                       "prompt": f"conversation {n}: " + "tell me about bread " * 20}).encode()  # fmt: skip
    await s.send(ec.request_headers(), ec.request_body(body, True))
    reply = (await s.recv_n(2))[0]
    s.call.cancel()
    return ec.destination(reply)


async def test_a_restarted_server_at_the_same_address_is_forgotten_within_one_scrape() -> None:
    first = await emulator()
    eid = EndpointId(f"127.0.0.1:{first.port}")
    epp = await start_epp([Endpoint(eid, "127.0.0.1", first.port)])
    scraper = MetricsScraper(epp.handle.datastore, epp.handle.metrics)
    try:
        endpoint = epp.handle.datastore.get(eid)
        assert endpoint is not None and await scraper.scrape_once(endpoint)
        for n in range(3):
            assert await route(epp, n) == eid
        index = epp.handle.index
        assert index.chunks_of(eid)
        old = epp.handle.datastore.get(eid)
        assert old is not None and old.metrics.started_s > 0

        await first.close()
        second = await emulator(first.port)  # the same address, a new process
        try:
            endpoint = epp.handle.datastore.get(eid)
            assert endpoint is not None and await scraper.scrape_once(endpoint)  # one scrape
            assert index.chunks_of(eid) == {}
            sample = epp.handle.registry.get_sample_value
            assert sample("epp_endpoint_identity_changes_total", {"reason": "restarted"}) == 1
            now = epp.handle.datastore.get(eid)
            assert now is not None and now.metrics.started_s != old.metrics.started_s
            assert epp.handle.datastore.in_flight()[eid] == 0
        finally:
            await second.close()
    finally:
        await scraper.stop()
        await stop_epp(epp)


async def test_a_sleeping_server_gets_no_request_until_it_wakes() -> None:
    asleep, awake = await emulator(), await emulator()
    epp, ids, scraper, scrape = await two_servers(asleep, awake)

    try:
        await scrape()
        asleep.emulator.sleep_level = 1  # as POST /sleep?level=1 leaves it
        await scrape()
        assert {await route(epp, n) for n in range(8)} == {ids[1]}
        sample = epp.handle.registry.get_sample_value
        assert sample("epp_endpoint_not_serving_transitions_total", {"reason": "asleep"}) == 1
        assert sample("epp_endpoint_not_serving", {"endpoint": ids[0]}) == 1
        asleep.emulator.sleep_level = None  # POST /wake_up
        await scrape()
        assert sample("epp_endpoint_not_serving", {"endpoint": ids[0]}) == 0
        assert ids[0] in {await route(epp, 100 + n) for n in range(16)}
    finally:
        await scraper.stop()
        await stop_epp(epp)
        for r in (asleep, awake):
            await r.close()


async def test_a_server_restarted_with_another_model_gets_none_of_the_old_models_requests() -> None:
    """QA3 #4: ``epp-sim emulate --model other/model`` restarted at the same port. Counted as
    ``model_changed`` (not merely ``restarted``), and requests for the old model go to the
    server that still serves it; the new model's requests go to the new server."""
    changed, kept = await emulator(), await emulator()
    epp, ids, scraper, scrape = await two_servers(changed, kept)

    other = None
    try:
        await scrape()
        assert {await route(epp, n) for n in range(16)} == set(ids)  # both serve the model
        await changed.close()
        other = await emulator(changed.port, "other/model")  # the same address, another model
        await scrape()
        sample = epp.handle.registry.get_sample_value
        assert sample("epp_endpoint_identity_changes_total", {"reason": "model_changed"}) == 1
        assert not sample("epp_endpoint_identity_changes_total", {"reason": "restarted"})
        assert {await route(epp, 100 + n) for n in range(16)} == {ids[1]}
        assert {await route(epp, 200 + n, "other/model") for n in range(8)} == {ids[0]}
    finally:
        await scraper.stop()
        await stop_epp(epp)
        for r in (other, kept):
            if r is not None:
                await r.close()
