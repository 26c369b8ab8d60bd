"""The director and endpoints whose metrics went stale: preferred out, tried rather than a 503
when the filters leave nothing else (a P/D pool whose only decoder answers /metrics late)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from epp.config.loader import load_config
from epp.datastore.store import Datastore
from epp.errors import Unavailable
from epp.framework.endpoint import ROLE_LABEL, Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.observability.metrics import EppMetrics
from epp.requestcontrol.director import Director
from epp.wiring import build_scheduler

PREFILL, DECODE = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


def director_over(profile: str, roles: dict[EndpointId, str], now_s: float) -> tuple[Datastore, Director]:
    """The shipped ``profile`` over the endpoints of ``roles`` (a role label where one is
    given), every one scraped at 1 s; staleness is 2 s, the director's clock ``now_s``."""
    cfg = load_config(profile)
    store = Datastore(stale_after_s=2.0)
    for eid, role in roles.items():
        host, _, port = eid.rpartition(":")
        store.upsert(Endpoint(eid, host, int(port), labels={ROLE_LABEL: role} if role else {}))
        store.update_metrics(eid, Metrics(scraped_at_s=1.0))
    return store, Director(store, build_scheduler(cfg, random.Random(0)), cfg.saturation,
                           EppMetrics(CollectorRegistry()), clock=lambda: now_s)  # fmt: skip


def pd_director(roles: dict[EndpointId, str], fresh: set[EndpointId]) -> Director:
    """The shipped ``pd`` profile over ``roles``; every endpoint scraped at 1 s, those in
    ``fresh`` again at 4 s, and staleness (2 s) judged at 4 s."""
    store, director = director_over("pd", roles, 4.0)
    for eid in fresh:
        store.update_metrics(eid, Metrics(scraped_at_s=4.0))
    store.mark_stale(4.0)
    return director


def ask(director: Director) -> str:
    return director.route(InferenceRequest("r1", "m", "hello " * 50), None).destination


def test_the_only_decoder_gone_stale_is_still_routed_to() -> None:
    roles = {PREFILL: "prefill", DECODE: "decode"}
    assert ask(pd_director(roles, fresh={PREFILL, DECODE})) == DECODE
    # the decoder's scrapes time out while it works; the prefiller's are fresh
    assert ask(pd_director(roles, fresh={PREFILL})) == DECODE


def test_a_stale_endpoint_is_left_out_while_a_fresh_one_passes_the_filters() -> None:
    other = EndpointId("10.0.0.3:8000")
    roles = {PREFILL: "prefill", DECODE: "decode", other: "decode"}
    assert ask(pd_director(roles, fresh={PREFILL, other})) == other


def test_no_endpoint_of_the_role_at_all_is_still_a_503() -> None:
    with pytest.raises(Unavailable):
        ask(pd_director({PREFILL: "prefill"}, fresh={PREFILL}))


@pytest.mark.parametrize("status", [200, 503])
def test_an_endpoint_answering_requests_is_not_taken_out_when_its_scrapes_stop(status: int) -> None:
    """Both endpoints' last good scrape was at 1 s. The one that began to answer a request
    since (its first response bytes, status 200) is serving: at 3.5 s only the silent one is
    stale. A server error is no sign of serving: both are."""
    store, director = director_over("default", {PREFILL: "", DECODE: ""}, 1.5)
    assert store.mark_stale(1.0) == []
    routing = director.route(InferenceRequest("r1", "m", "hello " * 50), None)
    director.first_token(routing, 0.2, status)
    assert store.mark_stale(2.0) == []
    silent = {PREFILL, DECODE} - {routing.target_id}
    assert sorted(store.mark_stale(3.5)) == sorted(silent if status == 200 else {PREFILL, DECODE})
    if status == 200:  # it keeps serving: still routable; once silent too, stale like the other
        assert [e.id for e in store.routable()] == [routing.target_id]
        assert store.mark_stale(4.5) == [routing.target_id]


def test_a_pick_is_seen_by_the_next_pick_before_its_reply_is_sent() -> None:
    """A burst: streams route one after another while earlier replies are still being sent
    (``settle`` comes after the send). Each pick must already be in the state the next one
    reads: the same prompt twice goes where the first went (the prefix index), and cold
    prompts spread (the prefill queued on each, predicted-ttft's ``outstanding``)."""
    _, director = director_over("default", {PREFILL: "", DECODE: ""}, 1.5)
    system = "You are a helpful assistant for group seven. " * 40
    first = director.route(InferenceRequest("a", "m", system + "question one"), None)
    again = director.route(InferenceRequest("b", "m", system + "question two"), None)
    assert again.target_id == first.target_id
    cold = [director.route(InferenceRequest(f"c{i}", "m", f"group {i} prompt " * 150), None).target_id
            for i in range(8)]  # fmt: skip
    placed = [first.target_id, again.target_id, *cold]
    assert sorted(placed.count(e) for e in (PREFILL, DECODE)) == [5, 5], placed
