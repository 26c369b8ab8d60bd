"""ResponseHandoff: tokens, claims once, expiry in order, warnings."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from epp.extproc.observer import REMOTE_WAIT_S, Kind, Observation, ResponseHandoff
from epp.framework.types import ResponseInfo
from epp.requestcontrol.director import Director, Routing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Abandons:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, str]] = []

    def abandon(self, routing: Any, status: str) -> None:
        self.calls.append((routing, status))


def make(wait_s: float = 5.0) -> tuple[ResponseHandoff, Clock, Abandons]:
    clock, director = Clock(), Abandons()
    return ResponseHandoff(cast(Director, director), wait_s, clock), clock, director


def routing(name: str) -> Routing:
    return cast(Routing, name)


def test_a_token_claims_its_routing_once() -> None:
    handoff, _, director = make()
    a, b = handoff.offer(routing("a")), handoff.offer(routing("b"))
    assert a != b and len(handoff) == 2
    assert handoff.claim(b) == "b" and handoff.claim(b) is None
    assert handoff.claim(a) == "a" and len(handoff) == 0
    assert handoff.claimed == 2 and handoff.foreign == 0 and director.calls == []


def test_tokens_of_two_processes_differ() -> None:
    first, _, _ = make()
    second, _, _ = make()
    token = first.offer(routing("a"))
    assert second.claim(token) is None and second.foreign == 1
    assert first.claim(token) == "a"


def test_what_waits_past_the_wait_is_released_oldest_first(caplog: pytest.LogCaptureFixture) -> None:
    handoff, clock, director = make(wait_s=5.0)
    old = handoff.offer(routing("old"))
    clock.now += 3
    young = handoff.offer(routing("young"))
    clock.now += 2.5  # old is 5.5 s old, young 2.5 s
    with caplog.at_level(logging.WARNING):
        assert handoff.expire() == 1
    assert director.calls == [("old", "unobserved")] and handoff.unobserved == 1
    assert "no observer stream" in caplog.text
    assert handoff.claim(old) is None and handoff.claim(young) == "young"
    caplog.clear()
    handoff.offer(routing("later"))
    clock.now += 10
    with caplog.at_level(logging.WARNING):
        handoff.offer(routing("next"))  # expires "later" on the way in; warned a minute ago
    assert director.calls[-1] == ("later", "unobserved") and "no observer stream" not in caplog.text


def test_the_wait_must_be_positive() -> None:
    with pytest.raises(ValueError, match="observer wait"):
        make(wait_s=0)


class Lifecycle(Abandons):
    def __init__(self, fail_finish: bool = False) -> None:
        super().__init__()
        self.finished: list[tuple[Any, Any]] = []
        self.first: list[tuple[Any, float]] = []
        self.fail_finish = fail_finish

    def finish(self, routing: Any, info: Any) -> None:
        if self.fail_finish:
            raise RuntimeError("a bug")
        self.finished.append((routing, info))

    def first_token(self, routing: Any, ttft_s: float) -> None:
        self.first.append((routing, ttft_s))


class Started:
    def __init__(self, name: str, started_s: float) -> None:
        self.name, self.started_s = name, started_s


def test_peer_observations_act_on_this_replicas_tokens_only(caplog: pytest.LogCaptureFixture) -> None:
    kind = Kind
    clock, director = Clock(), Lifecycle()
    handoff = ResponseHandoff(cast(Director, director), 5.0, clock)
    a = cast(Routing, Started("a", 100.0))
    token = handoff.offer(a)
    other = ResponseHandoff(cast(Director, Lifecycle()), 5.0, clock).offer(routing("x"))
    clock.now = 101.0
    obs = Observation
    handoff.apply_remote([
        obs(token=other, kind=kind.CLAIMED),  # another replica's: ignored
        obs(token=token, kind=kind.CLAIMED),
        obs(token=token, kind=kind.FIRST_BYTES, age_s=0.25),
    ])  # fmt: skip
    assert handoff.claimed_by_peer == 1 and director.first == [(a, 0.75)]
    clock.now += 100  # past the local wait: a peer-claimed request waits for its end
    handoff.expire()
    assert director.calls == []
    handoff.apply_remote([obs(token=token, kind=kind.FINISHED, status=200, prompt_tokens=9,
                              cached_tokens=-1, first_bytes_age_s=-1, generated_text="hi")])  # fmt: skip
    ((routing_, info),) = director.finished
    assert routing_ is a and info.prompt_tokens == 9 and info.cached_tokens is None
    assert info.generated_text == "hi" and info.ttft_s == pytest.approx(0.75)
    assert len(handoff) == 0 and handoff.counts()["claimed_by_peer"] == 1
    # a failing application is logged; the next observation is still applied
    failing = ResponseHandoff(cast(Director, Lifecycle(fail_finish=True)), 5.0, clock)
    t1, t2 = failing.offer(routing("1")), failing.offer(routing("2"))
    failing.apply_remote([obs(token=t1, kind=kind.CLAIMED), obs(token=t2, kind=kind.CLAIMED)])
    with caplog.at_level(logging.ERROR):
        failing.apply_remote([obs(token=t1, kind=kind.FINISHED), obs(token=t2, kind=kind.ENDED)])
    assert "applying a peer's observation" in caplog.text
    assert cast(Lifecycle, failing._director).calls == [("2", "cancelled")]


def test_only_token_shaped_values_of_other_processes_are_forwarded() -> None:
    handoff, _, _ = make()
    handoff.publish = lambda _obs: None
    other = make()[0].offer(routing("x"))
    assert handoff.forwards(other)
    assert not handoff.forwards(handoff.offer(routing("y")))  # its own
    for garbage in ("mine", "", "x" * 300, other + "-1", "G" + other[1:], "ABCDEF012345-1"):
        assert not handoff.forwards(garbage)
    handoff.publish = None
    assert not handoff.forwards(other)  # no sync: nothing to forward to


# --- the response summary: an answer's end from the proxy's access log ------------------


def test_an_answer_left_to_the_access_log_ends_with_its_entry() -> None:
    clock, director = Clock(), Lifecycle()
    handoff = ResponseHandoff(cast(Director, director), 5.0, clock, observing=False)
    a = cast(Routing, Started("a", 100.0))
    token = handoff.issue()
    assert not handoff.summaries_live(clock.now)  # no entry of this replica's has come yet
    handoff.summarized(handoff.issue(), ResponseInfo(200))  # one read to its end: nothing waits
    assert handoff.summaries_live(clock.now) and director.finished == []
    handoff.await_summary(token, a, first_s=100.25)
    clock.now += 60  # long past the observer's wait: an answer may stream for minutes
    handoff.expire()
    assert director.calls == [] and len(handoff) == 1
    handoff.summarized(token, ResponseInfo(200, prompt_tokens=9, cached_tokens=8, completion_tokens=3))
    ((routing_, info),) = director.finished
    assert routing_ is a and info.cached_tokens == 8 and info.ttft_s == pytest.approx(0.25)
    assert handoff.counts()["handed_over"] == 1 and handoff.counts()["summarized"] == 1
    assert not handoff.summaries_live(clock.now + 31)  # entries stopped coming: read answers again


def test_an_entry_for_an_answer_that_ended_early_releases_it_as_cancelled() -> None:
    clock, director = Clock(), Lifecycle()
    handoff = ResponseHandoff(cast(Director, director), 5.0, clock, observing=False)
    token = handoff.issue()
    handoff.await_summary(token, routing("a"), None)
    handoff.summarized(token, None)
    assert director.calls == [("a", "cancelled")] and director.finished == []


def test_another_replicas_entries_go_to_the_peers_or_stop_leaving_answers_to_the_log() -> None:
    clock, director = Clock(), Lifecycle()
    handoff = ResponseHandoff(cast(Director, director), 5.0, clock, observing=False)
    handoff.summarized(handoff.issue(), ResponseInfo(200))
    other = ResponseHandoff(cast(Director, Lifecycle()), 5.0, clock).issue()
    handoff.summarized(other, ResponseInfo(200))  # sync off: counted, and no longer live
    assert handoff.foreign == 1 and not handoff.summaries_live(clock.now)
    sent: list[Observation] = []
    handoff.publish = sent.append  # sync on: forwarded, and live again
    handoff.summarized(other, ResponseInfo(200, completion_tokens=5))
    handoff.summarized(other, None)
    assert [(o.kind, o.completion_tokens) for o in sent] == [(Kind.FINISHED, 5), (Kind.ENDED, 0)]
    assert handoff.summaries_live(clock.now)


def test_an_answer_whose_entry_never_comes_is_released_as_unobserved() -> None:
    clock, director = Clock(), Lifecycle()
    handoff = ResponseHandoff(cast(Director, director), 5.0, clock, observing=False)
    handoff.await_summary(handoff.issue(), routing("a"), None)
    clock.now += REMOTE_WAIT_S + 1
    handoff.expire()
    assert director.calls == [("a", "unobserved")] and handoff.unobserved == 1
