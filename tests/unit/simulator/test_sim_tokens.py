"""Token approximation, generated text and chat flattening used by the emulator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulator.emulator.openai import ApiError, flatten_messages
from simulator.model.tokens import count_tokens, generate_text, token_ids_text


@pytest.mark.parametrize(
    ("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("é" * 8, 2)]
)
def test_four_characters_per_token(text: str, tokens: int) -> None:
    assert count_tokens(text) == tokens


@given(st.text(max_size=200), st.integers(0, 300))
def test_generated_text_is_deterministic_and_four_chars_per_token(prompt: str, n: int) -> None:
    text = generate_text(prompt, n)
    assert text == generate_text(prompt, n)
    assert len(text) == 4 * n and count_tokens(text) == n


def test_different_prompts_get_different_answers() -> None:
    assert generate_text("question one", 16) != generate_text("question two", 16)


def test_token_id_prompts_keep_one_token_per_id() -> None:
    text = token_ids_text([1, 2, 128000])
    assert count_tokens(text) == 3
    assert text != token_ids_text([1, 2, 128001])


def test_next_turn_starts_with_previous_prompt_plus_answer() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt1 = flatten_messages(turn1, "messages")
    answer = generate_text(prompt1, 8)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    assert flatten_messages(turn2, "messages").startswith(prompt1 + answer)


def test_content_parts_are_joined() -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert "ab" in flatten_messages(parts, "messages")


@pytest.mark.parametrize(
    "bad", [None, [], "text", [{"content": "x"}], [{"role": "user", "content": 3}]]
)
def test_bad_messages_are_bad_requests(bad: object) -> None:
    with pytest.raises(ApiError) as err:
        flatten_messages(bad, "messages")
    assert err.value.status == 400
