"""The predicted-TTFT scorer: prefers the endpoint with less work ahead and more of the
prompt cached, and fits its cost model to observed times to first token."""

from __future__ import annotations

import random

from epp.datastore.endpoint import Endpoint, EndpointId, Metrics
from epp.plugins.ttft import PredictedTtftParams, PredictedTtftScorer
from epp.request.types import InferenceRequest
from epp.scheduling.types import CycleState, PickResult, PrefixMatch, ResponseInfo

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


def ep(eid: EndpointId, waiting: int = 0, running: int = 0) -> Endpoint:
    return Endpoint(eid, eid.split(":")[0], 8000,
                    metrics=Metrics(waiting=waiting, running=running, scraped_at_s=1.0))  # fmt: skip


def state(rid: str, chars: int, matched: dict[EndpointId, int] | None = None) -> CycleState:
    s = CycleState(InferenceRequest(rid, "m", "x" * chars), 0.0, random.Random(0))
    s.prefix = PrefixMatch(list(range(chars // 64)), matched or {}, 64)
    return s


def test_cached_prefix_and_short_queues_score_higher() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams())
    idle, busy = ep(A), ep(B, waiting=6, running=20)
    scores = sc.score(state("r1", 8000), [idle, busy])
    assert scores[0] == 1.0 and scores[1] < 0.5
    cached = sc.score(state("r4", 64_000, {B: 1000}), [ep(A), ep(B, running=2)])
    assert cached[1] == 1.0 and cached[0] < 1.0  # 16k tokens cached on B outweigh 2 running


def test_the_cost_model_fits_observed_ttfts() -> None:
    sc = PredictedTtftScorer("t", PredictedTtftParams(prefill_seconds_per_token=1e-6))
    rng = random.Random(1)
    for i in range(400):  # the truth: 0.05 s + 3e-4 s per uncached token
        chars = rng.randrange(400, 40_000)
        s = state(f"r{i}", chars)
        endpoint = ep(A, running=rng.randrange(0, 3))
        sc.score(s, [endpoint])
        sc.post_pick(s, PickResult((endpoint,), s))
        sc.post_response(s, PickResult((endpoint,), s),
                         ResponseInfo(200, ttft_s=0.05 + 3e-4 * chars / 4))  # fmt: skip
    assert abs(sc.coef[1] - 3e-4) < 3e-5 and abs(sc.coef[0] - 0.05) < 0.02
    assert sc.errors.count == 400
