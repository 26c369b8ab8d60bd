"""The producer's sync seams: every write it makes itself reaches a ``subscribe``d sink with exactly
what went into the index; ``apply_remote`` writes without publishing."""

from __future__ import annotations

import random
from collections.abc import Sequence

from epp.config.loader import default_config
from epp.framework.endpoint import Endpoint, EndpointId, Metrics
from epp.framework.request import ApiKind, InferenceRequest
from epp.framework.types import ResponseInfo
from epp.plugins.approxprefix import PrefixProducer
from epp.scheduling.scheduler import Scheduler
from epp.wiring import build_scheduler

SYSTEM = "You are a helpful assistant. " * 20
EPS = [Endpoint(EndpointId(f"10.0.0.{i}:8000"), f"10.0.0.{i}", 8000,
                metrics=Metrics(scraped_at_s=1.0)) for i in range(3)]


def approx(s: Scheduler) -> PrefixProducer:
    producer = s.plugin(PrefixProducer)
    assert producer is not None
    return producer


def scheduler_with_sink() -> tuple[Scheduler, list[tuple[EndpointId, list[int], float]]]:
    s = build_scheduler(default_config(), random.Random(0))
    published: list[tuple[EndpointId, list[int], float]] = []

    def sink(eid: EndpointId, hashes: Sequence[int], now_s: float) -> None:
        published.append((eid, list(hashes), now_s))

    approx(s).subscribe(sink)
    return s, published


def test_the_pick_and_the_reply_are_published_as_written() -> None:
    s, published = scheduler_with_sink()
    result = s.schedule(InferenceRequest("r", "m", SYSTEM, api=ApiKind.CHAT), EPS, 5.0)
    target = result.target.id
    assert published == [(target, list(result.state.prefix.hashes), 5.0)]
    s.on_response(result, ResponseInfo(generated_text="Sure. " * 40))
    assert len(published) == 2
    eid, hashes, stamp = published[1]
    assert (eid, stamp) == (target, 5.0)
    assert hashes[: len(result.state.prefix.hashes)] == list(result.state.prefix.hashes)
    assert set(approx(s).index.chunks_of(target)) == set(hashes)


def test_a_prompt_shorter_than_a_chunk_publishes_nothing() -> None:
    s, published = scheduler_with_sink()
    s.schedule(InferenceRequest("r", "m", "hi"), EPS, 1.0)
    assert published == []


def test_apply_remote_writes_the_index_but_does_not_publish() -> None:
    s, published = scheduler_with_sink()
    approx(s).apply_remote(EPS[1].id, [11, 12], 3.0)
    assert approx(s).index.match([11, 12], [EPS[1].id], 3.0) == {EPS[1].id: 2}
    assert published == []


def test_the_lru_is_sized_by_the_characters_per_token_the_responses_report() -> None:
    # a tokenizer at 6.5 characters a token: a KV cache of 16,384 tokens holds ~106k characters
    # of prompt, not the 64k the prior of 4 assumes; the index must not forget prefixes early
    s = build_scheduler(default_config(), random.Random(0))
    producer = approx(s)
    server = Endpoint(EPS[0].id, EPS[0].address, 8000,
                      metrics=Metrics(scraped_at_s=1.0, block_size_tokens=16, num_gpu_blocks=1024))  # fmt: skip
    s.observe_endpoint(server)
    assert producer.index.capacity(server.id) == 16_384 * 4 // 64
    for i in range(200):
        result = s.schedule(InferenceRequest(f"r{i}", "m", SYSTEM + str(i)), [server], 1.0)
        chars = len(result.state.request.prompt)
        s.on_response(result, ResponseInfo(prompt_tokens=round(chars / 6.5)))
    assert abs(producer.chars_per_token - 6.5) < 0.1
    s.observe_endpoint(server)  # the next scrape resizes the LRU
    assert abs(producer.index.capacity(server.id) - 16_384 * 6.5 / 64) < 16
    s.on_response(result, ResponseInfo(prompt_tokens=3))  # too short to tell: ignored
    assert abs(producer.chars_per_token - 6.5) < 0.1


def test_the_predicted_ttft_profile_places_new_prefixes_where_the_index_has_room() -> None:
    from epp.config.loader import load_config

    s = build_scheduler(load_config("predicted-ttft"), random.Random(0))
    index = approx(s).index
    two = EPS[:2]
    for i in range(8):  # unrelated prompts, each answered before the next: equal load
        fills = dict(zip([e.id for e in two], index.fill([e.id for e in two]), strict=True))
        prompt = f"document {i}: " + f"{i} lorem ipsum dolor sit amet " * (40 + 10 * i)
        result = s.schedule(InferenceRequest(f"r{i}", "m", prompt), two, float(i))
        assert fills[result.target.id] == min(fills.values()), (i, fills)
        s.on_first_token(result, 0.1)
        s.on_response(result, ResponseInfo(200, ttft_s=0.1))
    assert all(f > 0 for f in index.fill([e.id for e in two]))


def test_an_answer_that_ends_puts_its_prompt_back_at_the_front_of_the_lru() -> None:
    """A server frees a request's blocks when it ends, the freshest of its LRU: so does the
    index, with or without the reply's text (the response summary does not read it)."""
    s = build_scheduler(default_config(), random.Random(0))
    producer = approx(s)
    server = Endpoint(EPS[0].id, EPS[0].address, 8000,
                      metrics=Metrics(scraped_at_s=1.0, block_size_tokens=16, num_gpu_blocks=20))  # fmt: skip
    s.observe_endpoint(server)
    assert producer.index.capacity(server.id) == 20  # chunks: two 10-chunk prompts
    a = s.schedule(InferenceRequest("a", "m", "a" * 640), [server], 1.0)
    b = s.schedule(InferenceRequest("b", "m", "b" * 640), [server], 2.0)
    s.on_response(a, ResponseInfo(200))  # a's answer ended; b's is still streaming
    s.schedule(InferenceRequest("c", "m", "c" * 640), [server], 3.0)  # evicts 10 chunks
    assert producer.index.match(a.state.prefix.hashes, [server.id], 3.0) == {server.id: 10}
    assert producer.index.match(b.state.prefix.hashes, [server.id], 3.0) == {}
