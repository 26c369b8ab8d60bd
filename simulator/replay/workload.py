"""Workloads: the Mooncake trace format and three generators, as one request type.

Every workload yields :class:`TraceRequest` values in arrival order. A request carries its
prompt as text (``prompt``), because epp hashes characters as it does in production; the
engine's KV blocks are named either from the trace's own block ids (Mooncake) or from the
text (generators), see :func:`engine_block_hashes`.

Text is deterministic and cheap: :func:`random_text` draws bytes from a ``random.Random``
seeded with a key and base64-encodes them (4 characters per 3 bytes, all ASCII). A Mooncake
block id becomes 2,048 characters (512 tokens at 4 characters a token) derived only from the
id (:func:`mooncake_block_text`), so two requests that share their first k block ids share their first
``2048 * k`` characters, and the last block is cut to the prompt's length.

Generators (Poisson arrivals at ``rate`` requests/s, lengths in tokens):

* ``shared-prefix``: inference-perf's ``shared_prefix`` data: ``num_groups`` system prompts
  of ``system_prompt_len`` tokens, ``num_prompts_per_group`` questions of ``question_len``
  tokens per group, ``output_len`` output tokens; the prompts are sent in random order.
* ``chat``: ``num_sessions`` concurrent conversations over ``num_system_prompts`` shared
  system prompts; each arrival is the next turn of a session drawn at random, whose prompt
  is the whole conversation so far (flattened as epp flattens chat messages) plus a new
  question. Arrivals are open-loop: a turn may arrive before the previous answer ends.
* ``rag``: a pool of ``num_docs`` document chunks of ``doc_len`` tokens with Zipf
  popularity (exponent ``zipf_s``); a query is an instruction preamble, ``docs_per_query``
  chunks drawn by popularity, then a question.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

import xxhash

from epp.framework.request import ApiKind
from simulator.model.cache import model_seed, text_block_hashes
from simulator.model.tokens import CHARS_PER_TOKEN, generate_text

T = TypeVar("T")
MAX_ROW_CHARS = 64 << 20
"""A trace line longer than this is refused (a row is one request)."""
MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_BLOCK_CHARS = MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN
DEFAULT_TRACE = Path("..") / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
"""The Mooncake synthetic trace, relative to the repository root (never copied into it)."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt: str
    hash_ids: tuple[int, ...] = ()
    """Mooncake block ids (512 tokens each); empty for generated workloads."""
    session_id: str = ""
    api: ApiKind = ApiKind.COMPLETIONS
    has_text: bool = True
    """Whether the workload has real text, so a reply can be generated and fed back."""
    tenant: str = ""
    """The fairness id (flow control's flow); '' = the model."""
    priority: int = 0
    adapter: str = ""
    """A LoRA adapter ('' = the base model): its own prefix cache on the engines, and the
    request's model as epp sees it."""
    after: tuple[str, ...] = ()
    """Closed loop: the ``request_id`` of earlier requests; this one is sent ``delay_s`` after
    the last of their answers ends (or they were refused), not at ``arrival_s``."""
    delay_s: float = 0.0
    body: Mapping[str, Any] | None = field(default=None, compare=False)
    """The request's API fields as a client sent them (a request log's ``messages``, with
    ``system`` and ``tools``), which ``epp-sim load`` sends as recorded; None: the prompt
    text alone (``simulator.forms`` writes it in an API's form)."""


class Workload(Protocol):
    name: str

    def requests(self) -> Iterator[TraceRequest]:
        """A fresh pass over the requests, in arrival order."""
        ...

    def __len__(self) -> int: ...


def random_text(key: int, chars: int) -> str:
    """``chars`` deterministic ASCII characters derived only from ``key``."""
    raw = random.Random(key).randbytes(-(-chars * 3 // 4))
    return base64.b64encode(raw).decode("ascii")[:chars]


_POOL_CHARS = 1 << 22
_pool: list[str] = []


def mooncake_block_text(block_id: int) -> str:
    """The 2,048 characters of one Mooncake block, derived only from its id.

    A slice of a fixed 4 MiB pool of random text at an offset hashed from the id (~0.3 us,
    against ~16 us to draw fresh bytes; the replay touches 120k blocks per policy). Distinct
    ids that follow the same prefix collide only if their offsets are equal (p ~ 5e-7).
    """
    if not _pool:
        _pool.append(random_text(0x6D6F6F6E, _POOL_CHARS))
    off = xxhash.xxh3_64_intdigest(block_id.to_bytes(8, "little", signed=True)) % (
        _POOL_CHARS - MOONCAKE_BLOCK_CHARS
    )
    return _pool[0][off : off + MOONCAKE_BLOCK_CHARS]


def engine_block_hashes(request: TraceRequest, block_size_tokens: int, seed: int) -> list[int]:
    """Names of the prompt's full KV blocks of ``block_size_tokens`` tokens.

    Mooncake ids are prefix-unique (the trace chains them), so sub-block ``j`` of block id
    ``b`` is named ``b * per + j`` and passed to the cache as is; generated text is hashed
    with the emulator's :func:`text_block_hashes`, as the live emulator does.
    """
    if request.adapter:  # vLLM keys an adapter's blocks apart from the base model's
        seed = model_seed(request.adapter)
    if request.hash_ids:
        per = MOONCAKE_BLOCK_TOKENS // block_size_tokens
        n_full = request.prompt_tokens // block_size_tokens
        out: list[int] = []
        for b in request.hash_ids:
            out.extend(range(b * per, b * per + per))
            if len(out) >= n_full:
                break
        del out[n_full:]
        return [h ^ seed for h in out] if request.adapter else out
    return text_block_hashes(request.prompt, block_size_tokens, seed)


def reply_text(request: TraceRequest) -> str:
    """The deterministic answer the emulated server gives (empty for text-less traces)."""
    if not request.has_text:
        return ""
    return generate_text(request.prompt, request.output_tokens)


def final_block_hashes(
    request: TraceRequest, reply: str, block_size_tokens: int, seed: int
) -> list[int] | None:
    """The blocks a replica keeps cached once a chat request's reply ends (its prompt, the
    assistant marker and ``reply``), which the conversation's next turn starts with; None
    where the cache keeps only the prompt's blocks.

    Only blocks whose KV was computed stay: the prompt's and the reply's but its last token,
    which was sampled and never fed back (vLLM caches the full blocks of a request's computed
    tokens). The marker stands for the chat template's assistant header, which a real
    server's prompt already ends with, so it adds no computed token: a 1,288-token prompt
    with a 24-token reply leaves 40 blocks of 32 cached, as real vLLM's next turn finds
    (the joint-8 session, docs/research/findings.md)."""
    if not request.api.conversational or not reply:
        return None
    if request.adapter:
        seed = model_seed(request.adapter)
    computed = (len(request.prompt) + len(reply) - CHARS_PER_TOKEN) // (block_size_tokens * CHARS_PER_TOKEN)
    return text_block_hashes(request.prompt + "<|assistant|>" + reply, block_size_tokens, seed)[:computed]


# --- Mooncake ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _MooncakeRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _mooncake_row(obj: Any) -> _MooncakeRow:
    """One trace row, checked: a finite timestamp >= 0, a prompt of at least one token, an
    output of zero or more, block ids >= 0 (the reasons name the field)."""
    if not isinstance(obj, dict):
        raise TypeError(f"a row is a JSON object, got {type(obj).__name__}")
    timestamp = float(obj["timestamp"])
    if not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"timestamp {obj['timestamp']!r} is not a time >= 0 (ms)")
    input_length, output_length = int(obj["input_length"]), int(obj["output_length"])
    if input_length < 1:
        raise ValueError(f"input_length {input_length} is below 1")
    if output_length < 0:
        raise ValueError(f"output_length {output_length} is negative")
    hash_ids = tuple(int(h) for h in obj["hash_ids"])
    if any(h < 0 for h in hash_ids):
        raise ValueError("hash_ids holds a negative block id")
    return _MooncakeRow(timestamp, input_length, output_length, hash_ids)


def open_text(path: str | Path, newline: str | None = None) -> TextIO:
    """A trace or request log opened to read as text; a ``.gz`` one through gzip, as the
    live runs a session keeps gzipped are."""
    if str(path).lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline=newline)
    return open(path, encoding="utf-8", newline=newline)


def plain_suffix(path: str | Path) -> str:
    """The file's type suffix, lower case, under a ``.gz``: ``.csv`` for ``log.csv.gz``."""
    return Path(str(path).removesuffix(".gz").removesuffix(".GZ")).suffix.lower()


def json_lines(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """(line number, the line's JSON value, or why it is none) for each non-blank line; a
    line over ``MAX_ROW_CHARS`` is refused unread (a row is one request)."""
    for lineno, line in enumerate(lines, 1):
        if len(line) > MAX_ROW_CHARS:
            yield lineno, ValueError(f"a line of over {MAX_ROW_CHARS} characters")
        elif line.strip():
            try:
                yield lineno, json.loads(line.strip())
            except ValueError as exc:
                yield lineno, ValueError(f"not JSON ({exc})")


def read_rows(path: str | Path, raw: Iterable[tuple[int, Any]], parse: Callable[[Any, int], T],
              what: str, plural: str, limit: int = 0, skip_bad_rows: bool = False) -> tuple[list[T], list[str]]:  # fmt: skip
    """A trace's rows, each ``(line, value)`` of ``raw`` through ``parse(value, index)`` (a
    value that is an exception is a bad row). A bad row raises ValueError naming its line and
    ``--skip-bad-rows``, or with ``skip_bad_rows`` is left out and described in the second list;
    no good row at all is an error."""
    rows: list[T] = []
    skipped: list[str] = []
    for lineno, value in raw:
        try:
            if isinstance(value, Exception):
                raise value
            rows.append(parse(value, len(rows)))
        except (ValueError, KeyError, TypeError) as exc:
            why = f"{path}:{lineno}: not {what} ({exc})"
            if not skip_bad_rows:
                raise ValueError(why + "; --skip-bad-rows leaves such rows out") from None
            skipped.append(why)
            continue
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"{path}: no {plural}"
                         + (f" ({len(skipped)} bad, the first: {skipped[0]})" if skipped else ""))
    return rows, skipped


class MooncakeTrace:
    """A Mooncake-format JSONL trace; ``time_scale`` multiplies every arrival time
    (0.5 replays it twice as fast)."""

    def __init__(self, rows: Sequence[_MooncakeRow], time_scale: float = 1.0, name: str = "mooncake",
                 skipped: Sequence[str] = ()):  # fmt: skip
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.rows = list(rows)
        self.time_scale = time_scale
        self.name = name
        self.skipped = list(skipped)
        """With ``skip_bad_rows``: why each skipped line was skipped (``path:line: reason``)."""

    @classmethod
    def load(cls, path: str | Path, time_scale: float = 1.0, limit: int = 0,
             skip_bad_rows: bool = False) -> MooncakeTrace:  # fmt: skip
        """Read a trace; a bad row raises ValueError naming its line, or with
        ``skip_bad_rows`` is left out and listed in ``skipped``."""
        with open_text(path) as f:
            rows, skipped = read_rows(path, json_lines(f), lambda obj, _i: _mooncake_row(obj),
                                      "a Mooncake trace row", "trace rows", limit, skip_bad_rows)  # fmt: skip
        rows.sort(key=lambda r: r.timestamp_ms)
        return cls(rows, time_scale, name=Path(path).stem, skipped=skipped)

    def with_time_scale(self, time_scale: float) -> MooncakeTrace:
        return MooncakeTrace(self.rows, time_scale, self.name, self.skipped)

    @property
    def duration_s(self) -> float:
        return (self.rows[-1].timestamp_ms / 1000.0) * self.time_scale if self.rows else 0.0

    def natural_rate(self) -> float:
        """Requests per second at ``time_scale`` 1."""
        span = self.rows[-1].timestamp_ms / 1000.0 if self.rows else 0.0
        return len(self.rows) / span if span > 0 else float(len(self.rows))

    def __len__(self) -> int:
        return len(self.rows)

    def requests(self) -> Iterator[TraceRequest]:
        scale = self.time_scale / 1000.0
        text = mooncake_block_text
        for i, r in enumerate(self.rows):
            chars = r.input_length * CHARS_PER_TOKEN
            need = -(-chars // MOONCAKE_BLOCK_CHARS)
            prompt = "".join([text(b) for b in r.hash_ids[:need]])[:chars]
            yield TraceRequest(
                request_id=f"r{i}",
                arrival_s=r.timestamp_ms * scale,
                prompt_tokens=max(1, r.input_length),
                output_tokens=max(1, r.output_length),
                prompt=prompt,
                hash_ids=r.hash_ids,
                has_text=False,
            )


# --- generators -------------------------------------------------------------------------


def _poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    t = 0.0
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _chars(tokens: int) -> int:
    return tokens * CHARS_PER_TOKEN


@dataclass(slots=True, frozen=True)
class SharedPrefixParams:
    num_groups: int = 16
    num_prompts_per_group: int = 32
    system_prompt_len: int = 2048
    question_len: int = 256
    output_len: int = 128
    rate: float = 8.0
    seed: int = 0


@dataclass(slots=True, frozen=True)
class ChatParams:
    num_sessions: int = 64
    turns_per_session: int = 6
    num_system_prompts: int = 8
    system_prompt_len: int = 1024
    question_len: int = 128
    output_len: int = 192
    rate: float = 8.0
    seed: int = 0


@dataclass(slots=True, frozen=True)
class RagParams:
    num_requests: int = 512
    num_docs: int = 256
    doc_len: int = 1024
    docs_per_query: int = 3
    zipf_s: float = 1.1
    preamble_len: int = 128
    question_len: int = 64
    output_len: int = 128
    rate: float = 8.0
    seed: int = 0


class SharedPrefixWorkload:
    name = "shared-prefix"

    def __init__(self, p: SharedPrefixParams):
        self.p = p

    def __len__(self) -> int:
        return self.p.num_groups * self.p.num_prompts_per_group

    def requests(self) -> Iterator[TraceRequest]:
        p = self.p
        rng = random.Random(p.seed)
        pairs = [(g, q) for g in range(p.num_groups) for q in range(p.num_prompts_per_group)]
        rng.shuffle(pairs)
        times = _poisson_times(rng, p.rate, len(pairs))
        systems: dict[int, str] = {}
        for i, ((g, q), t) in enumerate(zip(pairs, times, strict=True)):
            system = systems.get(g)
            if system is None:
                system = systems[g] = random_text(p.seed << 40 | 1 << 32 | g, _chars(p.system_prompt_len))
            question = random_text(p.seed << 40 | 2 << 32 | g << 16 | q, _chars(p.question_len))
            yield TraceRequest(
                request_id=f"r{i}",
                arrival_s=t,
                prompt_tokens=p.system_prompt_len + p.question_len,
                output_tokens=p.output_len,
                prompt=system + question,
                session_id=f"g{g}",
            )


class ChatWorkload:
    name = "chat"

    def __init__(self, p: ChatParams):
        self.p = p

    def __len__(self) -> int:
        return self.p.num_sessions * self.p.turns_per_session

    def requests(self) -> Iterator[TraceRequest]:
        p = self.p
        rng = random.Random(p.seed)
        systems = [
            "<|system|>" + random_text(p.seed << 40 | 3 << 32 | k, _chars(p.system_prompt_len))
            for k in range(p.num_system_prompts)
        ]
        history = [systems[s % p.num_system_prompts] for s in range(p.num_sessions)]
        turns_left = [p.turns_per_session] * p.num_sessions
        live = list(range(p.num_sessions))
        times = _poisson_times(rng, p.rate, len(self))
        for i, t in enumerate(times):
            s = live[rng.randrange(len(live))]
            turn = p.turns_per_session - turns_left[s]
            question = random_text(p.seed << 40 | 4 << 32 | s << 16 | turn, _chars(p.question_len))
            prompt = history[s] + "<|user|>" + question
            request = TraceRequest(
                request_id=f"r{i}",
                arrival_s=t,
                prompt_tokens=-(-len(prompt) // CHARS_PER_TOKEN),
                output_tokens=p.output_len,
                prompt=prompt,
                session_id=f"s{s}",
                api=ApiKind.CHAT,
            )
            yield request
            history[s] = prompt + "<|assistant|>" + reply_text(request)
            turns_left[s] -= 1
            if not turns_left[s]:
                live.remove(s)


class RagWorkload:
    name = "rag"

    def __init__(self, p: RagParams):
        self.p = p

    def __len__(self) -> int:
        return self.p.num_requests

    def requests(self) -> Iterator[TraceRequest]:
        p = self.p
        rng = random.Random(p.seed)
        weights = [1.0 / (k + 1) ** p.zipf_s for k in range(p.num_docs)]
        preamble = random_text(p.seed << 40 | 5 << 32, _chars(p.preamble_len))
        docs: dict[int, str] = {}
        times = _poisson_times(rng, p.rate, p.num_requests)
        k = min(p.docs_per_query, p.num_docs)
        for i, t in enumerate(times):
            chosen: list[int] = []
            while len(chosen) < k:
                d = rng.choices(range(p.num_docs), weights)[0]
                if d not in chosen:
                    chosen.append(d)
            parts = [preamble]
            for d in chosen:
                text = docs.get(d)
                if text is None:
                    text = docs[d] = random_text(p.seed << 40 | 6 << 32 | d, _chars(p.doc_len))
                parts.append(text)
            parts.append(random_text(p.seed << 40 | 7 << 32 | i, _chars(p.question_len)))
            yield TraceRequest(
                request_id=f"r{i}",
                arrival_s=t,
                prompt_tokens=p.preamble_len + k * p.doc_len + p.question_len,
                output_tokens=p.output_len,
                prompt="".join(parts),
            )


@dataclass(slots=True, frozen=True)
class TenantsParams:
    """Two tenants on one pool: a steady quiet one and a bursty noisy neighbour."""

    duration_s: float = 120.0
    rate: float = 3.0
    """The quiet tenant's requests per second (Poisson)."""
    quiet_prompt_len: int = 512
    quiet_output_len: int = 64
    burst_every_s: float = 30.0
    burst_requests: int = 240
    """The noisy tenant sends this many requests at each burst, spread over ``burst_s``."""
    burst_s: float = 2.0
    noisy_prompt_len: int = 2048
    noisy_output_len: int = 256
    seed: int = 0


class TenantsWorkload:
    """``quiet`` sends a steady Poisson stream of short requests; ``noisy`` sends large
    bursts of long ones. Each tenant has its own system prompt (prefix reuse inside a tenant)."""

    name = "tenants"

    def __init__(self, p: TenantsParams):
        self.p = p

    def _bursts(self) -> list[float]:
        p = self.p
        return [p.burst_every_s / 2 + k * p.burst_every_s
                for k in range(int((p.duration_s - p.burst_every_s / 2) // p.burst_every_s) + 1)
                if p.burst_every_s / 2 + k * p.burst_every_s < p.duration_s]  # fmt: skip

    def __len__(self) -> int:
        return sum(1 for _ in self.requests())

    def requests(self) -> Iterator[TraceRequest]:
        p = self.p
        rng = random.Random(p.seed)
        arrivals: list[tuple[float, str]] = []
        t = 0.0
        while p.rate > 0:
            t += rng.expovariate(p.rate)
            if t >= p.duration_s:
                break
            arrivals.append((t, "quiet"))
        for start in self._bursts():
            for _ in range(p.burst_requests):
                arrivals.append((start + rng.random() * p.burst_s, "noisy"))
        arrivals.sort()
        system = {tenant: random_text(p.seed << 40 | 8 << 32 | k, _chars(length // 2))
                  for k, (tenant, length) in enumerate((("quiet", p.quiet_prompt_len),
                                                        ("noisy", p.noisy_prompt_len)))}  # fmt: skip
        for i, (t, tenant) in enumerate(arrivals):
            quiet = tenant == "quiet"
            length = p.quiet_prompt_len if quiet else p.noisy_prompt_len
            prompt = system[tenant] + random_text(p.seed << 40 | 9 << 32 | i, _chars(length - length // 2))
            yield TraceRequest(
                request_id=f"r{i}", arrival_s=t, prompt_tokens=length,
                output_tokens=p.quiet_output_len if quiet else p.noisy_output_len,
                prompt=prompt, tenant=tenant,
            )  # fmt: skip


@dataclass(slots=True, frozen=True)
class AgenticParams:
    """Agent sessions: a long system prompt (tool schemas), then turns whose context grows by
    the model's reply and the tool's output each time, until ``max_context`` tokens; now and
    then a turn fans out into parallel sub-agents that share the parent's context."""

    num_sessions: int = 32
    rate: float = 0.25
    """Sessions started per second (Poisson)."""
    min_turns: int = 10
    max_turns: int = 60
    """A session's turns, uniform in [min_turns, max_turns] (fewer if max_context ends it)."""
    num_system_prompts: int = 4
    system_prompt_len: int = 4096
    tool_output_len: int = 1500
    """Mean tokens a tool's output adds (uniform between 0.2x and 1.8x)."""
    output_len: int = 200
    """The model's reply (a tool call) per turn."""
    turn_gap_s: float = 5.0
    """Mean seconds between an agent's consecutive calls (exponential): its reply being
    generated and the tool running (``closed_loop``: the tool running, after the reply)."""
    closed_loop: bool = False
    """Each call waits for the answer it follows, as agents run: a turn for the agent's last
    answer, then its tool's time (``turn_gap_s``); a sub-agent for the turn that launched it;
    the parent for all its sub-agents. False: the calls come at the planned times whatever
    the answers, open loop, as a recorded trace replays."""
    subagent_share: float = 0.08
    """Chance that a turn fans out into sub-agents before the session goes on."""
    subagents: int = 3
    subagent_turns: int = 4
    task_len: int = 200
    """The task a sub-agent gets after its parent's context."""
    max_context: int = 100_000
    seed: int = 0


@dataclass(slots=True)
class _AgentTurn:
    arrival_s: float
    agent: str
    parent: str
    """The agent whose context a sub-agent's first turn starts from ('' otherwise)."""
    first: bool
    last: bool
    tool_tokens: int
    waits: list[_AgentTurn] = field(default_factory=list)
    """Closed loop: the turns whose answers this one waits for."""
    delay_s: float = 0.0
    """Closed loop: seconds after the last of those answers."""


class AgenticWorkload:
    """Requests of agent sessions (:class:`AgenticParams`), in arrival order. Session ``s3``
    has agent ``s3``; its sub-agents are ``s3.1``, ``s3.2``...: each request's
    ``session_id`` is its agent (what a client sends as its session header)."""

    name = "agentic"

    def __init__(self, p: AgenticParams):
        if p.min_turns < 1 or p.max_turns < p.min_turns:
            raise ValueError("workload 'agentic': need 1 <= min_turns <= max_turns")
        self.p = p

    def _plan(self) -> list[_AgentTurn]:
        p = self.p
        rng = random.Random(p.seed)
        turns: list[_AgentTurn] = []
        start = 0.0
        for s in range(p.num_sessions):
            start += rng.expovariate(p.rate)
            t = start
            context = p.system_prompt_len
            n = rng.randint(p.min_turns, p.max_turns)
            agent = f"s{s}"
            forks = 0
            own: list[_AgentTurn] = []
            waits: list[_AgentTurn] = []
            gap = 0.0
            for k in range(n):
                tool = int(p.tool_output_len * rng.uniform(0.2, 1.8)) if k else 0
                if context + tool + p.output_len > p.max_context:
                    break
                turn = _AgentTurn(t, agent, "", k == 0, False, tool, waits, gap)
                own.append(turn)
                context += tool + p.output_len
                gap = rng.expovariate(1.0 / p.turn_gap_s)
                t += gap
                waits = [turn]
                if k and p.subagents and rng.random() < p.subagent_share:
                    forks += 1
                    end = t
                    lasts = []
                    for j in range(p.subagents):
                        sub = f"{agent}.{forks}.{j}"
                        launch = rng.random() * 0.2  # launched together
                        ts = t + launch
                        sub_waits, sub_delay = [turn], gap + launch
                        for m in range(p.subagent_turns):
                            tool_s = int(p.tool_output_len * rng.uniform(0.2, 1.8)) if m else 0
                            sub_turn = _AgentTurn(ts, sub, agent if m == 0 else "", m == 0, m == p.subagent_turns - 1,
                                                  tool_s, sub_waits, sub_delay)  # fmt: skip
                            own.append(sub_turn)
                            sub_delay = rng.expovariate(1.0 / p.turn_gap_s)
                            ts += sub_delay
                            sub_waits = [sub_turn]
                        lasts.append(own[-1])
                        end = max(end, ts)
                    t = end  # the parent goes on when its sub-agents are done
                    waits, gap = lasts, 0.0
            if own:
                last = max(i for i, x in enumerate(own) if x.agent == agent)
                own[last].last = True
            turns.extend(own)
        turns.sort(key=lambda x: x.arrival_s)
        return turns

    def __len__(self) -> int:
        return len(self._plan())

    @property
    def closed_loop(self) -> bool:
        return self.p.closed_loop

    def requests(self) -> Iterator[TraceRequest]:
        p = self.p
        systems = ["<|system|>" + random_text(p.seed << 40 | 10 << 32 | k, _chars(p.system_prompt_len))
                   for k in range(p.num_system_prompts)]  # fmt: skip
        latest: dict[str, TraceRequest] = {}
        """Each agent's latest request (a main agent's stays: its sub-agents fork from it)."""
        plan = self._plan()
        index = {id(turn): i for i, turn in enumerate(plan)}
        for i, turn in enumerate(plan):
            agent = turn.agent
            key = p.seed << 40 | 11 << 32 | (i & 0xFFFFFFFF)
            task = "<|user|>" + random_text(key, _chars(p.task_len))
            if turn.first and turn.parent:  # a sub-agent: its parent's context, then a task
                parent = latest[turn.parent]
                base = parent.prompt + "<|assistant|>" + reply_text(parent) + task
            elif turn.first:
                session = int(agent[1:].split(".")[0])
                base = systems[session % p.num_system_prompts] + task
            else:
                prev = latest[agent]
                base = (prev.prompt + "<|assistant|>" + reply_text(prev)
                        + "<|tool|>" + random_text(key, _chars(turn.tool_tokens)))  # fmt: skip
            request = TraceRequest(
                request_id=f"r{i}",
                arrival_s=turn.arrival_s,
                prompt_tokens=-(-len(base) // CHARS_PER_TOKEN),
                output_tokens=p.output_len,
                prompt=base,
                session_id=agent,
                api=ApiKind.CHAT,
                after=tuple(f"r{index[id(w)]}" for w in turn.waits) if p.closed_loop else (),
                delay_s=turn.delay_s if p.closed_loop else 0.0,
            )
            yield request
            if turn.last and "." in agent:  # a finished sub-agent
                latest.pop(agent, None)
            else:
                latest[agent] = request


GENERATORS: dict[str, tuple[type, Any]] = {
    "shared-prefix": (SharedPrefixParams, SharedPrefixWorkload),
    "chat": (ChatParams, ChatWorkload),
    "rag": (RagParams, RagWorkload),
    "tenants": (TenantsParams, TenantsWorkload),
    "agentic": (AgenticParams, AgenticWorkload),
}


_INFERENCE_PERF_ALIASES = {
    "num_unique_system_prompts": "num_groups",
    "num_users_per_system_prompt": "num_prompts_per_group",
}
"""inference-perf's newer names for the shared_prefix counts."""
_INFERENCE_PERF_SECTIONS = ("api", "server", "tokenizer", "metrics", "report", "storage")
"""Sections of an inference-perf config the replay has no use for (it is the server)."""


def build_generator(name: str, params: dict[str, Any]) -> Workload:
    """A generator by name with parameters (unknown names raise ``ValueError`` naming them).

    ``params`` may also be an inference-perf config mapping: its ``data.shared_prefix``
    section and the first ``load.stages[].rate`` are read.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(GENERATORS)})")
    ptype, wtype = GENERATORS[name]
    flat = dict(params)
    data = flat.pop("data", None)
    load = flat.pop("load", None)
    known = {f.name: f for f in fields(ptype)}
    if isinstance(data, dict):
        for section_name in _INFERENCE_PERF_SECTIONS:
            flat.pop(section_name, None)
        section = dict(data.get(name.replace("-", "_")) or {})
        for alias, key in _INFERENCE_PERF_ALIASES.items():
            if alias in section:
                section.setdefault(key, section.pop(alias))
        # inference-perf fields the generator does not model (length distributions,
        # enable_multi_turn_chat: use --workload chat) are ignored, as the stack does
        flat = {**{k: v for k, v in section.items() if k in known}, **flat}
    if isinstance(load, dict) and load.get("stages") and "rate" not in flat:
        flat["rate"] = load["stages"][0].get("rate", ptype().rate)
    values: dict[str, Any] = {}
    for key, value in flat.items():
        f = known.get(key)
        if f is None:
            raise ValueError(
                f"workload {name!r} has no parameter {key!r} (known: {', '.join(known)})"
            )
        if f.type in ("bool", bool):
            values[key] = _flag(name, key, value)
        else:
            values[key] = _number(name, key, value, integer=f.type not in ("float", float))
    built = ptype(**values)
    for f in fields(ptype):
        v = getattr(built, f.name)
        if f.name == "rate" and v <= 0:
            raise ValueError(f"workload {name!r} parameter 'rate': must be > 0, got {v}")
        if f.name != "seed" and not isinstance(v, bool) and v < 0:
            raise ValueError(f"workload {name!r} parameter {f.name!r}: must be >= 0, got {v}")
    return wtype(built)  # type: ignore[no-any-return]


def _flag(workload: str, key: str, value: Any) -> bool:
    """A yes/no generator parameter: true/false (YAML), or 1/0, true/false from ``--set``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"workload {workload!r} parameter {key!r}: expected true or false, got {value!r}")


def _number(workload: str, key: str, value: Any, *, integer: bool) -> float | int:
    """A generator parameter from YAML or ``--set``: a number (an integer where counted)."""
    kind = "an integer" if integer else "a number"
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or math.isnan(number) or (integer and not number.is_integer()):
        raise ValueError(f"workload {workload!r} parameter {key!r}: expected {kind}, got {value!r}")
    return int(number) if integer else number


def scaled_rate(workload: Workload, rate: float) -> Workload:
    """The same workload at another arrival rate (a time scale for traces)."""
    rescale = getattr(workload, "with_time_scale", None)
    if rescale is not None:  # a trace: Mooncake or a request log
        return rescale(workload.natural_rate() / rate)  # type: ignore[attr-defined, no-any-return]
    p = workload.p  # type: ignore[attr-defined]
    return type(workload)(dataclasses.replace(p, rate=rate))  # type: ignore[call-arg]


__all__ = [
    "DEFAULT_TRACE",
    "AgenticParams",
    "AgenticWorkload",
    "ChatParams",
    "ChatWorkload",
    "MooncakeTrace",
    "RagParams",
    "RagWorkload",
    "SharedPrefixParams",
    "SharedPrefixWorkload",
    "TraceRequest",
    "Workload",
    "build_generator",
    "engine_block_hashes",
    "final_block_hashes",
    "reply_text",
    "scaled_rate",
]
