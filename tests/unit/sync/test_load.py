"""The other replicas' prefill in flight (epp/sync/load.py) and the predicted-TTFT scorer
adding it to its own."""

from __future__ import annotations

import math
import random

from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import InferenceRequest
from epp.framework.types import CycleState, PrefixMatch
from epp.plugins.ttft import PredictedTtftParams, PredictedTtftScorer
from epp.sync.load import PeerPrefill, SharedPrefill

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


def test_a_peers_set_replaces_its_last_and_the_peers_add_up() -> None:
    t = PeerPrefill()
    t.update("p1", [(A, 1000.0), (B, 200.0)], 0.0)
    t.update("p2", [(A, 500.0)], 0.0)
    assert (t.tokens(A), t.tokens(B)) == (1500.0, 200.0)
    t.update("p1", [(B, 50.0)], 0.1)  # p1's request on A got its first token
    assert (t.tokens(A), t.tokens(B)) == (500.0, 50.0)
    t.update("p2", [], 0.2)  # nothing in flight: an empty set, not silence
    assert (t.tokens(A), t.tokens(B)) == (0.0, 50.0)


def test_a_peer_that_ends_or_goes_quiet_no_longer_counts() -> None:
    t = PeerPrefill(stale_s=3.0)
    t.update("p1", [(A, 1000.0)], 0.0)
    t.update("p2", [(A, 10.0)], 2.0)
    t.expire(3.5)  # p1's set is 3.5 s old
    assert t.tokens(A) == 10.0 and t.peers == 1
    t.forget("p2")  # its stream ended
    assert t.tokens(A) == 0.0 and t.peers == 0


def test_hostile_figures_are_skipped_or_bounded() -> None:
    t = PeerPrefill(max_peers=2, max_endpoints=2)
    t.update("p1", [(A, math.nan), (B, -5.0), ("c", math.inf), ("d", 1e30)], 0.0)
    assert t.tokens(A) == t.tokens(B) == 0.0
    assert t.tokens(EndpointId("d")) == 1e9
    t.update("p2", [("e", 1.0), ("f", 1.0), ("g", 1.0)], 0.0)  # past max_endpoints: ignored
    assert t.tokens(EndpointId("g")) == 0.0
    t.update("p3", [(A, 1.0)], 0.0)  # past max_peers
    assert t.tokens(A) == 0.0 and t.peers == 2


def _endpoint(eid: EndpointId) -> Endpoint:
    host, _, port = eid.rpartition(":")
    return Endpoint(eid, host, int(port), metrics=Metrics(kv_usage=0.1, scraped_at_s=1.0))


def test_the_ledger_adds_the_peers_prefill_to_its_own() -> None:
    from epp.datastore.prefill import PrefillLedger

    ledger = PrefillLedger()
    assert isinstance(ledger, SharedPrefill)
    scorer = PredictedTtftScorer("ttft", PredictedTtftParams())
    pool = [_endpoint(A), _endpoint(B)]
    state = CycleState(InferenceRequest("r", "m", "x" * 4000), 1.0, random.Random(0))
    state.prefix = PrefixMatch([], {})
    state.prefill = ledger  # what every plugin reads
    alone = scorer.score(state, pool)
    assert alone[0] == alone[1]  # equal endpoints
    peers = PeerPrefill()
    ledger.use_peer_prefill(peers.tokens)
    peers.update("p1", [(A, 20_000.0)], 0.0)  # another replica queued 20k tokens on A
    assert scorer.features(state, pool[0])[2] == 20_000.0
    scored = scorer.score(state, pool)
    assert scored[0] < scored[1] == 1.0
    assert ledger.prefill_in_flight() == {}  # its own is what it publishes, not the sum
    ledger.sent(B, 400.0)
    assert ledger.prefill_in_flight() == {B: 100.0}  # tokens on the wire, 4 characters each
