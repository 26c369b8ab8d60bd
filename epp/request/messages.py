"""Anthropic Messages (``POST /v1/messages``) flattened for prefix hashing, in the order the
model server renders it.

vLLM 0.32 serves Messages by converting the request to a chat completion
(``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request``) and rendering that
with the model's chat template; this module writes the key of the converted request in the
vocabulary of :mod:`epp.request.flatten`, so a Messages conversation and its chat twin key
alike:

* ``system`` (a string, or text blocks joined with nothing between them) is the leading
  ``<|system|>`` message; text blocks that start with ``x-anthropic-billing-header`` are
  dropped, as vLLM drops them (Claude Code puts a per-request hash there that would otherwise
  make every request's prefix unique);
* ``tools`` follow it (``<|tools|>`` and their JSON), then the messages;
* a message is ``<|role|>`` and its blocks: ``text`` as is; ``image`` (base64 or URL source) as
  the media key of the data URL vLLM builds from it; ``document`` as the media key of its
  source; ``thinking`` as ``[think]...[/think]`` before the text (vLLM hands it to the
  template as the message's reasoning); ``tool_use`` as ``[call name(input)]`` after the
  text; ``redacted_thinking`` and ``tool_reference`` as nothing;
* a ``tool_result`` block in a user message becomes a ``<|tool|>[result id]`` message of its
  own, written before the rest of that user message (vLLM emits the tool messages first),
  with its images after it as a user message; in an assistant message it is the text
  ``Tool result: ...``.

Each block is validated as vLLM's ``AnthropicMessagesRequest`` would validate it (the field is
named in the 400), except that ``document`` blocks and tools of a server ``type`` are accepted
(other servers take them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from epp.errors import BadRequest
from epp.request.flatten import media_digest, media_key, tools_text, url_digest

BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")
_MEDIA_BLOCKS = ("image", "document")
_TOOL_CHANGES = ("tool_addition", "tool_removal")
_MARK = {role: f"<|{role}|>" for role in _ROLES}

# Hot path: a 100k-token agent request has hundreds of blocks. Bodies come from JSON, so
# objects are ``dict`` (an exact ``isinstance(x, dict)`` is ~5x cheaper than the ``Mapping``
# ABC's), and a block's location is spelled out only when it is named in an error.


def messages_prompt(doc: Mapping[str, Any]) -> str:
    """The key text of a Messages request body (``system``, ``tools``, ``messages``)."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out: list[str] = []
    system = doc.get("system")
    if system is not None:
        text = _system_text(system, "system")
        if text:
            out.append("<|system|>")
            out.append(text)
    tools = doc.get("tools")
    if tools is not None:
        out.append(tools_text(tools, "tools", _check_tool))
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of user, assistant, system")
        content = message.get("content")
        if isinstance(content, str):
            if role != "system" or not content.startswith(BILLING_HEADER):
                out.append(_MARK[role])
                out.append(content)
        elif not isinstance(content, list):
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of content blocks")
        elif role == "system":
            text = _system_text(content, f"messages[{i}].content")
            if text:
                out.append("<|system|>")
                out.append(text)
        else:
            _blocks(role, content, i, out)
    return "".join(out)


def _system_text(system: Any, where: str) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise BadRequest(f"'{where}' must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(system):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str):
                if text and not text.startswith(BILLING_HEADER):
                    parts.append(text)
                continue
        if kind in _TOOL_CHANGES:
            parts.append(f"[{kind} {_dumps(block.get('tool'))}]")
        elif kind != "text" or block.get("text") is not None:
            _check_block(block, f"{where}[{j}]")
    return "".join(parts)


def _blocks(role: str, blocks: list[Any], i: int, out: list[str]) -> None:
    """One user or assistant message of content blocks, as vLLM converts it: text and media
    are its content, thinking its reasoning (written first), tool_use its tool calls (written
    last), and a user's tool_result a tool message of its own, before it."""
    content: list[str] = []
    calls: list[str] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if text and isinstance(text, str):
                content.append(text)
            elif text is not None and not isinstance(text, str):
                raise BadRequest(f"'{_at(i, j)}.text' must be a string")
        elif kind == "tool_result" and role == "user":
            _tool_result(block, i, j, out)
        elif kind == "tool_use":
            calls.append(_tool_use(block, i, j))
        else:
            _other_block(kind, block, i, j, content, thinking)
    if not content and role == "user":
        return  # only tool results: vLLM sends no empty user message
    out.append(_MARK[role])
    if thinking:
        out.append("[think]" + "".join(thinking) + "[/think]")
    out.extend(content)
    out.extend(calls)


def _other_block(kind: str | None, block: Any, i: int, j: int, content: list[str],
                 thinking: list[str]) -> None:  # fmt: skip
    if kind in _MEDIA_BLOCKS:
        content.append(_media(str(kind), block, _at(i, j)))
    elif kind == "thinking":
        text = block.get("thinking")
        if text is not None and not isinstance(text, str):
            raise BadRequest(f"'{_at(i, j)}.thinking' must be a string")
        thinking.append(text or "")
    elif kind == "tool_result":  # in an assistant message: text, as vLLM writes it
        content.append(f"Tool result: {_result_text(block, i, j)}")
    elif kind in _TOOL_CHANGES:
        raise BadRequest(f"'{_at(i, j)}': {kind} blocks are only allowed in system messages")
    else:  # redacted_thinking, tool_reference, blocks of other types: vLLM renders nothing
        _check_block(block, _at(i, j))


def _at(i: int, j: int) -> str:
    return f"messages[{i}].content[{j}]"


def _check_block(block: Any, at: str) -> None:
    """A block must be an object with a string ``type``."""
    if not isinstance(block, dict):
        raise BadRequest(f"'{at}' must be an object")
    if not isinstance(block.get("type"), str):
        raise BadRequest(f"'{at}.type' must be a string")


def _media(kind: str, block: dict[str, Any], at: str) -> str:
    if kind == "image":
        return media_key("image_url", _image_digest(block.get("source"), at))
    digest = media_digest(block.get("source"))
    if digest is None:
        raise BadRequest(f"'{at}.source' must be an object with its data or url")
    return media_key("document", digest)


def _tool_use(block: dict[str, Any], i: int, j: int) -> str:
    name = block.get("name")
    if not isinstance(name, str):
        raise BadRequest(f"'{_at(i, j)}.name' must be a string")
    args = block.get("input")
    if args is not None and not isinstance(args, dict):
        raise BadRequest(f"'{_at(i, j)}.input' must be an object")
    return f"[call {name}({_dumps(args or {})})]"


def _tool_result(block: dict[str, Any], i: int, j: int, out: list[str]) -> None:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise BadRequest(f"'{_at(i, j)}.tool_use_id' must be a string")
    out.append(f"<|tool|>[result {tool_use_id}]")
    body = block.get("content")
    if isinstance(body, str):  # the common case
        out.append(body)
        return
    if body is None:
        return
    if not isinstance(body, list):
        raise BadRequest(f"'{_at(i, j)}.content' must be a string or a list of blocks")
    texts = []
    images: list[str] = []
    for k, item in enumerate(body):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            text = item.get("text")
            if text is not None and not isinstance(text, str):
                raise BadRequest(f"'{_at(i, j)}.content[{k}].text' must be a string")
            texts.append(text or "")
        elif kind == "image":
            digest = _image_digest(item.get("source"), f"{_at(i, j)}.content[{k}]")
            images.append(media_key("image_url", digest))
        else:
            _check_block(item, f"{_at(i, j)}.content[{k}]")
    out.append("\n".join(texts))
    if images:
        out.append("<|user|>")
        out.extend(images)


def _result_text(block: dict[str, Any], i: int, j: int) -> str:
    body = block.get("content")
    if body is None or isinstance(body, str):
        return body or ""
    if not isinstance(body, list):
        raise BadRequest(f"'{_at(i, j)}.content' must be a string or a list of blocks")
    return _dumps(body)


def _image_digest(source: Any, at: str) -> str:
    """The digest of the URL vLLM makes of an image source (``url``, else a base64 data
    URL), hashed in place (the data is not copied)."""
    if not isinstance(source, dict):
        raise BadRequest(f"'{at}.source' must be an object")
    if source.get("type") == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise BadRequest(f"'{at}.source.url' must be a string")
        return url_digest(url)
    if source.get("type") == "file":
        digest = media_digest(source)
        if digest is None:
            raise BadRequest(f"'{at}.source.file_id' must be a string")
        return digest
    data = source.get("data")
    media_type = source.get("media_type", "image/jpeg")
    if not isinstance(data, str) or not isinstance(media_type, str):
        raise BadRequest(f"'{at}.source' must hold 'data' (base64) and 'media_type' strings")
    return url_digest("data:", media_type, ";base64,", data)


def _check_tool(tool: Mapping[str, Any], where: str) -> None:
    if not isinstance(tool.get("name"), str):
        raise BadRequest(f"'{where}.name' must be a string")
    if tool.get("type", "custom") == "custom" and not isinstance(tool.get("input_schema"), dict):
        raise BadRequest(f"'{where}.input_schema' must be an object")


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer beyond 64 bits (a body read exactly)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --- the chat request vLLM makes of a Messages request (precise mode renders it) -------------


def chat_body(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat completion request vLLM 0.32 converts a Messages body to
    (``AnthropicServingMessages.to_chat_completion_request``): ``messages`` (system first,
    tool results as ``tool`` messages, tool uses as ``tool_calls``, thinking as
    ``reasoning``), ``tools`` as function tools, ``chat_template_kwargs``; for the precise
    producer, which renders it with the model's template. None where the rendering depends on
    what epp cannot know (``thinking`` / ``output_config`` set a reasoning effort the server
    resolves itself). Call it on a body :func:`messages_prompt` accepted."""
    if doc.get("output_config") is not None or (
        isinstance(doc.get("thinking"), dict) and doc["thinking"].get("type") == "disabled"
    ):
        return None
    return chat_request(doc)


def chat_request(doc: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`chat_body` whatever the reasoning effort (the emulator serves Messages this way)."""
    out: list[dict[str, Any]] = []
    system = doc.get("system")
    text = _system_text(system, "system") if system is not None else ""
    if text:
        out.append({"role": "system", "content": text})
    for message in doc["messages"]:
        role, content = message["role"], message["content"]
        if role == "system":
            text = _system_text(content, "system")
            if text and not text.startswith(BILLING_HEADER):
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            _chat_blocks(role, content, out)
    body: dict[str, Any] = {"messages": out}
    tools = doc.get("tools")
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t["input_schema"] if "type" in t["input_schema"] else {**t["input_schema"], "type": "object"}, "strict": t.get("strict"), "defer_loading": t.get("defer_loading")}}
            for t in tools]  # fmt: skip
    if isinstance(doc.get("chat_template_kwargs"), dict):
        body["chat_template_kwargs"] = doc["chat_template_kwargs"]
    return body


def _chat_blocks(role: str, blocks: list[Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "", "type": "function", "function": {
                "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            _chat_tool_result(block, out)
        elif kind == "tool_result":
            body = block.get("content")
            parts.append({"type": "text", "text": f"Tool result: {body if body else ''}"})
    message: dict[str, Any] = {"role": role}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if only_text else parts
    if role == "user" and "content" not in message:
        return
    out.append(message)


def _chat_tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    body = block.get("content")
    images: list[str] = []
    if isinstance(body, list):
        texts = []
        for item in body:
            if isinstance(item, dict) and item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif isinstance(item, dict) and item.get("type") == "image":
                images.append(_image_url(item.get("source") or {}))
        body = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": body or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
