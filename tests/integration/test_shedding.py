"""The shedding table of docs/serve.md, row by row (issue 69): each cause, produced through
ext_proc, answers the status, the ``x-llm-d-request-dropped-reason`` value and the
``error.reason`` the table gives. A row without a scenario, or a scenario without a row,
fails: the table and the code cannot drift apart."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.config.loader import default_config
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import (
    Epp,
    config_with,
    inject_metrics,
    pool,
    start_epp,
    stop_epp,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
DROPPED = "x-llm-d-request-dropped-reason"


@dataclass(frozen=True)
class Row:
    cause: str
    status: int
    dropped: str
    reason: str


def table() -> dict[str, Row]:
    """The rows of the shedding table in docs/serve.md."""
    text = DOC.read_text()
    section = text[text.index("### Shedding"):]
    section = section[: section.index("\n\n", section.index("| cause |"))]
    rows: dict[str, Row] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].isdigit():
            continue
        unquote = re.compile(r"^`(.*)`$")
        rows[cells[0]] = Row(cells[0], int(cells[1]), unquote.sub(r"\1", cells[2]),
                             unquote.sub(r"\1", cells[3]))  # fmt: skip
    return rows


def body(n: int, size: int = 20) -> bytes:
    return json.dumps({"model": "m", "prompt": f"request {n} " * size}).encode()


async def start(flow: dict[str, Any] | None, endpoints: int = 1, **options: Any) -> Epp:
    raw = dict(default_config().raw)
    if flow is not None:
        raw["flowControl"] = {"enabled": True, "saturation": "concurrency", "maxConcurrency": 1,
                              "dispatchIntervalSeconds": 0.01, **flow}  # fmt: skip
    raw["requestControl"] = {"objectives": {"low": -1, "high": 5}}
    return await start_epp(pool(endpoints), config=config_with(raw), trust_control_headers=True,
                           **options)  # fmt: skip


async def send(epp: Epp, n: int, objective: str = "", size: int = 20) -> ec.Stream:
    s = ec.Stream(epp.channel)
    extra = {"x-llm-d-inference-objective": objective} if objective else {}
    await s.send(ec.request_headers(extra=extra), ec.request_body(body(n, size), True))
    return s


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.005)  # state another task changes


async def holding(epp: Epp) -> ec.Stream:
    """A request that takes the pool's one slot (and keeps it until cancelled)."""
    s = await send(epp, 0)
    await s.recv_n(2)
    return s


async def queued(epp: Epp, count: int) -> None:
    flow = epp.handle.director.flow
    assert flow is not None
    await until(lambda: flow.count == count)


async def queue_full() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"maxRequests": 1, "displacement": False})
    await holding(epp)
    await send(epp, 1)
    await queued(epp, 1)
    return epp, await (await send(epp, 2)).recv()


async def band_full() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"bandMaxRequests": 1, "displacement": False})
    await holding(epp)
    await send(epp, 1)
    await queued(epp, 1)
    return epp, await (await send(epp, 2)).recv()


async def displaced() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"maxRequests": 1})
    await holding(epp)
    low = await send(epp, 1, "low")
    await queued(epp, 1)
    await send(epp, 2, "high")  # takes the low one's place
    return epp, await low.recv()


async def queue_time_out() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"maxQueueSeconds": 0.1})
    await holding(epp)
    return epp, await (await send(epp, 1)).recv()


async def sheddable() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start(None)
    inject_metrics(epp.handle, waiting=100)  # every endpoint over the queue threshold
    return epp, await (await send(epp, 1, "low")).recv()


async def no_ready_endpoint() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start(None, endpoints=0)
    return epp, await (await send(epp, 1)).recv()


async def scale_from_zero_wait_full() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"scaleFromZeroMaxRequests": 1}, endpoints=0)
    await send(epp, 1)
    await queued(epp, 1)
    return epp, await (await send(epp, 2)).recv()


async def no_endpoint_in_time() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({"maxQueueSeconds": 0.1, "scaleFromZeroSeconds": 0.2}, endpoints=0)
    return epp, await (await send(epp, 1)).recv()


async def shutting_down() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start({})
    slot = await holding(epp)
    waiting = await send(epp, 1)
    await queued(epp, 1)
    slot.call.cancel()  # ends, so the grace period covers only the queued one
    flow = epp.handle.director.flow
    assert flow is not None
    await until(lambda: flow.reserved == 0)
    if flow.count == 0:  # it was routed in the slot that freed: queue another
        waiting = await send(epp, 2)
        await queued(epp, 1)
    stopping = asyncio.create_task(epp.handle.stop(2.0))  # SIGTERM's path
    reply = await waiting.recv()
    await stopping
    return epp, reply


async def epps_own_bounds() -> tuple[Epp, pb.ProcessingResponse]:
    epp = await start(None, max_buffered_bytes=1024)
    return epp, await (await send(epp, 1, size=400)).recv()


SCENARIOS: dict[str, Callable[[], Awaitable[tuple[Epp, pb.ProcessingResponse]]]] = {
    "queue full": queue_full,
    "band full": band_full,
    "displaced": displaced,
    "queue time out": queue_time_out,
    "sheddable": sheddable,
    "no ready endpoint": no_ready_endpoint,
    "scale-from-zero wait full": scale_from_zero_wait_full,
    "no endpoint in time": no_endpoint_in_time,
    "shutting down": shutting_down,
    "epp's own bounds": epps_own_bounds,
}


def test_every_row_of_the_table_has_a_scenario_and_every_scenario_a_row() -> None:
    assert set(table()) == set(SCENARIOS)


@pytest.mark.parametrize("cause", sorted(SCENARIOS))
async def test_a_shed_request_gets_the_tables_status_header_and_reason(cause: str) -> None:
    row = table()[cause]
    epp, reply = await SCENARIOS[cause]()
    try:
        answer = reply.immediate_response
        assert answer.status.code == row.status, cause
        assert (ec.header_value(answer.headers, DROPPED) or "") == row.dropped, cause
        error = json.loads(answer.body)["error"]
        assert error.get("reason", "") == row.reason and error["code"] == row.status, cause
    finally:
        await stop_epp(epp)
