"""response-affinity-filter: a request naming a stored response goes where the response was
produced; bounded, forgetful, shared with peers, and silent for everything else."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from epp.config.loader import default_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.interfaces import PluginContext
from epp.framework.request import MAX_STORED_ID_CHARS, ApiKind, InferenceRequest
from epp.framework.types import CycleState, PickResult
from epp.plugins.responseaffinity import (
    ENTRY_OVERHEAD_BYTES,
    ResponseAffinityFilter,
    ResponseAffinityParams,
    StoredHomes,
    entry_bytes,
    stored_reference,
)
from epp.sync.stored import SharedStored
from epp.wiring import build_scheduler

RID = "resp_" + "a" * 32


def ep(n: int, waiting: int = 0) -> Endpoint:
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000,
                    metrics=Metrics(waiting=waiting, kv_usage=0.1, scraped_at_s=1.0))  # fmt: skip


def responses(body: dict[str, Any], rid: str = "r") -> InferenceRequest:
    return InferenceRequest(rid, "m", "prompt", api=ApiKind.RESPONSES,
                            headers={":path": "/v1/responses", ":method": "POST"},
                            body={"model": "m", "input": "hi", **body})  # fmt: skip


def at_path(path: str, method: str = "GET") -> InferenceRequest:
    return InferenceRequest("r", "", "", api=ApiKind.NONE,
                            headers={":path": path, ":method": method})  # fmt: skip


@pytest.mark.parametrize(("request_", "expected"), [
    (responses({"previous_response_id": RID}), RID),
    (responses({"conversation": "conv_1"}), "conv_1"),
    (responses({"conversation": {"id": "conv_2"}}), "conv_2"),
    (responses({"previous_response_id": RID, "conversation": "conv_1"}), RID),
    (responses({}), ""),
    (responses({"previous_response_id": 7}), ""),
    (responses({"previous_response_id": "x" * (MAX_STORED_ID_CHARS + 1)}), ""),
    (at_path(f"/v1/responses/{RID}"), RID),
    (at_path(f"/v1/responses/{RID}", "DELETE"), RID),
    (at_path(f"/v1/responses/{RID}/cancel", "POST"), RID),
    (at_path(f"/v1/responses/{RID}/input_items?limit=5"), RID),
    (at_path("/v1/conversations/conv_1/items/msg_2"), "conv_1"),
    (at_path("/v1/conversations", "POST"), ""),
    (at_path("/v1/models"), ""),
    (InferenceRequest("r", "m", "p", api=ApiKind.CHAT, body={"previous_response_id": RID}), ""),
])  # fmt: skip
def test_what_a_request_names(request_: InferenceRequest, expected: str) -> None:
    assert stored_reference(request_) == expected


def learn(f: ResponseAffinityFilter, home: Endpoint, ids: list[str], now: float = 1.0,
          body: dict[str, Any] | None = None) -> None:  # fmt: skip
    state = CycleState(responses(body or {}), now, random.Random(1))
    f.post_pick(state, PickResult((home,), state))  # as the Director runs the hooks: the pick,
    state.request = dataclasses.replace(state.request, body=None)  # its body let go, then the reply
    f.post_stored(state, PickResult((home,), state), ids)


def kept(f: ResponseAffinityFilter, request: InferenceRequest, pool: list[Endpoint],
         now: float = 2.0) -> list[EndpointId]:  # fmt: skip
    return [e.id for e in f.filter(CycleState(request, now, random.Random(1)), pool)]


def test_a_learnt_response_keeps_its_home_alone_and_everything_else_passes() -> None:
    f = ResponseAffinityFilter("f", ResponseAffinityParams())
    pool = [ep(1), ep(2), ep(3)]
    assert kept(f, responses({"previous_response_id": RID}), pool) == [e.id for e in pool]
    assert f.outcomes["unknown"] == 1
    learn(f, pool[1], [RID])
    for req in (responses({"previous_response_id": RID}), at_path(f"/v1/responses/{RID}"),
                at_path(f"/v1/responses/{RID}/cancel", "POST")):  # fmt: skip
        assert kept(f, req, pool) == [pool[1].id]
    assert f.outcomes == {"home": 3, "home_unavailable": 0, "unknown": 1}
    assert kept(f, responses({}), pool) == [e.id for e in pool]  # names nothing: untouched
    # the home left the pool (or is not ready): routed as if it named nothing, counted
    assert kept(f, responses({"previous_response_id": RID}), [pool[0], pool[2]]) == [pool[0].id, pool[2].id]
    assert f.outcomes["home_unavailable"] == 1


def test_store_false_teaches_nothing() -> None:
    f = ResponseAffinityFilter("f", ResponseAffinityParams())
    learn(f, ep(1), [RID], body={"store": False})
    assert len(f) == 0
    learn(f, ep(1), [RID], body={"store": True})
    assert len(f) == 1


def test_in_the_default_profile_the_home_wins_over_any_load() -> None:
    sched = build_scheduler(default_config(), random.Random(3))
    home, idle = ep(1, waiting=40), ep(2)
    first = sched.schedule(responses({}), [home], 1.0)
    sched.on_stored(first, [RID])
    for i in range(8):
        pick = sched.schedule(responses({"previous_response_id": RID}, f"f{i}"), [idle, home], 2.0 + i)
        assert pick.target.id == home.id
    assert sched.schedule(responses({}, "other"), [idle, home], 20.0).target.id == idle.id


def test_bounded_in_entries_and_bytes_least_recently_used_first() -> None:
    t = StoredHomes(ttl_s=100, max_entries=3, max_bytes=1 << 20)
    for i in range(3):
        t.put(f"r{i}", EndpointId("e"), float(i))
    assert t.get("r0", 5.0) == "e"  # used: now the most recent
    t.put("r3", EndpointId("e"), 6.0)
    assert len(t) == 3 and t.get("r1", 7.0) is None and t.evicted == 1
    assert t.bytes == sum(entry_bytes(k) for k in ("r0", "r2", "r3"))
    small = StoredHomes(ttl_s=100, max_entries=1000, max_bytes=3 * (ENTRY_OVERHEAD_BYTES + 37))
    for i in range(10):
        small.put(f"resp_{i:032x}", EndpointId("e"), float(i))
    assert len(small) == 3 and small.bytes <= small.max_bytes
    assert entry_bytes("é") == ENTRY_OVERHEAD_BYTES + 4  # non-ASCII text takes more


def test_forgotten_after_the_ttl_on_lookup_and_by_the_sweep() -> None:
    t = StoredHomes(ttl_s=10, max_entries=100, max_bytes=1 << 20)
    t.put("a", EndpointId("e"), 0.0)
    t.put("b", EndpointId("e"), 5.0)
    assert t.get("a", 11.0) is None and t.expired == 1
    assert t.get("b", 11.0) == "e"  # renewed at 11
    t.put("c", EndpointId("e"), 12.0)
    assert t.expire(21.5, most=10) == 1 and len(t) == 1  # b (last used at 11) went
    assert t.expire(100.0, most=10) == 1 and len(t) == 0


async def test_the_supervised_expiry_works_in_slices() -> None:
    clock = [0.0]
    f = ResponseAffinityFilter("f", ResponseAffinityParams(ttl_seconds=10, max_entries=20_000),
                               clock=lambda: clock[0])  # fmt: skip
    for i in range(10_000):
        f.homes.put(f"r{i}", EndpointId("e"), 0.0)
    assert await f.expire(100.0) == 10_000
    spawned: list[str] = []
    tasks: list[asyncio.Task[None]] = []
    registry = CollectorRegistry()

    def spawn(kind: str, loop: Any) -> asyncio.Task[None]:
        spawned.append(kind)
        tasks.append(asyncio.create_task(loop()))
        return tasks[-1]

    await f.start(PluginContext(spawn=spawn, register=registry.register, on_failure=lambda _k: None))
    assert spawned == ["response-affinity-expiry"]
    f.homes.put("late", EndpointId("e"), 0.0)
    learn(f, ep(1), [RID])
    kept(f, responses({"previous_response_id": RID}), [ep(1)])
    assert registry.get_sample_value("epp_response_affinity_entries") == 2
    assert registry.get_sample_value("epp_response_affinity_requests_total", {"outcome": "home"}) == 1
    assert registry.get_sample_value("epp_response_affinity_learned_total", {"source": "response"}) == 1
    assert registry.get_sample_value("epp_response_affinity_forgotten_total", {"reason": "expired"}) == 10_000
    assert registry.get_sample_value("epp_response_affinity_bytes") == f.homes.bytes
    tasks[0].cancel()
    await f.stop()


def test_shared_with_peers_without_echo() -> None:
    f = ResponseAffinityFilter("f", ResponseAffinityParams())
    assert isinstance(f, SharedStored)
    sent: list[tuple[str, str, float]] = []
    unsubscribe = f.subscribe_stored(lambda oid, eid, s: sent.append((oid, eid, s)))
    learn(f, ep(1), [RID, "conv_1"], now=3.0)
    assert sent == [(RID, "10.0.0.1:8000", 3.0), ("conv_1", "10.0.0.1:8000", 3.0)]
    f.apply_remote_stored("resp_peer", EndpointId("10.0.0.2:8000"), 4.0)
    f.apply_remote_stored("x" * (MAX_STORED_ID_CHARS + 1), EndpointId("10.0.0.2:8000"), 4.0)
    assert len(sent) == 2 and f.learned == {"response": 2, "peer": 1}
    assert kept(f, at_path("/v1/responses/resp_peer"), [ep(1), ep(2)]) == ["10.0.0.2:8000"]
    assert [oid for oid, _, _ in f.export_stored()] == [RID, "conv_1", "resp_peer"]
    unsubscribe()
    learn(f, ep(1), ["resp_later"])
    assert len(sent) == 2
