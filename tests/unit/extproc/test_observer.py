"""ResponseHandoff: tokens, claims once, expiry in order, warnings."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from epp.extproc.observer import ResponseHandoff
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
