"""Anthropic Messages keyed as vLLM renders them (system, tools, then the turns)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from epp.errors import BadRequest
from epp.request.flatten import chat_prompt
from epp.request.messages import messages_prompt

TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {"type": "object",
          "properties": {"path": {"type": "string"}}}}]  # fmt: skip
PNG = "iVBORw0KGgoAAAANSUhEUgAAADAAAAAwCAYAAABXAvmH" * 4


def body(messages: list[Any], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": messages, **kw}


def agent_turns() -> list[list[dict[str, Any]]]:
    """An agent session's requests: each the previous one plus its reply and a tool result."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    turns = [list(msgs)]
    for i in range(3):
        msgs.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"look at file {i}", "signature": "s"},
            {"type": "text", "text": f"Reading file {i}."},
            {"type": "tool_use", "id": f"tu_{i}", "name": "read_file", "input": {"path": f"f{i}.py"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"tu_{i}", "content": [{"type": "text", "text": f"contents {i}"}]}]})
        turns.append(list(msgs))  # fmt: skip
    return turns


def test_system_then_tools_then_the_turns_and_each_turn_extends_the_last() -> None:
    keys = [messages_prompt(body(t, system="You are a coding agent.", tools=TOOLS)) for t in agent_turns()]
    assert keys[0].startswith("<|system|>You are a coding agent.<|tools|>[")
    assert keys[0].endswith("<|user|>fix the failing test")
    for a, b in itertools.pairwise(keys):
        assert b.startswith(a) and len(b) > len(a)
    assert ('<|assistant|>[think]look at file 0[/think]Reading file 0.[call read_file({"path":"f0.py"})]'
            '<|tool|>[result tu_0]contents 0') in keys[1]  # fmt: skip


def test_a_messages_conversation_keys_as_its_vllm_chat_twin() -> None:
    """vLLM converts Messages to chat before rendering: the two forms key alike."""
    anthropic = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                     {"type": "text", "text": "next"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]},
    ]  # fmt: skip
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [{"id": "t1", "type": "function",
                                                               "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "next"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
    ]  # fmt: skip
    assert messages_prompt(body(anthropic, system=[{"type": "text", "text": "S"}])) == chat_prompt(chat)


def test_the_billing_header_block_is_not_keyed_as_vllm_drops_it() -> None:
    def key(header: str) -> str:
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; cch={header};"},
                  {"type": "text", "text": "You are Claude Code."}]  # fmt: skip
        return messages_prompt(body([{"role": "user", "content": "x"}], system=system))

    assert key("a1b2") == key("c3d4") == "<|system|>You are Claude Code.<|user|>x"


def test_different_images_differ_and_tool_result_images_follow_the_result() -> None:
    def key(data: str) -> str:
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        return messages_prompt(body([{"role": "user", "content": [block, {"type": "text", "text": "t"}]}]))

    assert key(PNG + "A") != key(PNG + "B") and key(PNG) == key(PNG)
    result = {"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "shot"},
        {"type": "image", "source": {"type": "url", "url": "https://x/s.png"}}]}  # fmt: skip
    k = messages_prompt(body([{"role": "user", "content": [result]}]))
    assert k.startswith("<|tool|>[result t]shot<|user|>[image_url:")


def test_documents_are_keyed_by_their_whole_source() -> None:
    def key(data: str) -> str:
        doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}
        return messages_prompt(body([{"role": "user", "content": [doc]}]))

    assert key("JVBERi0" + "A" * 200) != key("JVBERi0" + "A" * 199 + "B")


def test_different_tools_with_equal_messages_share_no_chunk() -> None:
    msgs = [{"role": "user", "content": "same " * 100}]
    other = [{"name": "write_file", "input_schema": {"type": "object"}}]
    a = messages_prompt(body(msgs, tools=TOOLS))
    b = messages_prompt(body(msgs, tools=other))
    assert next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) < 64


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (body([]), "'messages' must be a non-empty list"),
        (body([{"role": "bot", "content": "x"}]), r"'messages\[0\].role'"),
        (body([{"role": "user", "content": 5}]), r"'messages\[0\].content'"),
        (body([{"role": "user", "content": [{"text": "x"}]}]), r"'messages\[0\].content\[0\].type'"),
        (body([{"role": "user", "content": [{"type": "text", "text": 3}]}]), r"content\[0\].text"),
        (body([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]), r"content\[0\].name"),
        (body([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": [1]}]}]), r"content\[0\].input"),
        (body([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]), r"content\[0\].tool_use_id"),
        (body([{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]), r"content\[0\].source"),
        (body([{"role": "user", "content": "x"}], system=7), "'system'"),
        (body([{"role": "user", "content": "x"}], tools=[{"name": "f"}]), r"'tools\[0\].input_schema'"),
        (body([{"role": "user", "content": "x"}], tools=[{"input_schema": {}}]), r"'tools\[0\].name'"),
    ],
)
def test_bodies_vllm_would_refuse_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        messages_prompt(json.loads(json.dumps(doc)))


def test_server_tools_and_unknown_blocks_are_accepted() -> None:
    doc = body([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "server_tool_use", "id": "s"}]}],
               tools=[{"type": "web_search_20250305", "name": "web_search"}])  # fmt: skip
    assert messages_prompt(doc).endswith("<|user|>x")
