"""A trace request as the HTTP request a client of one API sends (``epp-sim load --api``).

A request that carries its recorded body (a request-log row with ``messages``: OpenAI chat,
or Anthropic Messages with ``api: messages``) is sent as recorded. A text prompt is
rewritten into the API's form: a flattened conversation (the ``<|role|>`` markers epp and the
generators write: ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>``) becomes its
turns, an assistant turn followed by a tool's output a tool call (``tool_use`` / OpenAI
``tool_calls``) and its result (``tool_result`` / a ``tool`` message), with ids numbered
within the conversation so that a session's next request repeats them: its prefix stays
its previous request. A prompt without markers is one user turn (Messages, chat) or the
prompt itself (completions).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from epp.framework.request import ApiKind
from simulator.replay.workload import TraceRequest

APIS = {"completions": ApiKind.COMPLETIONS, "chat": ApiKind.CHAT, "messages": ApiKind.MESSAGES}
PATHS = {ApiKind.COMPLETIONS: "/v1/completions", ApiKind.CHAT: "/v1/chat/completions",
         ApiKind.MESSAGES: "/v1/messages"}  # fmt: skip
_MARK = re.compile(r"<\|(system|user|assistant|tool)\|>")
TOOL_NAME = "run"


def turns(prompt: str) -> list[tuple[str, str]]:
    """``(role, text)`` of a flattened conversation; ``[("user", prompt)]`` without markers."""
    pieces = _MARK.split(prompt)
    if len(pieces) == 1:
        return [("user", prompt)]
    out = [("user", pieces[0])] if pieces[0] else []
    out += [(pieces[i], pieces[i + 1]) for i in range(1, len(pieces), 2)]
    return out


def _call_id(n: int) -> str:
    return f"toolu_{n:04d}"


def messages_fields(prompt: str) -> dict[str, Any]:
    """Anthropic Messages ``system`` and ``messages`` of a prompt."""
    parts = turns(prompt)
    system = "".join(text for role, text in parts if role == "system")
    messages: list[dict[str, Any]] = []
    calls = 0
    for i, (role, text) in enumerate(parts):
        nxt = parts[i + 1][0] if i + 1 < len(parts) else ""
        if role == "user":
            messages.append({"role": "user", "content": text})
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
            if nxt == "tool":
                calls += 1
                blocks.append({"type": "tool_use", "id": _call_id(calls), "name": TOOL_NAME, "input": {}})
            messages.append({"role": "assistant", "content": blocks or text})
        elif role == "tool":
            prev = parts[i - 1][0] if i else ""
            if prev == "assistant":
                block = {"type": "tool_result", "tool_use_id": _call_id(calls), "content": text}
                messages.append({"role": "user", "content": [block]})
            else:
                messages.append({"role": "user", "content": text})
    fields: dict[str, Any] = {"messages": messages or [{"role": "user", "content": prompt}]}
    if system:
        fields["system"] = system
    return fields


def chat_fields(prompt: str) -> dict[str, Any]:
    """OpenAI chat ``messages`` of a prompt."""
    parts = turns(prompt)
    messages: list[dict[str, Any]] = []
    calls = 0
    for i, (role, text) in enumerate(parts):
        nxt = parts[i + 1][0] if i + 1 < len(parts) else ""
        if role == "assistant" and nxt == "tool":
            calls += 1
            messages.append({"role": "assistant", "content": text, "tool_calls": [{
                "id": _call_id(calls), "type": "function", "function": {"name": TOOL_NAME, "arguments": "{}"}}]})  # fmt: skip
        elif role == "tool" and i and parts[i - 1][0] == "assistant":
            messages.append({"role": "tool", "tool_call_id": _call_id(calls), "content": text})
        else:
            messages.append({"role": "user" if role == "tool" else role, "content": text})
    return {"messages": messages}


def request_as(req: TraceRequest, api: ApiKind | None, common: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` of ``req`` sent in the form of ``api`` (None: as recorded, a text
    prompt as a completion). ``common``: the fields every request carries (model,
    max_tokens, stream...)."""
    if req.body is not None and (api is None or api is req.api):
        return PATHS[req.api], {**req.body, **common}
    api = api or ApiKind.COMPLETIONS
    if api is ApiKind.MESSAGES:
        fields = messages_fields(req.prompt)
    elif api is ApiKind.CHAT:
        fields = chat_fields(req.prompt)
    else:
        fields = {"prompt": req.prompt}
    return PATHS[api], {**fields, **common}
