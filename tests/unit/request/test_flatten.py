from __future__ import annotations

import pytest

from epp.errors import BadRequest
from epp.request.flatten import chat_prompt, completion_prompt, embeddings_prompt, responses_prompt


def test_next_turn_extends_the_flattened_previous_turn() -> None:
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "thanks"}]
    a, b = chat_prompt(turn1), chat_prompt(turn2)
    assert b.startswith(a) and len(b) > len(a)
    assert "http://x/a.png" in a and "[call f({\"a\":1})]" in b and "[result c1]42" in b


def test_roles_and_content_are_both_part_of_the_text() -> None:
    assert chat_prompt([{"role": "user", "content": "x"}]) != chat_prompt([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"content": "no role"}], [{"role": "user", "content": 5}], [3]],
)
def test_bad_messages_are_bad_requests(messages: object) -> None:
    with pytest.raises(BadRequest):
        chat_prompt(messages)


def test_completion_prompt_shapes() -> None:
    assert completion_prompt("abc") == "abc"
    assert completion_prompt(["a", "b"]).startswith("a")
    assert completion_prompt([1, 2, 3]) == "\x01\0\0\0\x02\0\0\0\x03\0\0\0"  # 4 chars per id
    assert completion_prompt([[1], [2, 3]]).startswith("\x01\0\0\0\x1e")
    for bad in ([1, "a"], [1, -1], [1, 1 << 40], [1.5], [[1], "a"], []):
        with pytest.raises(BadRequest):
            completion_prompt(bad)
    with pytest.raises(BadRequest):
        completion_prompt({"x": 1})
    with pytest.raises(BadRequest):
        embeddings_prompt(None)


def test_responses_input() -> None:
    s = responses_prompt("hello", "be brief")
    assert s == "<|system|>be brief<|user|>hello"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert "hi" in responses_prompt(items)
    with pytest.raises(BadRequest):
        responses_prompt(7)
