"""session-affinity-scorer: a session sticks to the endpoint that served it until that
endpoint saturates; bounded and forgetful."""

from __future__ import annotations

import random

from epp.config.loader import loads_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState
from epp.plugins.session import (
    MAX_SESSION_CHARS,
    SessionAffinityParams,
    SessionAffinityScorer,
    session_of,
)
from epp.wiring import build_scheduler


def ep(n: int, waiting: int = 0, kv: float = 0.1) -> Endpoint:
    return Endpoint(EndpointId(f"10.0.0.{n}:8000"), f"10.0.0.{n}", 8000,
                    metrics=Metrics(waiting=waiting, kv_usage=kv, scraped_at_s=1.0))  # fmt: skip


def req(rid: str, session: str = "", body: dict[str, object] | None = None) -> InferenceRequest:
    headers = {"x-session-id": session} if session else {}
    return InferenceRequest(rid, "m", f"prompt {rid}", headers=headers, body=body)


CONFIG = """
plugins:
- type: session-affinity-scorer
  parameters: {bodyFields: [metadata.session_id], maxSessions: 2}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- plugins:
  - {pluginRef: session-affinity-scorer, weight: 5}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


def test_a_session_sticks_until_its_endpoint_saturates() -> None:
    sched = build_scheduler(loads_config(CONFIG), random.Random(5))
    pool = [ep(1), ep(2), ep(3)]
    first = sched.schedule(req("a", "s1"), pool, 1.0).target.id
    for i in range(5):  # other endpoints as idle: the session still wins
        assert sched.schedule(req(f"b{i}", "s1"), pool, 2.0 + i).target.id == first
    busy = [ep(int(e.id.split(".")[3].split(":")[0]), waiting=9) if e.id == first else e for e in pool]
    moved = sched.schedule(req("c", "s1"), busy, 10.0).target.id
    assert moved != first  # saturated: the queue score moves it
    assert sched.schedule(req("d", "s1"), pool, 11.0).target.id == moved  # and it follows


def test_session_from_headers_then_body_cut_and_absent() -> None:
    p = SessionAffinityParams(headers=["x-session-id", "x-agent"], body_fields=["user", "metadata.sid"])
    assert session_of(req("a", "abc"), p) == "abc"
    assert session_of(InferenceRequest("a", "m", "", headers={"x-agent": "z"}), p) == "z"
    assert session_of(req("a", body={"metadata": {"sid": 7}}), p) == "metadata.sid=7"
    assert session_of(req("a", body={"user": True, "metadata": "x"}), p) == ""
    assert len(session_of(req("a", "x" * 10_000), p)) == MAX_SESSION_CHARS
    assert session_of(req("a"), p) == ""


def test_sessions_are_bounded_and_expire() -> None:
    scorer = SessionAffinityScorer("s", SessionAffinityParams(max_sessions=2, ttl_seconds=10))
    sched_cfg = loads_config(CONFIG)
    assert sched_cfg.profile.scorers[0] == ("session-affinity-scorer", 5.0)
    pool = [ep(1), ep(2)]
    from epp.framework.types import PickResult

    for i, s in enumerate(["s1", "s2", "s3"]):
        state = CycleState(req(f"r{i}", s), float(i), random.Random(1))
        scorer.post_pick(state, PickResult((pool[0],), state))
    assert len(scorer) == 2  # s1 forgotten first
    fresh = CycleState(req("x", "s3"), 5.0, random.Random(1))
    assert scorer.score(fresh, pool) == [1.0, 0.0]
    assert scorer.score(CycleState(req("y", "s1"), 5.0, random.Random(1)), pool) == [0.0, 0.0]
    late = CycleState(req("z", "s3"), 50.0, random.Random(1))
    assert scorer.score(late, pool) == [0.0, 0.0] and len(scorer) == 1  # expired, dropped
