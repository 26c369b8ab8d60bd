from __future__ import annotations

import pytest

from epp.errors import BadRequest
from epp.request.flatten import (
    MEDIA_KEY_CHARS,
    chat_prompt,
    completion_prompt,
    embeddings_prompt,
    responses_prompt,
)


def test_next_turn_extends_the_flattened_previous_turn() -> None:
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "thanks"}]
    a, b = chat_prompt(turn1), chat_prompt(turn2)
    assert b.startswith(a) and len(b) > len(a)
    assert "[image_url:" in a and "[call f({\"a\":1})]" in b and "[result c1]42" in b


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


# --- media: the whole reference, never a prefix of it ------------------------------------


def _image(url: str) -> dict[str, object]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "describe it"}]}  # fmt: skip


def test_images_that_share_their_first_bytes_key_apart_and_an_equal_one_keys_alike() -> None:
    head = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAAADAAAAAwCAYAAABXAvmHAAAA" * 3
    a, b = head + "AAAA", head + "AAAB"  # equal past the first 64 characters, then not
    ka, kb = chat_prompt([_image(a)]), chat_prompt([_image(b)])
    assert ka != kb and len(ka) == len(kb)
    first_difference = next(i for i, (x, y) in enumerate(zip(ka, kb, strict=True)) if x != y)
    assert first_difference < len("<|user|>[image_url:") + 16  # in the image's first chunk
    assert chat_prompt([_image(a)]) == ka  # the same image keys alike
    assert len(ka) == len("<|user|>") + len("[image_url:]") + MEDIA_KEY_CHARS + len("describe it")


@pytest.mark.parametrize(
    ("part", "other"),
    [
        ({"type": "input_image", "image_url": "https://x/1.png"}, {"type": "input_image", "image_url": "https://x/2.png"}),
        ({"type": "input_file", "file_data": "JVBERi0xLjQ" + "A" * 100}, {"type": "input_file", "file_data": "JVBERi0xLjQ" + "A" * 99 + "B"}),
        ({"type": "input_audio", "input_audio": {"data": "UklGR" + "a" * 80, "format": "wav"}},
         {"type": "input_audio", "input_audio": {"data": "UklGR" + "a" * 79 + "b", "format": "wav"}}),
        ({"type": "video_url", "video_url": {"url": "https://x/v.mp4?a=1"}}, {"type": "video_url", "video_url": {"url": "https://x/v.mp4?a=2"}}),
        ({"type": "file", "file": {"file_id": "file-1"}}, {"type": "file", "file": {"file_id": "file-2"}}),
    ],
)
def test_every_media_part_is_keyed_by_its_whole_reference(part: dict[str, object], other: dict[str, object]) -> None:
    def key(p: dict[str, object]) -> str:
        return chat_prompt([{"role": "user", "content": [p]}])

    assert key(part) != key(other) and key(part) == key(dict(part))


def test_a_media_part_without_a_reference_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match=r"messages\[0\].content\[0\]"):
        chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


# --- tools: after a leading system message, before the rest --------------------------------


TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
OTHER_TOOLS = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]


def test_tools_are_keyed_after_the_system_message_and_before_the_turns() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    key = chat_prompt(msgs, TOOLS)
    assert key.startswith("<|system|>S<|tools|>[") and key.endswith("]<|user|>U")
    assert chat_prompt(msgs[1:], TOOLS).startswith("<|tools|>")  # no system message: first
    assert chat_prompt(msgs, []) == chat_prompt(msgs)  # templates render no empty tool list


def test_different_tools_with_equal_messages_differ_from_the_tools_on() -> None:
    msgs = [{"role": "user", "content": "same question " * 50}]
    a, b = chat_prompt(msgs, TOOLS), chat_prompt(msgs, OTHER_TOOLS)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared < 64  # within the first chunk: no full-prefix hit
    turn2 = chat_prompt([*msgs, {"role": "assistant", "content": "ok"}], TOOLS)
    assert turn2.startswith(a)  # with the same tools, the next turn still extends the last


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ({"name": "x"}, "'tools' must be a list"),
        ([3], r"'tools\[0\]' must be an object"),
        ([{"type": "function"}], r"'tools\[0\].function' must be an object"),
        ([{"type": "function", "function": {"name": 5}}], r"'tools\[0\].function.name'"),
    ],
)
def test_bad_tools_name_the_field(tools: object, field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        chat_prompt([{"role": "user", "content": "x"}], tools)


def test_responses_tools_follow_the_instructions() -> None:
    tools = [{"type": "function", "name": "grep", "parameters": {}}]
    assert responses_prompt("q", "sys", tools).startswith("<|system|>sys<|tools|>[")


# --- token ids: what vLLM would refuse is refused --------------------------------------


@pytest.mark.parametrize("ids", [[True, False], [1, True], [[1, 2], [False]], [[1], []]])
def test_token_ids_that_are_booleans_or_empty_are_bad_requests(ids: object) -> None:
    with pytest.raises(BadRequest, match="'input'"):
        embeddings_prompt(ids)
