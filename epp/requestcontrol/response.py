"""What epp reads from (and rewrites in) a model server's response.

``ResponseReader`` is fed the response body chunk by chunk. It

- finds ``usage`` (prompt, ``prompt_tokens_details.cached_tokens``, completion tokens) in a
  plain JSON body or in an SSE stream (the chunk with ``stream_options.include_usage``); in
  Anthropic Messages replies, ``input_tokens`` + ``cache_read_input_tokens`` +
  ``cache_creation_input_tokens`` are the prompt and ``cache_read_input_tokens`` the cached
  part (JSON, or a stream's ``message_start`` and ``message_delta`` events); SGLang's
  ``/generate`` puts them in ``meta_info``,
- keeps the generated text (capped) so the scheduler can record the next conversation turn,
- notes the ids of objects the server stored (``stored_ids``): a Responses-API response
  (JSON, or the ``response`` object of its SSE events: ``response.created`` first) unless it
  says ``"store": false``, its conversation, a created conversation,
- maps a rewritten ``model`` back to the name the client sent, returning the bytes to forward.

Without a rewrite every chunk is forwarded unchanged as soon as it arrives; with one, a JSON
body is held until its end and an SSE stream is forwarded line by line.

Bounds: a JSON body is held (to read its usage, or to rewrite its model) up to
``ResponseLimits.json_bytes``, an SSE line up to ``sse_line_bytes``, and all responses together
up to a shared :class:`BodyBudget` (``total_bytes``). Past a bound the response is forwarded
as it comes, unread; a held JSON body being rewritten is then let go with its ``"model"``
rewritten in place (the first occurrence: servers write the top-level field first).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from epp.framework.request import MAX_STORED_ID_CHARS
from epp.framework.types import ResponseInfo
from epp.request import jsondoc

log = logging.getLogger(__name__)

MAX_GENERATED_CHARS = 64 * 1024
"""Generated text kept for the index; longer answers are truncated (their head is what the
next turn's prompt shares anyway)."""
MAX_JSON_BYTES = 4 * 1024 * 1024
"""Default: plain JSON bodies larger than this are forwarded without usage parsing."""
MAX_SSE_LINE_BYTES = 1024 * 1024
"""Default: an SSE line longer than this is forwarded without being parsed (nor held)."""


MAX_HELD_BYTES = 512 << 20
"""Default: response bytes all streams hold together (``--max-buffered-response-bytes``)."""


@dataclass(slots=True, frozen=True)
class ResponseLimits:
    """What a response may make epp hold (``--max-response-json-bytes``,
    ``--max-sse-line-bytes``), and all responses together
    (``--max-buffered-response-bytes``)."""

    json_bytes: int = MAX_JSON_BYTES
    sse_line_bytes: int = MAX_SSE_LINE_BYTES
    total_bytes: int = MAX_HELD_BYTES


class BodyBudget:
    """Body bytes held by all streams together, bounded by ``max_bytes`` (one for request
    bodies, one for responses)."""

    __slots__ = ("max_bytes", "used")

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self.used = 0


DEFAULT_LIMITS = ResponseLimits()
_MAX_STORED_IDS = 4
"""Stored objects noted per response (a response and its conversation)."""
MAX_TOKENS = 1 << 31
"""Token counts outside [0, MAX_TOKENS] in ``usage`` are read as absent (0)."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    seen: bool = False


class ResponseReader:
    __slots__ = (
        "_budget",
        "_buf",
        "_charged",
        "_from",
        "_held",
        "_limits",
        "_long_line",
        "_size",
        "_text",
        "_text_len",
        "_to",
        "_too_big",
        "sse",
        "status",
        "stored_ids",
        "usage",
    )

    def __init__(
        self,
        status: int,
        sse: bool,
        served_model: str = "",
        client_model: str = "",
        limits: ResponseLimits = DEFAULT_LIMITS,
        budget: BodyBudget | None = None,
    ):
        self.status = status
        self._limits = limits
        self._budget = budget if budget is not None else BodyBudget(limits.total_bytes)
        self._charged = 0
        """Bytes of ``_buf`` counted in the shared budget."""
        self.sse = sse
        rewrite = bool(client_model) and client_model != served_model
        self._from = json.dumps(served_model).encode() if rewrite else b""
        self._to = json.dumps(client_model).encode() if rewrite else b""
        self._buf = bytearray()  # JSON: the whole body; SSE: the unfinished last line
        self._held = rewrite and not sse
        self._text: list[str] = []
        self._text_len = 0
        self.usage = Usage()
        self._too_big = False
        self._size = 0
        self._long_line = False
        """Inside an SSE line past MAX_SSE_LINE_BYTES: pass it through up to its newline."""
        self.stored_ids: list[str] = []
        """Ids of objects the server stored for this request, in the order first seen (a
        successful response only)."""

    @property
    def rewriting(self) -> bool:
        return bool(self._from)

    def feed(self, chunk: bytes, end: bool) -> bytes:
        """Consume one body chunk; return the bytes to forward now."""
        self._size += len(chunk)
        try:
            if self.sse:
                return self._feed_sse(chunk, end)
            return self._feed_json(chunk, end)
        finally:
            self._charge()

    def release(self) -> None:
        """Give back what this response holds in the shared budget (the stream ended)."""
        self._buf = bytearray()
        self._charge()

    def _charge(self) -> None:
        held = len(self._buf)
        if held != self._charged:
            self._budget.used += held - self._charged
            self._charged = held

    def _room(self, held: int, limit: int) -> bool:
        """Whether this response may hold ``held`` bytes (its own limit, the shared budget)."""
        budget = self._budget
        return held <= limit and budget.used - self._charged + held <= budget.max_bytes

    def _feed_json(self, chunk: bytes, end: bool) -> bytes:
        if not self._too_big:
            if self._room(len(self._buf) + len(chunk), self._limits.json_bytes):
                self._buf += chunk
            else:  # too large to hold: forwarded as it comes, unread
                self._too_big = True
                if self._held:  # let go of it, rewritten in place
                    self._held = False
                    out = self._rewrite_model(bytes(self._buf) + chunk)
                    self._buf = bytearray()
                    return out
                self._buf = bytearray()
        if not end:
            return b"" if self._held else chunk
        if self._too_big:
            return chunk
        body = bytes(self._buf)
        self._buf = bytearray()
        doc = self._read_json(body)
        if not self._held:
            return chunk
        if isinstance(doc, dict) and doc.get("model") == json.loads(self._from):
            doc["model"] = json.loads(self._to)
            return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
        return body

    def _rewrite_model(self, data: bytes) -> bytes:
        """``data`` with its first ``"model": <served>`` naming the client's model."""
        for sep in (b'"model":', b'"model": '):
            at = data.find(sep + self._from)
            if at >= 0:
                cut = at + len(sep)
                return data[:cut] + self._to + data[cut + len(self._from):]
        return data

    def info(self, ttft_s: float | None = None) -> ResponseInfo:
        u = self.usage
        return ResponseInfo(
            status=self.status,
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.cached_tokens,
            completion_tokens=u.completion_tokens,
            generated_text="".join(self._text),
            response_bytes=self._size,
            ttft_s=ttft_s,
        )

    # --- JSON --------------------------------------------------------------------------

    def _read_json(self, body: bytes) -> Any:
        try:
            # a body written back (``_held``) is read exactly: integers past 64 bits stay ints
            doc = jsondoc.strict(body) if self._held else jsondoc.loads(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            log.debug("response body is not usable JSON; no usage read")
            return None
        if isinstance(doc, dict):
            self._take_usage(doc.get("usage"))
            self._take_text(doc)
            self._take_stored(doc)
        return doc

    # --- SSE ---------------------------------------------------------------------------

    def _feed_sse(self, chunk: bytes, end: bool) -> bytes:
        passed = b""
        if self._long_line:  # the rest of an overlong line goes through unread
            nl = chunk.find(b"\n")
            if nl < 0:
                return chunk
            self._long_line = False
            passed, chunk = chunk[: nl + 1], chunk[nl + 1 :]
        buf = self._buf
        if not self._room(len(buf) + len(chunk), 1 << 62) and chunk.rfind(b"\n") < 0:
            # the shared budget is spent: this line goes through as it comes, unread
            held = bytes(buf) + chunk if self.rewriting else chunk
            self._buf = bytearray()
            self._long_line = True
            return passed + held
        buf += chunk
        cut = buf.rfind(b"\n") + 1
        if end:
            cut = len(buf)
        if cut == 0:
            if len(buf) > self._limits.sse_line_bytes:
                held = bytes(buf) if self.rewriting else chunk
                buf.clear()
                self._long_line = True
                return passed + held
            return passed if self.rewriting else passed + chunk
        complete = bytes(buf[:cut])
        del buf[:cut]
        for line in complete.split(b"\n"):
            if line.startswith(b"data:"):
                self._sse_data(line[5:].strip())
        if self.rewriting:
            return passed + complete.replace(
                b'"model":' + self._from, b'"model":' + self._to
            ).replace(b'"model": ' + self._from, b'"model": ' + self._to)
        return passed + chunk

    def _sse_data(self, data: bytes) -> None:
        if not data or data == b"[DONE]":
            return
        try:
            doc = jsondoc.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(doc, dict):
            response = doc.get("response")
            if isinstance(response, dict):  # a Responses-API event: the response object
                doc = response
                self._take_stored(doc)
            usage = doc.get("usage")
            if usage:
                self._take_usage(usage)
            self._take_text(doc)

    # --- shared ------------------------------------------------------------------------

    def _take_usage(self, usage: Any) -> None:
        """Fields present are taken, absent ones keep what an earlier event said (an
        Anthropic stream's ``message_delta`` may carry only ``output_tokens``)."""
        if not isinstance(usage, dict):
            return
        u = self.usage
        u.seen = True
        if "prompt_tokens" in usage or "completion_tokens" in usage:  # OpenAI chat, completions
            u.prompt_tokens = _int(usage.get("prompt_tokens"))
            u.completion_tokens = _int(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details")
        else:  # Responses and Anthropic Messages
            if "input_tokens" in usage:
                # Anthropic counts cache reads and writes apart from input_tokens (vLLM's
                # Messages front end too); Responses counts them inside it
                read = usage.get("cache_read_input_tokens")
                written = usage.get("cache_creation_input_tokens")
                u.prompt_tokens = min(MAX_TOKENS, _int(usage.get("input_tokens")) + _int(read)
                                      + _int(written))  # fmt: skip
                if read is not None:
                    u.cached_tokens = _int(read)
            if "output_tokens" in usage:
                u.completion_tokens = _int(usage.get("output_tokens"))
            details = usage.get("input_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            u.cached_tokens = _int(details.get("cached_tokens"))

    def _take_stored(self, doc: dict[str, Any]) -> None:
        """A response object the server stored (OpenAI's default; vLLM with
        ``VLLM_ENABLE_RESPONSES_API_STORE=1``, whose replies omit ``store``), its
        conversation, or a conversation object."""
        if not 200 <= self.status < 300:
            return
        kind = doc.get("object")
        if kind == "response":
            if doc.get("store") is False:
                return
            self._note_stored(doc.get("id"))
            conversation = doc.get("conversation")
            if isinstance(conversation, dict):
                self._note_stored(conversation.get("id"))
        elif kind == "conversation":
            self._note_stored(doc.get("id"))

    def _note_stored(self, oid: Any) -> None:
        ids = self.stored_ids
        if (isinstance(oid, str) and 0 < len(oid) <= MAX_STORED_ID_CHARS and oid not in ids
                and len(ids) < _MAX_STORED_IDS):  # fmt: skip
            ids.append(oid)

    def _take_text(self, doc: dict[str, Any]) -> None:
        if self._text_len >= MAX_GENERATED_CHARS:
            return
        choices = doc.get("choices")
        if choices is None:
            if "meta_info" in doc:
                self._take_sglang(doc)
            else:
                self._take_anthropic_text(doc)
            return
        if not isinstance(choices, list) or not choices:
            return
        first = choices[0]
        if not isinstance(first, dict):
            return
        text = first.get("text")
        if not isinstance(text, str):
            part = first.get("delta") or first.get("message")
            text = part.get("content") if isinstance(part, dict) else None
        self._keep(text)

    def _take_anthropic_text(self, doc: dict[str, Any]) -> None:
        """An Anthropic Messages reply: a ``message``'s text blocks, or a stream's
        ``content_block_delta`` text (usage: ``message_start`` and ``message_delta``)."""
        kind = doc.get("type")
        if kind == "content_block_delta":
            delta = doc.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                self._keep(delta.get("text"))
        elif kind == "message":
            blocks = doc.get("content")
            if isinstance(blocks, list):
                for block in blocks:
                    if isinstance(block, dict) and block.get("type") == "text":
                        self._keep(block.get("text"))
        elif kind == "message_start":
            message = doc.get("message")
            if isinstance(message, dict):
                self._take_usage(message.get("usage"))

    def _take_sglang(self, doc: dict[str, Any]) -> None:
        """SGLang's ``/generate``: usage in ``meta_info``; ``text`` is the whole text so far
        (a stream repeats it, growing: SGLang's default), so the last one is kept."""
        meta = doc.get("meta_info")
        if isinstance(meta, dict) and "prompt_tokens" in meta:
            self._take_usage({"prompt_tokens": meta.get("prompt_tokens"),
                              "completion_tokens": meta.get("completion_tokens"),
                              "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens")}})  # fmt: skip
        text = doc.get("text")
        if isinstance(text, str):
            self._text.clear()
            self._text_len = 0
            self._keep(text)

    def _keep(self, text: Any) -> None:
        if isinstance(text, str) and text and self._text_len < MAX_GENERATED_CHARS:
            text = text[: MAX_GENERATED_CHARS - self._text_len]
            self._text.append(text)
            self._text_len += len(text)


def _int(value: Any) -> int:
    """A token count; anything else (negative, absurdly large, not an integer) reads as 0."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return 0
