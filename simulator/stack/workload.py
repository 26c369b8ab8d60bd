"""The demo workload: shared system prompts, many users, multi-turn chat.

``num_groups`` system prompts, each shared by ``num_prompts_per_group`` users; every user
holds a conversation of ``num_turns`` turns, and each turn resends the whole history (system
prompt, earlier questions and the model's answers) plus a new question, as chat clients do.
Two kinds of prefix sharing follow: across users of a group (the system prompt) and across
turns of one user (the history). Lengths are in tokens (4 characters each, the emulator's
rule).

``load_inference_perf`` reads inference-perf's config format (``data.type: shared_prefix``,
``load.stages``, ``api.type``) so published recipes replay here: inference-perf's
``num_groups`` / ``num_prompts_per_group`` (or the newer ``num_unique_system_prompts`` /
``num_users_per_system_prompt``), ``system_prompt_len``, ``question_len``, ``output_len``,
``enable_multi_turn_chat``; the stages' ``rate`` x ``duration`` give an open-loop arrival
schedule, request ``k`` going to user ``k mod users`` as its turn ``k div users``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from simulator.model.tokens import CHARS_PER_TOKEN

_VOCAB = [
    "cache",
    "token",
    "prefix",
    "route",
    "model",
    "server",
    "replica",
    "batch",
    "prompt",
    "reply",
    "user",
    "system",
    "query",
    "answer",
    "metric",
    "gateway",
    "pool",
    "block",
    "index",
    "score",
    "load",
    "queue",
    "delay",
    "stream",
    "chunk",
    "event",
    "vector",
    "layer",
    "weight",
    "input",
    "output",
    "sample",
    "policy",
    "random",
    "budget",
    "limit",
    "window",
    "session",
]


class WorkloadError(ValueError):
    """A workload file is malformed; the message names the field."""


@dataclass(slots=True, frozen=True)
class SharedPrefixWorkload:
    num_groups: int = 16
    num_prompts_per_group: int = 6
    """Users per system prompt."""
    system_prompt_len: int = 2000
    question_len: int = 60
    output_len: int = 24
    num_turns: int = 4
    multi_turn: bool = True
    """False: every request is system prompt + one question (inference-perf's default)."""
    api: str = "chat"
    """``chat`` (/v1/chat/completions) or ``completion`` (/v1/completions)."""
    concurrency: int = 16
    """Closed loop: this many conversations run at once (used when ``rate`` is None)."""
    rate: float | None = None
    """Open loop (inference-perf stages): requests per second; see ``stages``."""
    stages: tuple[tuple[float, float], ...] = ()
    """(rate req/s, duration s) pairs of an open-loop schedule."""
    poisson: bool = False
    seed: int = 1
    bypass_share: float = 0.0
    """Share of requests sent straight to a random server, past the gateway and epp (another
    client or gateway that epp does not see). Seeded: every policy bypasses the same ones."""

    def __post_init__(self) -> None:
        for name in ("num_groups", "num_prompts_per_group", "num_turns", "concurrency"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"workload field {name!r} must be >= 1")
        if not 0.0 <= self.bypass_share <= 1.0:
            raise WorkloadError("workload field 'bypass_share' must be in [0, 1]")
        for name in ("system_prompt_len", "question_len", "output_len"):
            if getattr(self, name) < 0:
                raise WorkloadError(f"workload field {name!r} must be >= 0")
        if self.api not in ("chat", "completion"):
            raise WorkloadError(
                f"workload field 'api' must be chat or completion, not {self.api!r}"
            )

    @property
    def users(self) -> int:
        return self.num_groups * self.num_prompts_per_group

    @property
    def total_requests(self) -> int:
        if self.stages:
            return sum(round(r * d) for r, d in self.stages)
        return self.users * self.num_turns

    def scaled(self, factor: float) -> SharedPrefixWorkload:
        """The same shape with ``factor`` times the users (at least one per group)."""
        per_group = max(1, round(self.num_prompts_per_group * factor))
        return dataclasses.replace(self, num_prompts_per_group=per_group)

    def describe(self) -> str:
        load = (
            f"open loop {self.total_requests} requests over {sum(d for _, d in self.stages):g}s"
            if self.stages
            else f"{self.concurrency} conversations at a time"
        )
        return (
            f"{self.num_groups} system prompts x {self.num_prompts_per_group} users, "
            f"{self.num_turns} turns, {self.system_prompt_len}-token system prompt, "
            f"{self.question_len}-token questions, {self.output_len}-token answers, "
            f"{self.api} API, {load}"
        )


def _text(rng: random.Random, tokens: int, tag: str) -> str:
    """About ``tokens`` tokens of words, starting with ``tag`` so texts differ from byte 0."""
    return word_text(rng, tokens * CHARS_PER_TOKEN, tag)


def word_text(rng: random.Random, chars: int, tag: str = "") -> str:
    """``chars`` characters of English-like words (a tokenizer reads them as ~1 token a word),
    starting with ``tag``."""
    words = [tag] if tag else []
    length = len(tag)
    while length < chars:
        w = rng.choice(_VOCAB)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)[:chars]


@dataclass(slots=True, frozen=True)
class Texts:
    system_prompts: list[str]
    questions: list[list[str]]
    """questions[user][turn]"""


def make_texts(w: SharedPrefixWorkload, turns: int) -> Texts:
    rng = random.Random(w.seed)
    systems = [_text(rng, w.system_prompt_len, f"[system prompt {g}]") for g in range(w.num_groups)]
    questions = [
        [_text(rng, w.question_len, f"[user {u} turn {t}]") for t in range(turns)]
        for u in range(w.users)
    ]
    return Texts(systems, questions)


def group_of(w: SharedPrefixWorkload, user: int) -> int:
    return user // w.num_prompts_per_group


def load_inference_perf(path: str | Path) -> SharedPrefixWorkload:
    """An inference-perf config (``data.type: shared_prefix``) as a workload."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path} is not valid YAML: {exc}") from None
    return parse_inference_perf(doc, str(path))


def parse_inference_perf(doc: Any, source: str = "<workload>") -> SharedPrefixWorkload:
    if not isinstance(doc, dict):
        raise WorkloadError(f"{source}: expected a mapping at the top level")
    data = doc.get("data") or {}
    if data.get("type") != "shared_prefix":
        raise WorkloadError(
            f"{source}: field 'data.type' must be shared_prefix, got {data.get('type')!r}"
        )
    sp = data.get("shared_prefix")
    if not isinstance(sp, dict):
        raise WorkloadError(f"{source}: field 'data.shared_prefix' is missing")

    def num(key: str, *aliases: str, default: int | None = None) -> int:
        for k in (key, *aliases):
            if k in sp:
                value = sp[k]
                if not isinstance(value, int) or isinstance(value, bool):
                    raise WorkloadError(
                        f"{source}: field 'data.shared_prefix.{k}' must be an "
                        f"integer, got {value!r}"
                    )
                return value
        if default is None:
            raise WorkloadError(f"{source}: field 'data.shared_prefix.{key}' is required")
        return default

    groups = num("num_groups", "num_unique_system_prompts")
    per_group = num("num_prompts_per_group", "num_users_per_system_prompt")
    multi_turn = bool(sp.get("enable_multi_turn_chat", False))
    api = str((doc.get("api") or {}).get("type", "completion"))
    if api not in ("chat", "completion"):
        raise WorkloadError(f"{source}: field 'api.type' must be chat or completion, got {api!r}")

    load = doc.get("load") or {}
    stages: list[tuple[float, float]] = []
    for i, st in enumerate(load.get("stages") or []):
        try:
            stages.append((float(st["rate"]), float(st["duration"])))
        except (KeyError, TypeError, ValueError):
            raise WorkloadError(
                f"{source}: field 'load.stages[{i}]' needs numeric rate and duration"
            ) from None
    if not stages:
        raise WorkloadError(f"{source}: field 'load.stages' must list at least one stage")
    users = groups * per_group
    total = sum(round(r * d) for r, d in stages)
    turns = max(1, math.ceil(total / users)) if multi_turn else 1
    return SharedPrefixWorkload(
        num_groups=groups,
        num_prompts_per_group=per_group,
        system_prompt_len=num("system_prompt_len"),
        question_len=num("question_len"),
        output_len=num("output_len"),
        num_turns=turns,
        multi_turn=multi_turn,
        api=api,
        stages=tuple(stages),
        poisson=str(load.get("type", "constant")) == "poisson",
        rate=stages[0][0],
    )
