"""The replay's general trace format (request logs, JSONL and CSV), its converters and
``epp-sim trace``: a log replays exactly as the workload it was written from, bad rows are
named, adapters have prefix caches and batch slots of their own."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import shlex
from pathlib import Path

import pytest

from epp.framework.request import ApiKind
from simulator.cli import main as sim_main
from simulator.model.cost import CostModel
from simulator.model.tokens import CHARS_PER_TOKEN
from simulator.replay.bound import ttft_lower_bounds
from simulator.replay.cli import trace_format
from simulator.replay.convert import convert
from simulator.replay.policies import policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.report import summarize
from simulator.replay.requestlog import RequestLog, write_request_log
from simulator.replay.workload import (
    MooncakeTrace,
    TraceRequest,
    build_generator,
    engine_block_hashes,
    final_block_hashes,
    random_text,
    reply_text,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "support-desk.jsonl"
TRACE = ROOT / ".." / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def replay(workload: object, policy: str = "epp", **cfg: int) -> tuple[float, float, float]:
    name, factory = policy_factory(policy)
    s = summarize(Replayer(ReplayConfig(**cfg)).run(workload, factory, name))  # type: ignore[arg-type]
    return s.hit_rate, s.ttft_p50_s, s.ttft_p90_s


def test_a_generated_workload_written_as_a_log_replays_identically(tmp_path: Path) -> None:
    w = build_generator("agentic", {"num_sessions": 5, "rate": 1, "max_turns": 12,
                                    "system_prompt_len": 800, "tool_output_len": 400})  # fmt: skip
    path = tmp_path / "agents.jsonl"
    assert write_request_log(w.requests(), path) == len(w)
    log = RequestLog.load(path)
    assert [(r.prompt, r.session_id, r.api, r.output_tokens) for r in log.requests()] == \
        [(r.prompt, r.session_id, r.api, r.output_tokens) for r in w.requests()]  # fmt: skip
    # the log's times start at its first row (the generator's at its first arrival): equal up
    # to floating point
    assert replay(log, replicas=4, kv_blocks=2048) == pytest.approx(replay(w, replicas=4, kv_blocks=2048), rel=1e-9)
    half = log.with_time_scale(0.5)
    assert [r.arrival_s for r in half.requests()] == [r.arrival_s * 0.5 for r in log.requests()]


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not present")
def test_a_converted_mooncake_trace_replays_as_the_trace(tmp_path: Path) -> None:
    head = tmp_path / "head.jsonl"
    head.write_text("".join(TRACE.read_text(encoding="utf-8").splitlines(keepends=True)[:150]))
    out = tmp_path / "head-requests.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in convert("mooncake", head)))
    assert trace_format(head) == "mooncake" and trace_format(out) == "requests"
    log, trace = RequestLog.load(out), MooncakeTrace.load(head)
    assert [r.hash_ids for r in log.requests()] == [r.hash_ids for r in trace.requests()]
    assert replay(log, kv_blocks=4096) == pytest.approx(replay(trace, kv_blocks=4096), rel=1e-9)


def test_csv_logs_iso_times_token_ids_and_every_field(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text(
        "timestamp,prompt,prompt_token_ids,output_length,session,adapter,tenant,priority,api\n"
        "2026-11-26T10:00:01.5Z,hello there,,20,s1,ad-1,acme,2,chat\n"
        "2026-11-26T10:00:00Z,,1 2 3 4 5,10,,,,,\n", encoding="utf-8")  # fmt: skip
    first, second = RequestLog.load(path).requests()
    assert (first.arrival_s, first.prompt_tokens, first.has_text) == (0.0, 5, False)
    assert (second.arrival_s, second.session_id, second.adapter, second.tenant, second.priority) == \
        (1.5, "s1", "ad-1", "acme", 2)  # fmt: skip
    assert second.api.value == "chat_completions"


def test_gzipped_logs_and_traces_read_as_they_are(tmp_path: Path) -> None:
    """A ``.gz`` request log (JSONL or CSV) or Mooncake trace reads as the plain file does,
    and its format is told the same way."""
    files = {
        "log.jsonl": '{"timestamp": 0, "output_length": 4, "prompt": "hello there", "session": "s1"}\n'
                     '{"timestamp": 1.5, "output_length": 8, "prompt_token_ids": [1, 2, 3]}\n',
        "log.csv": "timestamp,prompt,output_length,adapter\n0,hello,4,ad-1\n2,bye,3,\n",
        "trace.jsonl": '{"timestamp": 0, "input_length": 900, "output_length": 8, "hash_ids": [1, 2]}\n'
                       '{"timestamp": 250, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}\n',
    }  # fmt: skip
    for name, text in files.items():
        plain, packed = tmp_path / name, tmp_path / f"{name}.gz"
        plain.write_text(text, encoding="utf-8")
        packed.write_bytes(gzip.compress(text.encode()))
        assert trace_format(packed) == trace_format(plain)
        load = MooncakeTrace.load if trace_format(plain) == "mooncake" else RequestLog.load
        got, want = load(packed).requests(), load(plain).requests()
        assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids, r.adapter) for r in got] == \
            [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.hash_ids, r.adapter) for r in want]  # fmt: skip
    assert trace_format(tmp_path / "trace.jsonl.gz") == "mooncake"
    assert list(convert("mooncake", tmp_path / "trace.jsonl.gz")) == list(convert("mooncake", tmp_path / "trace.jsonl"))


@pytest.mark.parametrize(("row", "reason"), [
    ('{"timestamp": 1, "prompt": "x"}', "no output_length"),
    ('{"timestamp": 1, "output_length": 3}', "exactly one of prompt"),
    ('{"timestamp": 1, "output_length": 3, "prompt": "x", "hash_ids": [1]}', "this one has prompt, hash_ids"),
    ('{"timestamp": "yesterday", "output_length": 3, "prompt": "x"}', "neither seconds nor an ISO 8601"),
    ('{"timestamp": 1, "output_length": 3, "hash_ids": [1, 2]}', "hash_ids need input_length"),
    ('{"timestamp": 1, "output_length": 3, "messages": "hello"}', "'messages' must be a non-empty list"),
    ('{"timestamp": 1, "output_length": -3, "prompt": "x"}', "output_length must be >= 0"),
    ("[1, 2]", "a row is a JSON object"),
])  # fmt: skip
def test_bad_rows_are_named_and_can_be_skipped(tmp_path: Path, row: str, reason: str) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"timestamp": 0, "output_length": 1, "prompt": "fine"}\n' + row + "\n")
    with pytest.raises(ValueError, match=r"log\.jsonl:2: not a request-log row") as info:
        RequestLog.load(path)
    assert reason in str(info.value) and "--skip-bad-rows" in str(info.value)
    log = RequestLog.load(path, skip_bad_rows=True)
    assert len(log) == 1 and len(log.skipped) == 1


def test_an_adapters_blocks_are_its_own_and_adapters_wait_for_a_batch_slot() -> None:
    base = TraceRequest("a", 0.0, 256, 8, "the same prompt " * 64)
    lora = TraceRequest("b", 0.0, 256, 8, "the same prompt " * 64, adapter="ad-1")
    other = TraceRequest("c", 0.0, 256, 8, "the same prompt " * 64, adapter="ad-2")
    names = [set(engine_block_hashes(r, 16, 7)) for r in (base, lora, other)]
    assert not (names[0] & names[1]) and not (names[1] & names[2])  # no hits across adapters
    # one replica that runs one adapter at a time: the second adapter's request waits
    reqs = [TraceRequest(f"r{i}", 0.0, 64, 200, f"prompt {i} " * 30, adapter=f"ad-{i % 2}") for i in range(4)]
    log = RequestLog(reqs)
    one, two = (summarize(Replayer(ReplayConfig(replicas=1, max_loras=k)).run(log, policy_factory("round-robin")[1],
                                                                              "rr")) for k in (1, 2))  # fmt: skip
    assert one.ttft_p90_s > 2 * two.ttft_p90_s


def test_the_documented_example_replays_with_lora_affinity(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["trace", "check", str(EXAMPLE)]) == 0
    summary = capsys.readouterr().out
    assert "sessions" in summary and "desk-0" in summary
    code = sim_main(["replay", "--trace", str(EXAMPLE), "--replicas", "4", "--kv-blocks", "1024",
                     "--max-loras", "2", "--no-progress", "--policies",
                     f"epp,epp:{ROOT / 'docs/examples/lora-affinity.yaml'},round-robin"])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert table.count("│ epp") == 2 and "round-robin" in table


def test_trace_export_and_convert_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.jsonl"
    assert sim_main(["trace", "export", "--workload", "chat", "--set", "num_sessions=3", "--out", str(out)]) == 0
    assert len(RequestLog.load(out)) == 18  # 3 sessions x 6 turns
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,600,20,620,Conversation log\n7,GPT-4,100,0,100,API log\n")  # fmt: skip
    assert sim_main(["trace", "convert", "--from", "burstgpt", str(burst), "--out", str(tmp_path / "b.jsonl")]) == 0
    (row,) = RequestLog.load(tmp_path / "b.jsonl").requests()  # the failed request left out
    assert (row.prompt_tokens, row.output_tokens, len(row.hash_ids)) == (600, 20, 2)
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,4808,10\n2023-11-16 18:15:50.9951690,3180,8\n")  # fmt: skip
    assert sim_main(["trace", "convert", "--from", "azure", str(azure), "--out", str(tmp_path / "a.jsonl")]) == 0
    a, b = RequestLog.load(tmp_path / "a.jsonl").requests()
    assert round(b.arrival_s, 3) == 4.315 and not set(a.hash_ids) & set(b.hash_ids)
    capsys.readouterr()
    assert sim_main(["trace", "convert", "--from", "azure", str(burst), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no column TIMESTAMP" in capsys.readouterr().err


def test_out_dir_records_every_input_and_its_command_reproduces_the_results(tmp_path: Path) -> None:
    first = tmp_path / "first"
    args = ["replay", "--trace", str(EXAMPLE), "--replicas", "4", "--kv-blocks", "1024", "--max-loras", "2",
            "--no-progress", "--policies", "epp,round-robin", "--out-dir", str(first)]  # fmt: skip
    assert sim_main(args) == 0
    report = json.loads((first / "report.json").read_text())
    inputs = report["inputs"]
    assert inputs["workload"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert inputs["replay"]["max_loras"] == 2 and inputs["policies"] == ["epp", "round-robin"]
    assert inputs["epp_version"] and inputs["command"].startswith("epp-sim replay --trace")
    assert [r["policy"] for r in report["results"]] == ["epp", "round-robin"]
    assert (first / "report.csv").read_text().count("\n") == 3
    page = (first / "index.html").read_text()
    assert "ttft_cdf.png" in page and (first / "ttft_cdf.png").is_file() and "round-robin" in page
    # the recorded command, run again, gives the same figures
    again = shlex.split(inputs["command"])[1:]
    again[again.index("--out-dir") + 1] = str(tmp_path / "second")
    assert sim_main(again) == 0
    second = json.loads((tmp_path / "second" / "report.json").read_text())

    def figures(results: list[dict[str, object]]) -> list[dict[str, object]]:  # not the host's timings
        return [{k: v for k, v in r.items() if k not in ("wall_s", "sim_requests_per_s")} for r in results]

    assert figures(second["results"]) == figures(report["results"])


def test_a_reply_leaves_cached_the_blocks_its_computed_tokens_fill(tmp_path: Path) -> None:
    """A chat reply's last token is sampled, never computed: a 1,288-token prompt and a
    24-token reply fill 40 blocks of 32 (not 41); 1,290 tokens and 24 fill 41. With
    ``replies_cached`` off (a model whose replies come back as other tokens) the next turn
    hits only the last prompt's blocks."""
    def turn(tokens: int) -> TraceRequest:
        return TraceRequest("t", 0.0, tokens, 24, random_text(7, tokens * CHARS_PER_TOKEN), api=ApiKind.CHAT)

    assert len(final_block_hashes(turn(1288), reply_text(turn(1288)), 32, 0) or []) == 40
    assert len(final_block_hashes(turn(1290), reply_text(turn(1290)), 32, 0) or []) == 41
    rows = [{"policy": "epp", "round": 0, "user": 0, "turn": t, "group": 0, "start_s": 5.0 * t,
             "prompt_tokens": 1290 + 90 * t, "completion_tokens": 24} for t in range(2)]  # fmt: skip
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "converted.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in convert("stack", log)))
    name, factory = policy_factory("round-robin")
    cached = {}
    for replies in (True, False):
        cfg = ReplayConfig(replicas=1, kv_blocks=512, block_size_tokens=32, replies_cached=replies)
        result = Replayer(cfg).run(RequestLog.load(out), factory, name)
        cached[replies] = [o.cached_tokens for o in sorted(result.outcomes, key=lambda o: o.arrival_s)]
    assert cached[True][1] > cached[False][1] == 1290 // 32 * 32
    # the bound no policy beats follows the same rule: without the reply, the turn costs more
    cost = CostModel()
    with_reply, without = (ttft_lower_bounds(RequestLog.load(out).requests(), cost, 32, replies_cached=r)
                           for r in (True, False))  # fmt: skip
    assert without[1].bound_s > with_reply[1].bound_s
    assert sim_main(["replay", "--trace", str(out), "--replicas", "1", "--kv-blocks", "512", "--block-size", "32",
                     "--policies", "round-robin", "--no-progress", "--replies-not-cached"]) == 0  # fmt: skip


def test_a_stack_request_log_converts_to_sessions_whose_turns_extend(tmp_path: Path) -> None:
    rows = []
    for policy in ("epp", "random"):
        for user in range(4):
            for turn in range(3):
                rows.append({"policy": policy, "round": 0, "user": user, "turn": turn, "group": user % 2,
                             "start_s": user * 0.5 + turn * 3.0, "prompt_tokens": 1500 + 700 * turn,
                             "completion_tokens": 40})  # fmt: skip
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="several policies"):
        list(convert("stack", log))
    with pytest.raises(ValueError, match="no run of policy 'sglang'"):
        list(convert("stack", log, "sglang"))
    out = tmp_path / "epp.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in convert("stack", log, "epp")))
    reqs = list(RequestLog.load(out).requests())
    assert len(reqs) == 12 and len({r.session_id for r in reqs}) == 4
    by_user = {s: [r for r in reqs if r.session_id == s] for s in {r.session_id for r in reqs}}
    for turns in by_user.values():  # each turn is the last one, its reply and a question
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.prompt.startswith(prev.prompt + "<|assistant|>" + reply_text(prev))
            assert nxt.prompt_tokens == prev.prompt_tokens + 700 and nxt.api.value == "chat_completions"
    firsts = {s: t[0].prompt for s, t in by_user.items()}
    system = 1500 - (700 - 40)  # the group's first turn less one question (growth less the reply)
    assert firsts["user-0"][: system * 4] == firsts["user-2"][: system * 4]  # a group's system prompt
    assert firsts["user-0"][:40] != firsts["user-1"][:40]


def closed_loop_log(tmp_path: Path, delay: float = 0.5) -> Path:
    """Two users of three turns each, every turn after the user's last answer; the log's own
    timestamps are far apart (100 s), so an open-loop replay would space them so."""
    rows = []
    for user in range(2):
        prev = ""
        for turn in range(3):
            row = {"timestamp": user * 0.01 + turn * 100, "id": f"u{user}t{turn}", "session": f"u{user}",
                   "prompt": f"user {user} " * 200 + "more " * 60 * turn, "output_length": 16}  # fmt: skip
            if prev:
                row |= {"after": prev, "delay_s": delay}
            prev = row["id"]
            rows.append(row)
    path = tmp_path / "closed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_closed_loop_row_arrives_its_delay_after_the_answer_it_waits_for(tmp_path: Path) -> None:
    log = RequestLog.load(closed_loop_log(tmp_path))
    assert [r.after for r in log.requests()] == [(), (), ("r0",), ("r1",), ("r2",), ("r3",)]
    name, factory = policy_factory("epp")
    result = Replayer(ReplayConfig(replicas=2)).run(log, factory, name)
    by_id = {o.request_id: o for o in result.outcomes}
    for r in log.requests():
        if r.after:
            assert by_id[r.request_id].arrival_s == pytest.approx(by_id[r.after[0]].finish_s + 0.5)
    assert max(o.finish_s for o in result.outcomes) < 10  # not the log's 200 s
    # a slower server: the next turns come later (the loop closes on the replay's own times)
    slow = Replayer(ReplayConfig(replicas=2, cost=CostModel(decode_base_s=0.1))).run(log, factory, name)
    assert max(o.arrival_s for o in slow.outcomes) > max(o.arrival_s for o in result.outcomes) + 1
    # written out and read back, the links hold
    out = tmp_path / "again.jsonl"
    write_request_log(log.requests(), out)
    assert [(r.after, r.delay_s) for r in RequestLog.load(out).requests()] == \
        [(r.after, r.delay_s) for r in log.requests()]  # fmt: skip
    assert [r.delay_s for r in log.with_time_scale(2).requests()][2:] == [1.0] * 4


def test_a_refused_request_still_lets_the_next_go(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "id": "big", "prompt": "x" * 40000, "output_length": 4}) + "\n"
                    + json.dumps({"timestamp": 5, "after": "big", "prompt": "small", "output_length": 4}) + "\n")  # fmt: skip
    name, factory = policy_factory("random")
    result = Replayer(ReplayConfig(replicas=1, kv_blocks=64)).run(RequestLog.load(path), factory, name)
    assert [o.rejected for o in result.outcomes] == [True, False]
    assert result.outcomes[1].arrival_s == pytest.approx(0.0)


@pytest.mark.parametrize(("rows", "reason"), [
    ([{"timestamp": 1, "after": "nobody"}], "'nobody', which names no earlier row's id"),
    ([{"timestamp": 1, "id": "a"}, {"timestamp": 2, "id": "a"}], "two rows have the id 'a'"),
    ([{"timestamp": 1, "id": "a", "after": "b"}, {"timestamp": 2, "id": "b"}], "'b', which names no earlier"),
])  # fmt: skip
def test_after_must_name_an_earlier_row(tmp_path: Path, rows: list[dict[str, object]], reason: str) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r | {"prompt": "x", "output_length": 1}) + "\n" for r in rows))
    with pytest.raises(ValueError, match=reason):
        RequestLog.load(path)


def test_delay_without_after_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"timestamp": 1, "prompt": "x", "output_length": 1, "delay_s": 2}\n')
    with pytest.raises(ValueError, match=r"log\.jsonl:1: .*delay_s needs after"):
        RequestLog.load(path)


def test_a_stack_log_converts_to_a_closed_loop(tmp_path: Path) -> None:
    """Two conversations at a time: user 2 starts when user 0's last turn ends, and each
    turn when its user's last answer ended."""
    rows = []
    for user, t0 in ((0, 0.0), (1, 0.1), (2, 6.05)):
        for turn in range(3):
            start = t0 + 2.0 * turn
            rows.append({"policy": "epp", "round": 0, "user": user, "turn": turn, "group": 0, "start_s": start,
                         "e2e_s": 1.99, "prompt_tokens": 800 + 100 * turn, "completion_tokens": 20})  # fmt: skip
    rows[4] |= {"status": 503, "prompt_tokens": 0, "completion_tokens": 0}  # user 1's turn 1 failed
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    converted = {r["id"]: r for r in convert("stack", log)}
    assert converted["u1t1"]["input_length"] == pytest.approx(converted["u0t1"]["input_length"], abs=5)
    links = {r["id"]: (r.get("after"), r.get("delay_s")) for r in converted.values()}
    assert links["u0t0"] == (None, None) and links["u1t0"] == (None, None)
    assert links["u0t1"] == ("u0t0", pytest.approx(0.01)) and links["u1t2"] == ("u1t1", pytest.approx(0.01))
    assert links["u2t0"] == ("u0t2", pytest.approx(0.06))  # user 0's end (5.99 s) freed the slot
    assert all("after" not in r for r in convert("stack", log, closed_loop=False))
    with pytest.raises(ValueError, match=r"no round 3 \(rounds: 0\)"):
        list(convert("stack", log, round_=3))


def test_a_row_after_several_waits_for_the_last_of_them(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "id": "a", "prompt": "short", "output_length": 2},
            {"timestamp": 0, "id": "b", "prompt": "long " * 50, "output_length": 200},
            {"timestamp": 0.1, "after": ["a", "b"], "delay_s": 1, "prompt": "join", "output_length": 2},
            {"timestamp": 0.2, "after": "a b", "prompt": "csv style", "output_length": 2}]  # fmt: skip
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = RequestLog.load(path)
    assert log.closed_loop and [r.after for r in log.requests()][2:] == [("r0", "r1"), ("r0", "r1")]
    name, factory = policy_factory("random")
    result = Replayer(ReplayConfig(replicas=2)).run(log, factory, name)
    by_id = {o.request_id: o for o in result.outcomes}
    assert by_id["r1"].finish_s > by_id["r0"].finish_s + 1  # b is the slower one
    assert by_id["r2"].arrival_s == pytest.approx(by_id["r1"].finish_s + 1)
    assert by_id["r3"].arrival_s == pytest.approx(by_id["r1"].finish_s)
    out = tmp_path / "again.jsonl"
    write_request_log(log.requests(), out)
    assert [r.after for r in RequestLog.load(out).requests()] == [r.after for r in log.requests()]


def test_closed_loop_agents_wait_for_their_answers_and_sub_agents() -> None:
    params = {"num_sessions": 6, "rate": 1, "max_turns": 14, "subagent_share": 0.5, "seed": 3,
              "system_prompt_len": 800, "tool_output_len": 300}  # fmt: skip
    open_loop = build_generator("agentic", params)
    closed = build_generator("agentic", params | {"closed_loop": True})
    assert not open_loop.closed_loop and closed.closed_loop
    assert [(r.prompt, r.arrival_s) for r in closed.requests()] == [(r.prompt, r.arrival_s) for r in open_loop.requests()]
    joins = [r for r in closed.requests() if len(r.after) > 1]
    assert joins and all(len(r.after) == 3 for r in joins)  # a parent waits for its 3 sub-agents
    name, factory = policy_factory("epp")
    result = Replayer(ReplayConfig(replicas=2, cost=CostModel(decode_base_s=0.05))).run(closed, factory, name)
    by_id = {o.request_id: o for o in result.outcomes}
    for r in closed.requests():
        if r.after:
            assert by_id[r.request_id].arrival_s == pytest.approx(max(by_id[a].finish_s for a in r.after) + r.delay_s)


def test_closed_loop_is_a_yes_or_no_parameter() -> None:
    assert build_generator("agentic", {"closed_loop": "true"}).closed_loop
    assert not build_generator("agentic", {"closed_loop": "0"}).closed_loop
    with pytest.raises(ValueError, match="parameter 'closed_loop': expected true or false, got 'maybe'"):
        build_generator("agentic", {"closed_loop": "maybe"})
