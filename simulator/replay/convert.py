"""Other request logs as the replay's request log (:mod:`simulator.replay.requestlog`).

Public LLM traces record when a request came and how long its prompt and answer were, not
what it said; a converted row gets block ids of its own (``hash_ids``, 512 tokens each, never
shared with another row), so it is replayed with no prefix reuse, which is all such a trace
can tell. Where a log knows more (a conversation's turns), the rows say so.

* ``mooncake``: Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``): the same requests, times in seconds.

Rows with ``hash_ids`` carry ``block_tokens`` (512), which also tells them from Mooncake rows.
* ``azure``: Azure's LLM inference traces (2023, 2024; CSV ``TIMESTAMP``, ``ContextTokens``,
  ``GeneratedTokens``).
* ``burstgpt``: BurstGPT (CSV ``Timestamp`` seconds, ``Model``, ``Request tokens``,
  ``Response tokens``; rows with a 0-token response are failures and are left out).
* ``stack``: the local stack's ``requests.jsonl`` (``epp-sim stack --demo --out-dir``; one
  policy's run, the first round, ``--run`` naming it when there are several), rebuilt as
  the chat it was: each user is a session whose turn ``n`` is turn ``n - 1``'s prompt, its
  reply and a question; the users of a group share its system prompt (the prompts' lengths
  are the log's; the text is the emulator's, so the replay caches what the servers did).
  The demo's client is a closed loop (a user's next turn goes when the last answer ends; a
  new user when one finishes), and so are the rows: each is sent ``after`` the request whose
  end let it go, with the gap the log shows (``delay_s``), so a slower or faster replay keeps
  the same number of conversations in flight. ``closed_loop=False``: the log's times only.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from simulator.model.tokens import CHARS_PER_TOKEN, generate_text
from simulator.replay.requestlog import CONVERTED
from simulator.replay.workload import MOONCAKE_BLOCK_TOKENS, json_lines, open_text, random_text

FORMATS = CONVERTED
CSV_COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
"""The columns that tell a public trace's CSV apart (``csv_format``)."""


def csv_format(path: str | Path) -> str | None:
    """``azure`` or ``burstgpt`` when the CSV's header has that trace's columns, else None
    (a request log, or something else the request-log reader will name)."""
    try:
        with open_text(path, newline="") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    names = {h.strip() for h in header}
    for fmt, columns in CSV_COLUMNS.items():
        if set(columns) <= names:
            return fmt
    return None


class _Ids:
    """Fresh block ids, never used by another row."""

    def __init__(self) -> None:
        self.next = 1 << 40

    def take(self, tokens: int) -> list[int]:
        n = max(1, -(-tokens // MOONCAKE_BLOCK_TOKENS))
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open_text(path) as f:
        for lineno, value in json_lines(f):
            if isinstance(value, Exception):
                raise ValueError(f"{path}:{lineno}: {value}")
            if not isinstance(value, dict):
                raise ValueError(f"{path}:{lineno}: a row is a JSON object")
            yield lineno, value


def _csv(path: Path, needed: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    with open_text(path, newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or ()]
        missing = [n for n in needed if n not in header]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (has: {', '.join(header)})")
        for row in reader:
            yield reader.line_num, {(k or "").strip(): (v or "").strip() for k, v in row.items()}


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime reads
    head, _, frac = text.partition(".")
    stamp = datetime.fromisoformat(head).timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def convert(fmt: str, path: str | Path, policy: str = "", round_: int | None = None,
            closed_loop: bool = True, left_out: list[int] | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The rows of ``path`` (a ``fmt`` log) as request-log rows, in file order; ``policy``
    picks one policy's run out of a stack log holding several, ``round_`` one of its rounds
    (``--rounds``; the first by default), ``closed_loop`` whether its rows wait for the
    answers that let them go (module docstring). The line of each row left out (a BurstGPT
    failure) is appended to ``left_out``."""
    path = Path(path)
    ids = _Ids()
    if fmt == "mooncake":
        for _, r in _jsonl(path):
            yield {"timestamp": float(r["timestamp"]) / 1000.0, "hash_ids": list(r["hash_ids"]),
                   "input_length": int(r["input_length"]), "output_length": int(r["output_length"]),
                   "block_tokens": MOONCAKE_BLOCK_TOKENS}  # fmt: skip
    elif fmt == "azure":
        for lineno, r in _csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
            try:
                tokens = int(r["ContextTokens"])
                yield {"timestamp": _azure_time(r["TIMESTAMP"]), "hash_ids": ids.take(tokens),
                       "input_length": max(1, tokens), "output_length": int(r["GeneratedTokens"]),
                       "block_tokens": MOONCAKE_BLOCK_TOKENS}  # fmt: skip
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    elif fmt == "burstgpt":
        for lineno, r in _csv(path, ("Timestamp", "Request tokens", "Response tokens")):
            try:
                tokens, out = int(r["Request tokens"]), int(r["Response tokens"])
                if out == 0:  # a failed request
                    if left_out is not None:
                        left_out.append(lineno)
                    continue
                row: dict[str, Any] = {"timestamp": float(r["Timestamp"]), "hash_ids": ids.take(tokens),
                                       "input_length": max(1, tokens), "output_length": out,
                                       "block_tokens": MOONCAKE_BLOCK_TOKENS}  # fmt: skip
                if r.get("Model"):
                    row["model"] = r["Model"]
                yield row
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    elif fmt == "stack":
        yield from _stack(path, policy, round_, closed_loop)
    else:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def left_out_note(left_out: list[int], kept: int) -> str:
    """What a conversion left out, for the line that reports it ('' when nothing)."""
    if not left_out:
        return ""
    lines = ", ".join(map(str, left_out[:5])) + (", ..." if len(left_out) > 5 else "")
    return (f" (left out {len(left_out)} of {kept + len(left_out)} rows, a response of 0 "
            f"tokens: BurstGPT's record of a failed request; line {lines})")


def _one_run(rows: list[dict[str, Any]], path: Path, policy: str, round_: int | None) -> list[dict[str, Any]]:
    """The rows of one (policy, round) run of a stack log."""
    if round_ is not None:
        rounds = sorted({int(r.get("round", 0)) for r in rows})
        rows = [r for r in rows if int(r.get("round", 0)) == round_]
        if not rows:
            raise ValueError(f"{path}: no round {round_} (rounds: {', '.join(map(str, rounds))})")
    runs = sorted({(str(r.get("policy", "")), int(r.get("round", 0))) for r in rows})
    if policy:
        rows = [r for r in rows if r.get("policy") == policy]
        if not rows:
            raise ValueError(f"{path}: no run of policy {policy!r} (runs: {', '.join(p for p, _ in runs)})")
        runs = sorted({(policy, int(r.get("round", 0))) for r in rows})
    if len(runs) > 1:
        first = runs[0]
        if len({p for p, _ in runs}) > 1 and not policy:
            raise ValueError(f"{path} holds the runs of several policies ({', '.join(sorted({p for p, _ in runs}))}): "
                             "pick one with --run")  # fmt: skip
        rows = [r for r in rows if (str(r.get("policy", "")), int(r.get("round", 0))) == first]  # round 0
    return rows


def _stack(path: Path, policy: str, round_: int | None, closed_loop: bool) -> Iterator[dict[str, Any]]:
    rows = _one_run([r for _, r in _jsonl(path)], path, policy, round_)
    for r in rows:
        for key in ("user", "turn", "group", "start_s", "prompt_tokens"):
            if key not in r:
                raise ValueError(f"{path}: a row has no {key!r}: not the stack's requests.jsonl")
    # the prompts are rebuilt as text, as the stack's chat was: a group's system prompt, then
    # each turn's question; turn n is turn n - 1's prompt, its reply and a new question. The
    # question's length is the median growth between turns less the reply; the system prompt
    # is the group's shortest first turn less one question.
    by_turn = {(r["user"], r["turn"]): r for r in rows}
    growth = [int(r["prompt_tokens"]) - int(last["prompt_tokens"]) - int(last.get("completion_tokens") or 1)
              for r in rows if (last := by_turn.get((r["user"], r["turn"] - 1))) is not None]  # fmt: skip
    question = max(1, int(statistics.median(growth))) if growth else 64
    firsts: dict[int, int] = {}
    for r in rows:
        if r["turn"] == 0:
            firsts[r["group"]] = min(firsts.get(r["group"], 1 << 30), int(r["prompt_tokens"]))
    system = {g: "<|system|>" + random_text(0x5157 << 32 | g, max(1, n - question) * CHARS_PER_TOKEN)
              for g, n in firsts.items()}  # fmt: skip
    history: dict[int, tuple[str, int]] = {}
    out: list[tuple[float, dict[str, Any]]] = []
    for r in sorted(rows, key=lambda x: (x["user"], x["turn"])):
        output = int(r.get("completion_tokens") or 1)
        prev = history.get(r["user"])
        if prev is None:
            base = system.get(r["group"], "")
        else:
            text, prev_out = prev
            base = text + "<|assistant|>" + generate_text(text, prev_out)
        # a failed request reports no prompt tokens: it asked what the conversation held
        tokens = int(r["prompt_tokens"]) or len(base) // CHARS_PER_TOKEN + question
        want = tokens * CHARS_PER_TOKEN - len(base) - len("<|user|>")
        key = 0x5158 << 40 | (r["user"] & 0xFFFFF) << 16 | (r["turn"] & 0xFFFF)
        prompt = base + "<|user|>" + random_text(key, max(want, 4))
        history[r["user"]] = (prompt, output)
        out.append((float(r["start_s"]), {
            "timestamp": float(r["start_s"]), "prompt": prompt, "api": "chat",
            "input_length": tokens, "output_length": output, "session": f"user-{r['user']}",
            "id": f"u{r['user']}t{r['turn']}",
        }))  # fmt: skip
    if closed_loop:
        _link(sorted(rows, key=lambda x: float(x["start_s"])), {row["id"]: row for _, row in out})
    for _, row in sorted(out, key=lambda x: x[0]):
        yield row


def _link(rows: list[dict[str, Any]], out: dict[str, dict[str, Any]]) -> None:
    """Closed loop: each row of ``out`` (by id, the requests of ``rows`` sorted by start) is
    sent after the request whose end let it go: the user's previous turn, or for a user's
    first turn the last turn of the user whose end freed its slot (the latest unused such
    end before it: each end frees one slot); none for the first users."""

    def name(r: dict[str, Any]) -> str:
        return f"u{r['user']}t{r['turn']}"

    by_turn = {(r["user"], r["turn"]): r for r in rows}
    last_turn: dict[int, int] = {}
    for r in rows:
        last_turn[r["user"]] = max(last_turn.get(r["user"], -1), r["turn"])

    def end(r: dict[str, Any]) -> float | None:
        e2e = r.get("e2e_s")
        return float(r["start_s"]) + float(e2e) if isinstance(e2e, int | float) else None

    frees = sorted((e, i) for i, r in enumerate(rows)
                   if r["turn"] == last_turn[r["user"]] and (e := end(r)) is not None)  # fmt: skip
    used = [False] * len(frees)
    for r in rows:
        start = float(r["start_s"])
        parent = by_turn.get((r["user"], r["turn"] - 1))
        if parent is None and r["turn"] == 0:
            # the latest unused end at or before this start (a slot freed, then taken)
            k = next((k for k in range(len(frees) - 1, -1, -1)
                      if frees[k][0] <= start and not used[k]), None)  # fmt: skip
            if k is not None:
                used[k] = True
                parent = rows[frees[k][1]]
        done = end(parent) if parent is not None else None
        if parent is None or done is None or done > start:
            continue
        out[name(r)] |= {"after": name(parent), "delay_s": round(start - done, 6)}
