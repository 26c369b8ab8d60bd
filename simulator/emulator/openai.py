"""OpenAI-compatible request parsing and response shapes, as vLLM serves them.

Parsing turns a JSON body into one :class:`Generation` (or :class:`EmbeddingJob`) value and
raises :class:`ApiError` for anything a client got wrong. Chat messages and Responses-API
input are flattened into one prompt text (``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n``), so that turn ``n+1`` starts with turn ``n``'s prompt plus its answer
and hits the blocks cached when turn ``n`` finished.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from simulator.model.tokens import token_ids_text

DEFAULT_MAX_TOKENS = 16
EMBEDDING_DIM = 8


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"
    """Anthropic Messages (``simulator.emulator.anthropic``)."""


class ApiError(Exception):
    """A request error with its HTTP status; rendered as ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(
            self.status, "InternalServerError"
        )
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(slots=True, frozen=True)
class Generation:
    api: Api
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool


@dataclass(slots=True, frozen=True)
class EmbeddingJob:
    model: str
    inputs: tuple[str, ...]


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def parse_generation(api: Api, body: Mapping[str, Any], default_model: str) -> Generation:
    model = _model(body, default_model)
    if api is Api.COMPLETIONS:
        prompt = _completion_prompt(body.get("prompt"))
        max_tokens = _max_tokens(body, "max_tokens")
    elif api is Api.CHAT:
        prompt = flatten_messages(body.get("messages"), "messages", body.get("tools"))
        max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    elif api is Api.MESSAGES:
        from simulator.emulator.anthropic import messages_prompt  # it builds on this module

        if body.get("max_tokens") is None:
            raise ApiError(400, "'max_tokens' is required", "max_tokens")
        prompt = messages_prompt(body)
        max_tokens = _max_tokens(body, "max_tokens")
    else:
        prompt = _responses_prompt(body)
        max_tokens = _max_tokens(body, "max_output_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    if not prompt:
        raise ApiError(400, "the prompt is empty")
    return Generation(api, model, prompt, max_tokens, stream, include_usage)


def parse_embeddings(body: Mapping[str, Any], default_model: str) -> EmbeddingJob:
    model = _model(body, default_model)
    raw = body.get("input")
    if isinstance(raw, str):
        inputs: tuple[str, ...] = (raw,)
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = tuple(raw)
    elif isinstance(raw, list) and raw and all(_is_int(x) for x in raw):
        inputs = (token_ids_text(raw),)
    elif (
        isinstance(raw, list)
        and raw
        and all(isinstance(x, list) and x and all(_is_int(i) for i in x) for x in raw)
    ):
        inputs = tuple(token_ids_text(x) for x in raw)
    else:
        raise ApiError(400, "'input' must be a string, a list of strings or token ids", "input")
    if any(not text for text in inputs):
        raise ApiError(400, "'input' must not contain empty strings", "input")
    return EmbeddingJob(model, inputs)


def flatten_messages(messages: object, param: str, tools: object = None) -> str:
    """The prompt the emulator caches: each message as ``<|role|>\\ncontent\\n`` (tool calls
    after the content), then ``<|assistant|>\\n``; ``tools`` after a leading system message,
    as chat templates render them (Qwen, DeepSeek-V3, Llama 3.1)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"'{param}' must be a non-empty list of messages", param)
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    parts = []
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, f"each of '{param}' must be an object with a 'role'", param)
        calls = msg.get("tool_calls")
        called = json.dumps(calls, sort_keys=True) if calls else ""
        parts.append(f"<|{msg['role']}|>\n{_content_text(msg.get('content'), param)}{called}\n")
    if tools:
        at = 1 if messages[0].get("role") in ("system", "developer") else 0
        parts.insert(at, f"<|tools|>\n{json.dumps(tools)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


MEDIA_TOKENS = 64
"""Prompt tokens a media part stands for (an image's patches): its text is a placeholder of
about this many tokens, named by a hash of the whole part (so equal images share a prefix,
different ones do not), not the part's JSON (a base64 image would count as ~1 token a byte)."""


def _media_text(part: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]
    return f"<media {digest}> " * (MEDIA_TOKENS // 4)


def _content_text(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                out.append(text if isinstance(text, str) else _media_text(part))
            else:
                raise ApiError(400, f"bad content part in '{param}'", param)
        return "".join(out)
    raise ApiError(400, f"message content in '{param}' must be a string or a list", param)


def _responses_prompt(body: Mapping[str, Any]) -> str:
    raw = body.get("input")
    instructions = body.get("instructions")
    prefix = ""
    if isinstance(instructions, str) and instructions:
        prefix = f"<|system|>\n{instructions}\n"
    if isinstance(raw, str):
        return f"{prefix}<|user|>\n{raw}\n<|assistant|>\n"
    if isinstance(raw, list) and raw:
        items = [
            item if isinstance(item, dict) and "role" in item else {"role": "user", "content": item}
            for item in raw
        ]
        return prefix + flatten_messages(items, "input")
    raise ApiError(400, "'input' must be a string or a non-empty list of items", "input")


def _completion_prompt(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        return raw[0]
    if isinstance(raw, list) and raw and all(_is_int(x) for x in raw):
        return token_ids_text(raw)
    if raw is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt)", "prompt")


def _model(body: Mapping[str, Any], default_model: str) -> str:
    model = body.get("model", default_model)
    if model is None:
        return default_model
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", "model")
    return model


def _max_tokens(body: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ApiError(400, f"'{name}' must be a positive integer", name)
        return int(value)
    return DEFAULT_MAX_TOKENS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- response shapes ---------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def responses_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    api: Api, rid: str, created: int, model: str, text: str, use: dict[str, Any]
) -> dict[str, Any]:
    if api is Api.CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": use,
        }
    if api is Api.RESPONSES:
        return responses_body(rid, created, model, text, "completed", use)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def responses_body(
    rid: str, created: int, model: str, text: str, status: str, use: dict[str, Any] | None
) -> dict[str, Any]:
    output = []
    if status == "completed":
        output = [
            {
                "type": "message",
                "id": f"msg_{rid}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "output": output,
        "usage": use,
    }


def stream_chunk(
    api: Api, rid: str, created: int, model: str, text: str, finish: str | None, first: bool
) -> dict[str, Any]:
    if api is Api.CHAT:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    api: Api, rid: str, created: int, model: str, use: dict[str, Any]
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if api is Api.CHAT else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def sse(data: Mapping[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def embedding_vector(text: str) -> list[float]:
    """A deterministic unit-free vector of :data:`EMBEDDING_DIM` numbers in [-1, 1)."""
    seed = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
    return [
        ((xxhash.xxh3_64_intdigest(b"%d" % i, seed=seed) >> 11) / 2**52) - 1.0
        for i in range(EMBEDDING_DIM)
    ]
