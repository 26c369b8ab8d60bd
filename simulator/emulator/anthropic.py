"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) as vLLM 0.32 serves
them: the request is converted to chat messages (``system`` first, ``tool_result`` blocks as
``tool`` messages, ``tool_use`` as tool calls, images as data URLs), flattened with the
emulator's chat flattening (tools after the system message), and answered in Anthropic's
shapes: a ``message`` with ``usage`` (``input_tokens`` net of ``cache_read_input_tokens``, as
vLLM reports it with ``--enable-prompt-tokens-details``), or a stream of ``message_start``,
``content_block_*``, ``message_delta`` (the usage) and ``message_stop`` events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from simulator.emulator.openai import ApiError, flatten_messages, sse

BILLING_HEADER = "x-anthropic-billing-header"


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM makes of a Messages request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise ApiError(400, "each message needs a role of user, assistant or system", "messages")
        content = msg.get("content")
        if msg["role"] == "system":
            text = _system(content)
            if text:
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
        elif isinstance(content, list):
            _convert_blocks(msg["role"], content, out)
        else:
            raise ApiError(400, "message content must be a string or a list of blocks", "messages")
    return out


def _system(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list):
        raise ApiError(400, "'system' must be a string or a list of text blocks", "system")
    return "".join(b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) and not b["text"].startswith(BILLING_HEADER))  # fmt: skip


def _convert_blocks(role: str, blocks: list[Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if not isinstance(block, dict):
            raise ApiError(400, "a content block must be an object", "messages")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            source = block.get("source") or {}
            url = source.get("url") if source.get("type") == "url" else (
                f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            calls.append({"id": block.get("id", ""), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": json.dumps(block.get("input") or {})}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            if isinstance(result, list):
                result = "\n".join(b.get("text", "") for b in result if isinstance(b, dict) and b.get("type") == "text")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": result or ""})
    if role == "user" and not parts:
        return
    message: dict[str, Any] = {"role": role, "content": parts}
    if calls:
        message["tool_calls"] = calls
    out.append(message)


def tools_of(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Anthropic tools as the chat template sees them (OpenAI function tools)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                              "parameters": t.get("input_schema")}}
            for t in tools if isinstance(t, dict)]  # fmt: skip


def messages_prompt(body: Mapping[str, Any]) -> str:
    return flatten_messages(chat_messages(body), "messages", tools_of(body))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached_tokens}  # fmt: skip


def message_body(rid: str, model: str, text: str, use: Mapping[str, int]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens",
            "stop_sequence": None, "usage": dict(use)}  # fmt: skip


def stream_start(rid: str, model: str, prompt_tokens: int) -> bytes:
    head: dict[str, Any] = {"id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}  # fmt: skip
    return (sse({"type": "message_start", "message": head}, "message_start")
            + sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start"))  # fmt: skip


def stream_text(piece: str) -> bytes:
    return sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
               "content_block_delta")  # fmt: skip


def stream_end(use: Mapping[str, int]) -> bytes:
    return (sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                   "usage": dict(use)}, "message_delta")
            + sse({"type": "message_stop"}, "message_stop"))  # fmt: skip
