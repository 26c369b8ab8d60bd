"""Turn the prompt fields of OpenAI-style bodies into one stable string for prefix hashing.

Chat flattening
---------------
Every message becomes ``<|role|>`` followed by its text, in order, with nothing after the last
message. Text is: a string ``content`` as is; a list of content parts joined in order (``text``
parts by their text, image/audio/file parts by a stable ``[type:ref]`` marker naming the URL or
the first 64 characters of inline data, so two requests with the same image share the chunk);
``tool_calls`` as ``[call name(arguments)]``; a ``tool`` message's ``tool_call_id`` as
``[result id]``; ``name`` as ``(name)`` after the role. Because each message only appends to the
string, the flattened turn N+1 of a conversation starts with every character of turn N: the
whole of turn N is a shared prefix, which is what a model server's KV cache also sees.

The tokens a model server actually computes depend on its chat template; the index only needs
"equal prefixes flatten to equal prefixes", which this guarantees.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from typing import Any

from epp.errors import BadRequest

_MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio_url", "file", "video_url")


def completion_prompt(prompt: Any) -> str:
    """``/v1/completions`` ``prompt``: a string, a list of strings, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return "\x1e".join(prompt)
        if isinstance(first, int):
            return _token_ids_text(prompt)
        if isinstance(first, list) and all(isinstance(p, list) for p in prompt):
            return "\x1e".join(_token_ids_text(p) for p in prompt)
    raise BadRequest("'prompt' must be a string, a list of strings, or a list of token ids")


def _token_ids_text(ids: list[Any]) -> str:
    """Token ids as text for the chunk hasher: 4 characters per id (its 32-bit little-endian
    bytes as Latin-1), so a chunk of ``blockChars`` holds ``blockChars / 4`` whole tokens and
    a million-token prompt converts in milliseconds (C loops, no per-id string)."""
    try:
        packed = array("I", ids)
    except (TypeError, OverflowError):
        raise BadRequest(
            "'prompt' token lists must contain only integers from 0 to 4294967295"
        ) from None
    return packed.tobytes().decode("latin-1")


def chat_prompt(messages: Any) -> str:
    """``/v1/chat/completions`` ``messages`` flattened as described in the module docstring."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRequest(f"'messages[{i}]' must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"'messages[{i}].role' must be a string")
        out.append(f"<|{role}|>")
        name = message.get("name")
        if isinstance(name, str):
            out.append(f"({name})")
        if "tool_call_id" in message:
            out.append(f"[result {message['tool_call_id']}]")
        out.append(_content_text(message.get("content"), f"messages[{i}].content"))
        calls = message.get("tool_calls")
        if calls:
            out.append(_tool_calls_text(calls, i))
    return "".join(out)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of content parts")
    parts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise BadRequest(f"'{where}[{j}]' must be an object")
        kind = part.get("type", "text")
        text = part.get("text")
        if isinstance(text, str):
            parts.append(text)
        elif kind in _MEDIA_PARTS or any(k in part for k in _MEDIA_PARTS):
            parts.append(f"[{kind}:{_media_ref(part)}]")
        else:
            parts.append(f"[{kind}]")
    return "".join(parts)


def _media_ref(part: Mapping[str, Any]) -> str:
    for key in _MEDIA_PARTS:
        value = part.get(key)
        if isinstance(value, Mapping):
            value = value.get("url") or value.get("file_id") or value.get("data")
        if isinstance(value, str):
            return value[:64]
    return ""


def _tool_calls_text(calls: Any, i: int) -> str:
    if not isinstance(calls, list):
        raise BadRequest(f"'messages[{i}].tool_calls' must be a list")
    out = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        if not isinstance(fn, Mapping):
            fn = {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, sort_keys=True, separators=(",", ":"))
        out.append(f"[call {fn.get('name', '')}({args})]")
    return "".join(out)


def responses_prompt(input_: Any, instructions: Any = None) -> str:
    """``/v1/responses``: ``instructions`` then ``input`` (a string or a list of items)."""
    head = f"<|system|>{instructions}" if isinstance(instructions, str) and instructions else ""
    if isinstance(input_, str):
        return head + "<|user|>" + input_
    if isinstance(input_, list):
        items = [_response_item(item) for item in input_]
        if not items:
            raise BadRequest("'input' must not be empty")
        return head + chat_prompt(items)
    raise BadRequest("'input' must be a string or a list of input items")


def _response_item(item: Any) -> Any:
    if isinstance(item, Mapping):
        if "role" in item:
            return item
        kind = str(item.get("type", "item"))
        body = item.get("output", item.get("arguments", ""))
        text = body if isinstance(body, str) else json.dumps(body, sort_keys=True)
        return {"role": kind, "content": f"{item.get('name', '')}{item.get('call_id', '')}{text}"}
    return {"role": "user", "content": item}


def embeddings_prompt(input_: Any) -> str:
    """``/v1/embeddings`` ``input``: same shapes as a completion prompt."""
    try:
        return completion_prompt(input_)
    except BadRequest:
        raise BadRequest(
            "'input' must be a string, a list of strings, or a list of token ids"
        ) from None
