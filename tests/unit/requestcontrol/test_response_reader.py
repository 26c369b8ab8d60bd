from __future__ import annotations

import json

import pytest

from epp.requestcontrol.response import ResponseReader

USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 6}}
EVENTS = [
    {"model": "served", "choices": [{"delta": {"content": "Héllo"}}]},
    {"model": "served", "choices": [{"delta": {"content": " 世界"}}]},
    {"model": "served", "choices": [], "usage": USAGE},
]
SSE = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"


def feed_all(reader: ResponseReader, data: bytes, size: int) -> bytes:
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(reader.feed(p, i == len(parts) - 1) for i, p in enumerate(parts))


@pytest.mark.parametrize("size", [1, 2, 5, 13, 64, len(SSE)])
def test_sse_usage_and_text_whatever_the_chunking(size: int) -> None:
    r = ResponseReader(200, sse=True)
    assert feed_all(r, SSE, size) == SSE
    info = r.info()
    assert (info.prompt_tokens, info.cached_tokens, info.completion_tokens) == (10, 6, 3)
    assert info.generated_text == "Héllo 世界"


@pytest.mark.parametrize("size", [1, 7, len(SSE)])
def test_sse_model_mapped_back(size: int) -> None:
    r = ResponseReader(200, sse=True, served_model="served", client_model="alias")
    out = feed_all(r, SSE, size)
    assert out == SSE.replace(b'"model": "served"', b'"model": "alias"')
    assert r.info().prompt_tokens == 10


def test_json_usage_passthrough_and_rewrite() -> None:
    doc = {"model": "served", "choices": [{"message": {"content": "ok"}}], "usage": USAGE}
    raw = json.dumps(doc).encode()
    r = ResponseReader(200, sse=False)
    assert feed_all(r, raw, 10) == raw
    assert r.info().cached_tokens == 6 and r.info().generated_text == "ok"
    r = ResponseReader(200, sse=False, served_model="served", client_model="alias")
    out = feed_all(r, raw, 10)
    assert json.loads(out)["model"] == "alias" and json.loads(out)["usage"] == USAGE


def test_usage_is_read_where_only_the_standard_library_reads_the_body_and_a_rewrite_is_exact() -> None:
    # NaN: orjson refuses it, the standard library reads it; 2**70: exact in the rewrite
    raw = b'{"model":"served","logprob":NaN,"seed":1180591620717411303425,"usage":' + json.dumps(
        USAGE).encode() + b"}"
    r = ResponseReader(200, sse=False)
    assert feed_all(r, raw, 7) == raw and r.info().cached_tokens == 6
    r = ResponseReader(200, sse=False, served_model="served", client_model="alias")
    out = json.loads(feed_all(r, raw, 7))
    assert out["model"] == "alias" and out["seed"] == 2**70 + 1


def test_non_json_and_missing_usage_are_harmless() -> None:
    r = ResponseReader(500, sse=False)
    assert r.feed(b"upstream exploded", True) == b"upstream exploded"
    info = r.info()
    assert (info.status, info.prompt_tokens, info.cached_tokens) == (500, 0, None)


def test_sse_line_over_the_limit_is_forwarded_unread_and_reading_resumes_after_it() -> None:
    from epp.requestcontrol.response import ResponseLimits

    r = ResponseReader(200, sse=True, limits=ResponseLimits(sse_line_bytes=100))
    chunks = [b"data: " + b"x" * 150, b"y" * 50, b'zz\ndata: {"usage":{"prompt_tokens":7}}\n', b""]
    out = b"".join(r.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks))
    assert out == b"".join(chunks)
    assert r.info().prompt_tokens == 7  # the line after the long one is read


def test_json_over_the_limit_is_forwarded_unread() -> None:
    from epp.requestcontrol.response import ResponseLimits

    body = b'{"usage":{"prompt_tokens":9},"pad":"' + b"p" * 200 + b'"}'
    r = ResponseReader(200, sse=False, limits=ResponseLimits(json_bytes=100))
    assert r.feed(body[:120], False) + r.feed(body[120:], True) == body
    assert r.info().prompt_tokens == 0


RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "output": [], "usage": {"input_tokens": 9, "output_tokens": 2,
                                    "input_tokens_details": {"cached_tokens": 4}}}  # fmt: skip


def responses_sse(response: dict[str, object]) -> bytes:
    events = [
        ("response.created", {"type": "response.created", "response": {**response, "status": "in_progress", "usage": None}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
        ("response.completed", {"type": "response.completed", "response": response}),
    ]  # fmt: skip
    return b"".join(f"event: {name}\ndata: {json.dumps(e)}\n\n".encode() for name, e in events)


def test_a_stored_response_names_its_id_in_json_and_in_its_first_event() -> None:
    r = ResponseReader(200, sse=False)
    r.feed(json.dumps(RESPONSE).encode(), True)
    assert r.stored_ids == ["resp_1"]
    s = ResponseReader(200, sse=True)
    data = responses_sse({**RESPONSE, "conversation": {"id": "conv_1"}})
    first_event = data.index(b"\n\n") + 2
    s.feed(data[:first_event], False)
    assert s.stored_ids == ["resp_1", "conv_1"]  # known before the stream ends
    s.feed(data[first_event:], True)
    assert s.stored_ids == ["resp_1", "conv_1"]
    info = s.info()  # the Responses stream's usage, from response.completed
    assert (info.prompt_tokens, info.cached_tokens, info.completion_tokens) == (9, 4, 2)


@pytest.mark.parametrize(("status", "body", "expected"), [
    (200, {**RESPONSE, "store": False}, []),
    (404, {"error": {"message": "not found"}, "object": "response", "id": "resp_1"}, []),
    (200, {"id": "conv_9", "object": "conversation"}, ["conv_9"]),
    (200, {"id": "chatcmpl-1", "object": "chat.completion"}, []),
    (200, {**RESPONSE, "id": "x" * 257}, []),
    (200, {**RESPONSE, "id": 5}, []),
])  # fmt: skip
def test_only_a_successful_stored_object_is_noted(status: int, body: dict[str, object], expected: list[str]) -> None:
    r = ResponseReader(status, sse=False)
    r.feed(json.dumps(body).encode(), True)
    assert r.stored_ids == expected


def test_json_over_the_limit_with_a_rewrite_is_let_go_rewritten_in_place() -> None:
    """A rewritten model used to make the reader hold the whole JSON body whatever its size
    (10 MiB held against a 1 MiB limit): past the limit it is forwarded as it comes, its
    model mapped back in place (issue 70, item 7)."""
    from epp.requestcontrol.response import BodyBudget, ResponseLimits

    body = b'{"id":"x","model":"served","choices":[{"text":"' + b"t" * 10_000 + b'"}]}'
    budget = BodyBudget(1 << 20)
    r = ResponseReader(200, sse=False, served_model="served", client_model="alias",
                       limits=ResponseLimits(json_bytes=1000), budget=budget)  # fmt: skip
    out = b""
    most = 0
    for i in range(0, len(body), 300):
        out += r.feed(body[i : i + 300], i + 300 >= len(body))
        most = max(most, budget.used)
    assert most <= 1000 and budget.used == 0
    assert out == body.replace(b'"model":"served"', b'"model":"alias"')
    # Envoy's BUFFERED mode: the whole body in one message
    r = ResponseReader(200, sse=False, served_model="served", client_model="alias",
                       limits=ResponseLimits(json_bytes=1000), budget=budget)  # fmt: skip
    assert json.loads(r.feed(body, True))["model"] == "alias" and budget.used == 0


def test_responses_share_one_byte_budget() -> None:
    """Many responses held at once are bounded together, not each on its own: past the
    shared budget a response is forwarded unread."""
    from epp.requestcontrol.response import BodyBudget, ResponseLimits

    budget = BodyBudget(10_000)
    limits = ResponseLimits(json_bytes=4_000, sse_line_bytes=4_000)
    readers = [ResponseReader(200, sse=i % 2 == 0, limits=limits, budget=budget) for i in range(10)]
    part = b"data: " + b"x" * 2_994  # an unfinished SSE line / a JSON head of 3,000 bytes
    for r in readers:
        assert r.feed(part, False) in (b"", part)
        assert budget.used <= budget.max_bytes
    assert budget.used == 9_000  # three held, the others passed through unread
    for r in readers:
        r.feed(b"\n", True)
        r.release()
    assert budget.used == 0


# --- Anthropic Messages: vLLM's front end, and the Anthropic API's own shape ---------------


def anthropic_sse(start_usage: dict[str, int], end_usage: dict[str, int]) -> bytes:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "served",
            "usage": start_usage}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Héllo"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " 世界"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": end_usage}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return b"".join(f"event: {name}\ndata: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()
                    for name, doc in events)  # fmt: skip


@pytest.mark.parametrize(
    ("start", "end"),
    [
        # vLLM 0.32 (--enable-prompt-tokens-details): the last event carries the whole usage,
        # input_tokens net of the cache read
        ({"input_tokens": 900, "output_tokens": 0}, {"input_tokens": 100, "output_tokens": 3,
                                                     "cache_read_input_tokens": 800}),
        # the Anthropic API: message_start has the input side, message_delta the output count
        ({"input_tokens": 100, "cache_read_input_tokens": 800, "output_tokens": 1}, {"output_tokens": 3}),
    ],
)
@pytest.mark.parametrize("size", [1, 9, 10_000])
def test_anthropic_stream_usage_and_text(start: dict[str, int], end: dict[str, int], size: int) -> None:
    data = anthropic_sse(start, end)
    r = ResponseReader(200, sse=True)
    assert feed_all(r, data, size) == data
    info = r.info()
    assert (info.prompt_tokens, info.cached_tokens, info.completion_tokens) == (900, 800, 3)
    assert info.generated_text == "Héllo 世界"  # the thinking is not the reply's text


def test_anthropic_json_usage_and_text() -> None:
    doc = {"id": "msg_1", "type": "message", "role": "assistant", "model": "served", "content": [
        {"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        "usage": {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 32,
                  "cache_creation_input_tokens": 4}}  # fmt: skip
    r = ResponseReader(200, sse=False)
    r.feed(json.dumps(doc).encode(), True)
    info = r.info()
    assert (info.prompt_tokens, info.cached_tokens, info.completion_tokens) == (46, 32, 7)
    assert info.generated_text == "Sure."
    r = ResponseReader(200, sse=False)  # without prompt-token details: no cache figure
    r.feed(json.dumps({"type": "message", "content": [], "usage": {"input_tokens": 10, "output_tokens": 1}}).encode(), True)
    assert (r.info().prompt_tokens, r.info().cached_tokens) == (10, None)


def test_responses_usage_counts_cached_inside_input() -> None:
    r = ResponseReader(200, sse=False)
    usage = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 5}
    r.feed(json.dumps({"object": "response", "usage": usage}).encode(), True)
    assert (r.info().prompt_tokens, r.info().cached_tokens, r.info().completion_tokens) == (50, 32, 5)
