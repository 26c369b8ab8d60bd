"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) as vLLM 0.32 serves
them: the request is converted to a chat request (``system`` first, ``tool_result`` blocks as
``tool`` messages, ``tool_use`` as tool calls, images as data URLs: epp's mirror of vLLM's
conversion), flattened with the emulator's chat flattening (tools after the system message),
and answered in Anthropic's shapes: a ``message`` with ``usage`` (``input_tokens`` net of ``cache_read_input_tokens``, as
vLLM reports it with ``--enable-prompt-tokens-details``), or a stream of ``message_start``,
``content_block_*``, ``message_delta`` (the usage) and ``message_stop`` events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.errors import BadRequest
from epp.request.messages import chat_request
from epp.request.messages import messages_prompt as validate
from simulator.emulator.openai import ApiError, flatten_messages, sse


def messages_prompt(body: Mapping[str, Any]) -> str:
    """The emulator's prompt of a Messages request: the chat request vLLM makes of it
    (``epp.request.messages.chat_request``, which mirrors vLLM's conversion), flattened."""
    try:
        validate(body)  # refuses what vLLM's request model refuses, naming the field
    except BadRequest as exc:
        raise ApiError(400, exc.message) from None
    chat = chat_request(body)
    if not chat["messages"]:  # every block is one vLLM drops (thinking, document, unknown types)
        kinds = sorted({str(b.get("type")) for m in body["messages"] if isinstance(m.get("content"), list)
                        for b in m["content"] if isinstance(b, dict)})  # fmt: skip
        what = f"vLLM renders no content for blocks of type {', '.join(kinds)}" if kinds else "every message is empty"
        raise ApiError(400, f"nothing to prompt with: {what}; give a message a text, image or tool block",
                       "messages")  # fmt: skip
    return flatten_messages(chat["messages"], "messages", chat.get("tools"))


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
