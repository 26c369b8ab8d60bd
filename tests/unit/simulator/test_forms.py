"""Trace requests in an API's form (``epp-sim load --api``) and request logs that carry one."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from epp.framework.request import ApiKind
from epp.request.apis import BUILTIN
from simulator.forms import chat_fields, messages_fields, request_as, turns
from simulator.load import LoadOptions, body_of
from simulator.replay.requestlog import RequestLog, write_request_log
from simulator.replay.workload import TraceRequest, build_generator


def agent_requests() -> list[TraceRequest]:
    w = build_generator("agentic", {"num_sessions": 1, "min_turns": 4, "max_turns": 4, "subagents": 0,
                                    "system_prompt_len": 64, "tool_output_len": 16, "output_len": 4})  # fmt: skip
    return list(w.requests())


def test_an_agent_session_becomes_tool_use_and_tool_result_turns() -> None:
    reqs = agent_requests()
    fields = messages_fields(reqs[2].prompt)
    assert fields["system"] and fields["messages"][0]["role"] == "user"
    kinds = [(m["role"], [b["type"] for b in m["content"]] if isinstance(m["content"], list) else "text")
             for m in fields["messages"][1:]]  # fmt: skip
    assert kinds == [("assistant", ["text", "tool_use"]), ("user", ["tool_result"])] * 2
    uses = [b["id"] for m in fields["messages"] if isinstance(m["content"], list) for b in m["content"]
            if b["type"] == "tool_use"]  # fmt: skip
    results = [b["tool_use_id"] for m in fields["messages"] if isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"]  # fmt: skip
    assert uses == results == ["toolu_0001", "toolu_0002"]


@pytest.mark.parametrize("api", [ApiKind.MESSAGES, ApiKind.CHAT])
def test_each_turn_keys_as_an_extension_of_the_last(api: ApiKind) -> None:
    """epp's key of turn k+1 starts with turn k's (its reply included): the session keeps its
    affinity when sent in either form."""
    keys = []
    for r in agent_requests():
        path, body = request_as(r, api, {"model": "m", "max_tokens": 4})
        keys.append(BUILTIN[path].prompt(body))
    assert all(b.startswith(a) for a, b in itertools.pairwise(keys))


def test_text_without_markers_is_one_user_turn_and_completions_stay_prompts() -> None:
    assert turns("plain") == [("user", "plain")]
    assert messages_fields("plain") == {"messages": [{"role": "user", "content": "plain"}]}
    assert chat_fields("<|user|>q<|assistant|>a") == {"messages": [{"role": "user", "content": "q"},
                                                                  {"role": "assistant", "content": "a"}]}  # fmt: skip
    r = TraceRequest("r", 0.0, 2, 3, "plain")
    path, body = body_of(r, LoadOptions("m"))
    assert path == "/v1/completions" and body["prompt"] == "plain" and body["max_tokens"] == 3


def test_a_request_log_carries_anthropic_messages_and_sends_them_as_recorded(tmp_path: Path) -> None:
    system = "You are a coding agent."
    tools = [{"name": "read", "input_schema": {"type": "object"}}]
    msgs = [{"role": "user", "content": "fix it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]  # fmt: skip
    rows = [{"timestamp": 0, "output_length": 5, "api": "messages", "system": system, "tools": tools,
             "messages": msgs[:1], "session": "a"},
            {"timestamp": 1, "output_length": 5, "api": "messages", "system": system, "tools": tools,
             "messages": msgs, "session": "a"}]  # fmt: skip
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = RequestLog.load(path)
    first, second = log.requests()
    assert first.api is ApiKind.MESSAGES and second.prompt.startswith(first.prompt)
    assert second.prompt.startswith("<|system|>You are a coding agent.<|tools|>")
    sent_path, body = body_of(second, LoadOptions("m"))
    assert sent_path == "/v1/messages" and body["messages"] == msgs and body["tools"] == tools
    again = tmp_path / "again.jsonl"
    write_request_log(log.requests(), again)  # written back as it was read
    assert [r.prompt for r in RequestLog.load(again).requests()] == [first.prompt, second.prompt]


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"api": "graphql", "prompt": "x"}, "api must be one of"),
        ({"api": "completions", "messages": [{"role": "user", "content": "x"}]}, "not completions"),
        ({"api": "messages", "messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\].role"),
    ],
)
def test_bad_api_rows_name_the_problem(tmp_path: Path, row: dict[str, object], words: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "output_length": 1, **row}) + "\n")
    with pytest.raises(ValueError, match=words):
        RequestLog.load(path)


def test_an_agent_log_in_messages_form_replays_with_its_turns_cached(tmp_path: Path) -> None:
    """A session's Messages requests kept as a log: the replay keys them as epp does and
    its engines find each turn's predecessor cached."""
    from simulator.replay.policies import policy_factory
    from simulator.replay.replayer import ReplayConfig, Replayer
    from simulator.replay.report import summarize

    rows = []
    for i, r in enumerate(agent_requests()):
        _, body = request_as(r, ApiKind.MESSAGES, {})
        rows.append({"timestamp": i * 30.0, "output_length": 4, "api": "messages", "session": "a", **body})
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = RequestLog.load(path)
    assert {r.api for r in log.requests()} == {ApiKind.MESSAGES}
    name, factory = policy_factory("epp")
    s = summarize(Replayer(ReplayConfig(replicas=2, kv_blocks=2048)).run(log, factory, name))
    assert s.requests == 4 and s.hit_rate > 0.5
