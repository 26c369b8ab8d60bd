"""The replay's general trace format: a request log, JSONL or CSV, one request per row
(docs/replay.md, "Request logs").

A row names when the request came, what it asked for and how long the answer was:

==================  ========================================================================
``timestamp``       seconds (a number; the first row need not be 0), or an ISO 8601 time;
                    arrival times are taken relative to the earliest row
``output_length``   tokens generated (required)
``prompt``          the prompt text (a completion), or
``messages``        a conversation (JSONL only; keyed as epp keys it and sent as recorded by
                    ``epp-sim load``): OpenAI chat ``messages`` (with ``tools``), or with
                    ``api: messages`` Anthropic Messages (with ``system`` and ``tools``), or
``prompt_token_ids`` the prompt as token ids (CSV: space-separated), or
``hash_ids``        Mooncake-style block ids (``block_tokens`` tokens each, 512 by default;
                    CSV: space-separated) with ``input_length``
``input_length``    prompt tokens (with ``hash_ids``; else counted, 4 characters a token)
``session``         a conversation or agent session (sent as ``x-session-id``)
``adapter``         a LoRA adapter (the engines run it as vLLM does: its own prefix cache,
                    ``--max-loras`` adapters a batch; epp sees it as the request's model)
``api``             the API: ``completions`` (the default for a ``prompt``), ``chat`` (the
                    default for ``messages``; a ``prompt`` that is a flattened chat: its
                    reply is cached with it, as a conversation's next turn needs) or
                    ``messages`` (Anthropic Messages); ``epp-sim load`` sends the row to it
``model``           informational (the replay serves one base model)
``tenant``          the flow-control fairness id; ``priority``: its priority (an integer)
``id``              the row's name, for ``after``
``after``           closed loop: the ``id`` of an earlier row (or a list of them; CSV:
                    space-separated); this request is sent ``delay_s`` seconds (0 by default)
                    after the last of their answers ends in the replay, not at its own
                    timestamp (a conversation's next turn, a client with a fixed number of
                    requests in flight, an agent waiting for its sub-agents)
==================  ========================================================================

Exactly one of ``prompt``, ``messages``, ``prompt_token_ids`` and ``hash_ids``. A bad row
is an error naming its line, or with ``skip_bad_rows`` left out and listed in ``skipped``.
:func:`write_request_log` writes any workload (a generator's) in this format, so a
generated workload can be kept, shared and replayed again; :mod:`simulator.replay.convert`
turns other logs into it.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from epp.errors import BadRequest
from epp.framework.request import ApiKind
from epp.request.apis import BUILTIN
from simulator.forms import PATHS
from simulator.model.tokens import CHARS_PER_TOKEN, token_ids_text
from simulator.replay.workload import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    json_lines,
    mooncake_block_text,
    open_text,
    plain_suffix,
    read_rows,
)

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "hash_ids")
CONVERTED = ("mooncake", "azure", "burstgpt", "stack")
"""The formats ``epp-sim trace convert`` reads (``simulator.replay.convert.FORMATS``)."""


@dataclass(slots=True, frozen=True)
class _Row:
    at: float | datetime
    request: TraceRequest
    row_id: str = ""
    after: tuple[str, ...] = ()


def _int(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, str):
        value = value.strip()
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number


def _ints(value: Any, name: str) -> list[int]:
    if isinstance(value, str):
        value = value.split()
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of integers")
    return [_int(v, f"{name}[{i}]") for i, v in enumerate(value)]


def _time(value: Any) -> float | datetime:
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"timestamp {value!r} is neither seconds nor an ISO 8601 time") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"timestamp {value!r} is not a number of seconds")
    return float(value)


_APIS = {"completions": ApiKind.COMPLETIONS, "chat": ApiKind.CHAT, "messages": ApiKind.MESSAGES}
_BODY_FIELDS = {ApiKind.CHAT: ("messages", "tools"), ApiKind.MESSAGES: ("messages", "system", "tools")}


def _api(obj: Mapping[str, Any], default: str) -> ApiKind:
    declared = obj.get("api") or default
    if declared not in _APIS:
        raise ValueError(f"api must be one of {', '.join(_APIS)}, got {declared!r}")
    return _APIS[declared]


def _prompt_of(obj: Mapping[str, Any]) -> tuple[str, int, ApiKind, tuple[int, ...], bool, dict[str, Any] | None]:
    """The row's prompt text, its tokens, API, block ids, whether it is real text, and the
    request fields to send as recorded (``messages`` rows)."""
    given = [f for f in PROMPT_FIELDS if obj.get(f) not in (None, "")]
    if len(given) != 1:
        raise ValueError(f"a row has exactly one of {', '.join(PROMPT_FIELDS)}; this one has "
                         f"{', '.join(given) or 'none'}")  # fmt: skip
    kind = given[0]
    api = ApiKind.COMPLETIONS
    hash_ids: tuple[int, ...] = ()
    has_text = True
    body: dict[str, Any] | None = None
    if kind == "prompt":
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        api = _api(obj, "completions")
    elif kind == "messages":
        api = _api(obj, "chat")
        if api is ApiKind.COMPLETIONS:
            raise ValueError("messages rows are chat or messages (Anthropic), not completions")
        body = {f: obj[f] for f in _BODY_FIELDS[api] if obj.get(f) is not None}
        try:  # keyed as epp keys it: names what is wrong with the messages, as epp would
            prompt = BUILTIN[PATHS[api]].prompt(body)
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
    elif kind == "prompt_token_ids":
        prompt = token_ids_text(_ints(obj["prompt_token_ids"], "prompt_token_ids"))
        has_text = False
    else:
        hash_ids = tuple(_ints(obj["hash_ids"], "hash_ids"))
        if "input_length" not in obj:
            raise ValueError("hash_ids need input_length")
        block = _int(obj.get("block_tokens") or MOONCAKE_BLOCK_TOKENS, "block_tokens", 1)
        if block != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens {block}: the replay reads {MOONCAKE_BLOCK_TOKENS}-token blocks")
        has_text = False
        prompt = ""
    if kind == "hash_ids":
        tokens = _int(obj["input_length"], "input_length", 1)
        chars = tokens * CHARS_PER_TOKEN
        need = -(-chars // (MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN))
        prompt = "".join(mooncake_block_text(b) for b in hash_ids[:need])[:chars]
    elif obj.get("input_length") not in (None, ""):
        tokens = _int(obj["input_length"], "input_length", 1)
    else:
        tokens = max(1, -(-len(prompt) // CHARS_PER_TOKEN))
    if not prompt:
        raise ValueError("the prompt is empty")

    return prompt, tokens, api, hash_ids, has_text, body


def _names(value: Any) -> tuple[str, ...]:
    """``after``: an id, a list of ids, or ids separated by spaces."""
    if value in (None, ""):
        return ()
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"after must be an id or a list of ids, got {value!r}")
    if len(items) > 1024:
        raise ValueError(f"after names {len(items)} rows; at most 1024")
    return tuple(str(v)[:256] for v in items)


def parse_row(obj: Any, index: int) -> _Row:
    """One row, checked; the reasons name the field."""
    if not isinstance(obj, Mapping):
        raise TypeError("a row is a JSON object")
    if "timestamp" not in obj or obj["timestamp"] in ("", None):
        raise ValueError("no timestamp; another trace format converts to a request log with "
                         "epp-sim trace convert --from " + "|".join(CONVERTED))
    at = _time(obj["timestamp"])
    if "output_length" not in obj:
        raise ValueError("no output_length")
    output = _int(obj["output_length"], "output_length")
    prompt, tokens, api, hash_ids, has_text, body = _prompt_of(obj)

    def text(name: str) -> str:
        value = obj.get(name)
        if value is None:
            return ""
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise ValueError(f"{name} must be a string")
        return str(value)[:256]

    priority = _int(obj["priority"], "priority", -(1 << 31)) if obj.get("priority") not in (None, "") else 0
    after = _names(obj.get("after"))
    delay = 0.0
    if obj.get("delay_s") not in (None, ""):
        if not after:
            raise ValueError("delay_s needs after")
        try:
            delay = float(obj["delay_s"])
        except (TypeError, ValueError):
            raise ValueError(f"delay_s must be a number of seconds, got {obj['delay_s']!r}") from None
        if not 0 <= delay < math.inf:
            raise ValueError(f"delay_s must be >= 0 and finite, got {delay}")
    request = TraceRequest(
        request_id=f"r{index}", arrival_s=0.0, prompt_tokens=tokens, output_tokens=max(1, output),
        prompt=prompt, hash_ids=hash_ids, session_id=text("session"), api=api, has_text=has_text,
        tenant=text("tenant"), priority=priority, adapter=text("adapter"), delay_s=delay, body=body,
    )  # fmt: skip
    return _Row(at, request, text("id"), after)


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line, row or why it is not one) for each row of a JSONL or CSV file."""
    with open_text(path, newline="") as f:
        if plain_suffix(path) == ".csv":
            reader = csv.DictReader(f)
            for row in reader:
                yield reader.line_num, row
            return
        yield from json_lines(f)


class RequestLog:
    """A request log (module docstring) as a replay workload; ``time_scale`` multiplies every
    arrival time (0.5 replays it twice as fast)."""

    def __init__(self, requests: Sequence[TraceRequest], time_scale: float = 1.0,
                 name: str = "requests", skipped: Sequence[str] = ()) -> None:  # fmt: skip
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.items = list(requests)
        self.time_scale = time_scale
        self.name = name
        self.skipped = list(skipped)

    @classmethod
    def load(cls, path: str | Path, time_scale: float = 1.0, limit: int = 0,
             skip_bad_rows: bool = False, source: Iterable[tuple[int, Any]] | None = None) -> RequestLog:  # fmt: skip
        """Read ``path``; ``source`` (line, row) stands for the file's own rows when given
        (another format's, converted by ``simulator.replay.convert``)."""
        path = Path(path)
        raw = _rows(path) if source is None else source
        rows, skipped = read_rows(path, raw, parse_row, "a request-log row", "request rows",
                                  limit, skip_bad_rows)  # fmt: skip
        kinds = {type(r.at) for r in rows}
        if len(kinds) > 1:
            raise ValueError(f"{path}: timestamps mix seconds and ISO 8601 times")
        if kinds == {datetime}:
            aware = {r.at.tzinfo is not None for r in rows if isinstance(r.at, datetime)}
            if len(aware) > 1:
                raise ValueError(f"{path}: timestamps mix times with and without a time zone")
            first_dt = min(r.at for r in rows if isinstance(r.at, datetime))
            seconds = [(r.at - first_dt).total_seconds() for r in rows if isinstance(r.at, datetime)]
        else:
            first = min(float(r.at) for r in rows if isinstance(r.at, float))
            seconds = [float(r.at) - first for r in rows if isinstance(r.at, float)]
        order = sorted(range(len(rows)), key=lambda i: seconds[i])
        names: dict[str, str] = {}
        requests = []
        for n, i in enumerate(order):
            row = rows[i]
            for name in row.after:
                if name not in names:
                    raise ValueError(f"{path}: the row with timestamp {seconds[i]:g} s comes after "
                                     f"{name!r}, which names no earlier row's id")  # fmt: skip
            after = tuple(names[name] for name in row.after)
            if row.row_id:
                if row.row_id in names:
                    raise ValueError(f"{path}: two rows have the id {row.row_id!r}")
                names[row.row_id] = f"r{n}"
            requests.append(replace(row.request, request_id=f"r{n}", arrival_s=seconds[i], after=after))
        return cls(requests, time_scale, name=path.stem, skipped=skipped)

    @property
    def closed_loop(self) -> bool:
        """Whether some rows wait for others' answers (``after``)."""
        return any(r.after for r in self.items)

    def with_time_scale(self, time_scale: float) -> RequestLog:
        return RequestLog(self.items, time_scale, self.name, self.skipped)

    def natural_rate(self) -> float:
        span = self.items[-1].arrival_s if self.items else 0.0
        return len(self.items) / span if span > 0 else float(len(self.items))

    def __len__(self) -> int:
        return len(self.items)

    def requests(self) -> Iterator[TraceRequest]:
        scale = self.time_scale
        for r in self.items:
            yield r if scale == 1.0 else replace(r, arrival_s=r.arrival_s * scale, delay_s=r.delay_s * scale)


def request_row(r: TraceRequest) -> dict[str, Any]:
    """One request as a request-log row (JSONL)."""
    row: dict[str, Any] = {"timestamp": r.arrival_s}
    if r.hash_ids:
        row |= {"hash_ids": list(r.hash_ids), "input_length": r.prompt_tokens,
                "block_tokens": MOONCAKE_BLOCK_TOKENS}
    elif r.body is not None:
        row |= dict(r.body)
        row["input_length"] = r.prompt_tokens
    else:
        row["prompt"] = r.prompt
        row["input_length"] = r.prompt_tokens
    row["output_length"] = r.output_tokens
    for key, value in (("session", r.session_id), ("adapter", r.adapter), ("tenant", r.tenant)):
        if value:
            row[key] = value
    if r.priority:
        row["priority"] = r.priority
    if r.api is not ApiKind.COMPLETIONS:
        row["api"] = {ApiKind.CHAT: "chat", ApiKind.MESSAGES: "messages"}.get(r.api, "completions")
    if r.after:
        row |= {"after": r.after[0] if len(r.after) == 1 else list(r.after), "delay_s": r.delay_s}
    return row


def write_request_log(requests: Iterable[TraceRequest], path: str | Path) -> int:
    """Write ``requests`` as a JSONL request log; returns how many rows. Each row carries
    its request id as ``id``, which later rows' ``after`` may name."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"id": r.request_id} | request_row(r), ensure_ascii=False) + "\n")
            n += 1
    return n
