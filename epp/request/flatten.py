"""Turn the prompt fields of OpenAI-style bodies into one stable string for prefix hashing.

Chat flattening
---------------
Every message becomes ``<|role|>`` followed by its text, in order, with nothing after the last
message. Text is: a string ``content`` as is; a list of content parts joined in order (``text``
parts by their text, media parts by :func:`media_key`); ``tool_calls`` as
``[call name(arguments)]``; a ``tool`` message's ``tool_call_id`` as ``[result id]``; ``name`` as
``(name)`` after the role. Because each message only appends to the string, the flattened turn
N+1 of a conversation starts with every character of turn N: the whole of turn N is a shared
prefix, which is what a model server's KV cache also sees.

Tools
-----
A request's ``tools`` (JSON schemas, often 10-30k characters, equal across an agent's
requests) are keyed as ``<|tools|>`` and their JSON, placed where chat templates render them:
after a leading ``system`` (or ``developer``) message and before every other message (Qwen 2.5
and 3, DeepSeek-V3, Llama 3.1's first user turn; vLLM 0.32's Anthropic front end converts
``system`` and ``tools`` the same way). Two requests with different tools therefore differ from
the tools on, as their rendered prompts do. ``tool_choice`` and ``response_format`` are not
keyed: vLLM's templates do not render them (they steer decoding), so requests that differ only
there share the server's cache.

Media
-----
A media part (``image_url``, ``input_image``, ``input_audio``, ``audio_url``, ``video_url``,
``file``, ``input_file``) is keyed by the xxh3 digest of its whole reference (URL, inline data,
file id), never by a part of it: two images of one format and size differ from their first
base64 characters past the header. The digest is written :data:`MEDIA_KEY_CHARS` characters
long, about the weight of an image's tokens, so that requests sharing an image and differing
after it share that much key. Cost: the reference is hashed once (~10 GB/s), never decoded.

Bodies come from JSON, so objects are checked as ``dict`` (an exact check, several times
cheaper than the ``Mapping`` ABC's on a prompt of hundreds of messages).

The tokens a model server actually computes depend on its chat template; the index only needs
"equal prefixes flatten to equal prefixes, different ones differ early", which this guarantees.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from typing import Any

import orjson
import xxhash

from epp.errors import BadRequest

_MEDIA_PARTS = frozenset(
    ("image_url", "input_image", "input_audio", "audio_url", "file", "input_file", "video_url")
)
_MEDIA_REF_KEYS = ("url", "image_url", "data", "file_data", "file_id", "file_url")
"""The fields of a media part (or of its object) that say which medium it is."""
_SYSTEM_ROLES = ("system", "developer")
MEDIA_KEY_CHARS = 1024
"""Characters of key a media part stands for (its 16-hex-digit digest repeated): ~256 tokens at
4 characters a token, the order of an image's tokens in common vision-language models."""
_DIGEST_REPEAT = MEDIA_KEY_CHARS // 16
TOOLS_MARK = "<|tools|>"


def completion_prompt(prompt: Any, field: str = "prompt") -> str:
    """``/v1/completions`` ``prompt``: a string, a list of strings, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return "\x1e".join(prompt)
        if isinstance(first, int):
            return token_ids_text(prompt, field)
        if isinstance(first, list) and all(isinstance(p, list) and p for p in prompt):
            return "\x1e".join(token_ids_text(p, field) for p in prompt)
    raise BadRequest(f"'{field}' must be a string, a list of strings, or a list of token ids")


def token_ids_text(ids: list[Any], field: str = "prompt") -> str:
    """Token ids as text for the chunk hasher: 4 characters per id (its 32-bit little-endian
    bytes as Latin-1), so a chunk of ``blockChars`` holds ``blockChars / 4`` whole tokens and
    a million-token prompt converts in milliseconds (C loops, no per-id string).

    Raises BadRequest for anything but integers in [0, 2**32): the array conversion refuses
    strings, floats, negatives and big numbers; JSON ``true`` / ``false`` (which Python
    counts as integers) are found by serializing the list once (C speed, ~0.5 ms per 100k ids).
    """
    try:
        packed = array("I", ids)
    except (TypeError, OverflowError):
        raise BadRequest(
            f"'{field}' token lists must contain only integers from 0 to 4294967295"
        ) from None
    as_json = orjson.dumps(ids)
    if b"t" in as_json or b"f" in as_json:
        raise BadRequest(f"'{field}' token lists must contain integers, not true or false")
    return packed.tobytes().decode("latin-1")


def chat_prompt(messages: Any, tools: Any = None) -> str:
    """``/v1/chat/completions`` ``messages`` (and ``tools``) flattened as described in the
    module docstring."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out: list[str] = []
    tools_at = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
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
        if i == 0 and role in _SYSTEM_ROLES:
            tools_at = len(out)
    if tools is not None:
        out.insert(tools_at, tools_text(tools, "tools", _check_openai_tool))
    return "".join(out)


def tools_text(tools: Any, field: str, check: Any = None) -> str:
    """``<|tools|>`` and the tools' JSON (as sent: templates render them with ``tojson``, which
    keeps their order). ``check(tool, where)`` validates one tool. An empty list renders as no
    tools, as templates do."""
    if not isinstance(tools, list):
        raise BadRequest(f"'{field}' must be a list of tools")
    if not tools:
        return ""
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise BadRequest(f"'{field}[{j}]' must be an object")
        if check is not None:
            check(tool, f"{field}[{j}]")
    try:
        text = orjson.dumps(tools).decode()
    except TypeError:  # an integer beyond 64 bits (a body read exactly): the slow path
        text = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    return TOOLS_MARK + text


def _check_openai_tool(tool: Mapping[str, Any], where: str) -> None:
    """An OpenAI function tool needs ``function.name`` (vLLM's ``ChatCompletionToolsParam``)."""
    if tool.get("type", "function") != "function":
        return
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"'{where}.function' must be an object")
    if not isinstance(fn.get("name"), str):
        raise BadRequest(f"'{where}.function.name' must be a string")


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
        if not isinstance(part, dict):
            raise BadRequest(f"'{where}[{j}]' must be an object")
        kind = part.get("type", "text")
        text = part.get("text")
        if isinstance(text, str):
            parts.append(text)
        elif kind in _MEDIA_PARTS:
            ref = part.get(kind, part)
            digest = media_digest(ref)
            if digest is None:
                raise BadRequest(f"'{where}[{j}]' names no {kind} (a url, data or file id)")
            parts.append(media_key(str(kind), digest))
        else:
            parts.append(f"[{kind}]")
    return "".join(parts)


def media_digest(ref: Any) -> str | None:
    """The xxh3-64 hex digest of a media reference: a string (URL or data URL), or an object
    whose reference fields (``url``, ``data``, ``file_data``, ``file_id``...) are hashed
    whole with their names; None when it holds none."""
    if isinstance(ref, str):
        return xxhash.xxh3_64_hexdigest(_utf8(ref))
    if not isinstance(ref, dict):
        return None
    h = None
    for key in _MEDIA_REF_KEYS:
        value = ref.get(key)
        if isinstance(value, str):
            if h is None:
                h = xxhash.xxh3_64()
            h.update(key.encode())
            h.update(_utf8(value))
    return h.hexdigest() if h is not None else None


def url_digest(*pieces: str) -> str:
    """The digest :func:`media_digest` gives ``{"url": "".join(pieces)}``, without joining
    (an Anthropic base64 image is keyed as the data URL vLLM builds from it)."""
    h = xxhash.xxh3_64()
    h.update(b"url")
    for piece in pieces:
        h.update(_utf8(piece))
    return h.hexdigest()


def _utf8(text: str) -> bytes:
    """UTF-8 bytes of client text (a lone surrogate passes: the parser refuses it later,
    with its own message)."""
    return text.encode("utf-8", "surrogatepass")


def media_key(kind: str, digest: str) -> str:
    """A media part's key text: its kind and digest, :data:`MEDIA_KEY_CHARS` long."""
    return f"[{kind}:{digest * _DIGEST_REPEAT}]"


def _tool_calls_text(calls: Any, i: int) -> str:
    if not isinstance(calls, list):
        raise BadRequest(f"'messages[{i}].tool_calls' must be a list")
    out = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        if not isinstance(fn, dict):
            fn = {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, sort_keys=True, separators=(",", ":"))
        out.append(f"[call {fn.get('name', '')}({args})]")
    return "".join(out)


def responses_prompt(input_: Any, instructions: Any = None, tools: Any = None) -> str:
    """``/v1/responses``: ``instructions``, then ``tools``, then ``input`` (a string or a list
    of items)."""
    head = f"<|system|>{instructions}" if isinstance(instructions, str) and instructions else ""
    if tools is not None:
        head += tools_text(tools, "tools")
    if isinstance(input_, str):
        return head + "<|user|>" + input_
    if isinstance(input_, list):
        items = [_response_item(item) for item in input_]
        if not items:
            raise BadRequest("'input' must not be empty")
        return head + chat_prompt(items)
    raise BadRequest("'input' must be a string or a list of input items")


def _response_item(item: Any) -> Any:
    if isinstance(item, dict):
        if "role" in item:
            return item
        kind = str(item.get("type", "item"))
        body = item.get("output", item.get("arguments", ""))
        text = body if isinstance(body, str) else json.dumps(body, sort_keys=True)
        return {"role": kind, "content": f"{item.get('name', '')}{item.get('call_id', '')}{text}"}
    return {"role": "user", "content": item}


def embeddings_prompt(input_: Any) -> str:
    """``/v1/embeddings`` ``input``: same shapes as a completion prompt."""
    return completion_prompt(input_, "input")
