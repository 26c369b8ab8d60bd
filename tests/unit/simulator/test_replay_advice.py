"""The replay as a new user meets it with a public trace: Azure and BurstGPT CSVs are read as
they are (or the error names the converter), what a conversion leaves out is said, a trace
with no shared prefix is flagged before its 0% hit rates, and the table comes with a legend,
the policy to run and, when the caches are too small to show routing or to hold a request,
``--kv-blocks``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.cli import main as sim_main
from simulator.replay.advice import advice, prefix_reuse
from simulator.replay.report import PolicyStats
from simulator.replay.workload import build_generator

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,480,10\n2023-11-16 18:15:50.9951690,318,8\n"
         "2023-11-16 18:15:51.0000000,900,30\n")  # fmt: skip
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,600,20,620,Conversation log\n7,GPT-4,100,0,100,API log\n"
            "8,ChatGPT,300,40,340,Conversation log\n")  # fmt: skip


@pytest.mark.parametrize(("name", "text", "fmt"), [("azure.csv", AZURE, "azure"), ("BurstGPT_1.csv", BURSTGPT, "burstgpt")])
def test_a_public_trace_csv_replays_as_it_is_with_a_word_on_what_it_lacks(
    tmp_path: Path, name: str, text: str, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / name
    trace.write_text(text)
    assert sim_main(["replay", "--trace", str(trace), "--replicas", "2", "--policies", "epp,random",
                     "--no-progress"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert f"epp-sim trace convert --from {fmt}" in err
    assert "no two requests of" in err and "hit rate will be 0%" in " ".join(err.split())
    assert "│ epp" in out and "│ random" in out
    if fmt == "burstgpt":
        assert "left out 1 of 3 rows" in err and "line 3" in err


def test_trace_convert_says_what_it_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    burst = tmp_path / "b.csv"
    burst.write_text(BURSTGPT)
    assert sim_main(["trace", "convert", "--from", "burstgpt", str(burst), "--out", str(tmp_path / "b.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "wrote 2 requests" in out and "left out 1 of 3 rows, a response of 0 tokens" in out


def test_another_csv_is_refused_with_the_converter_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "mine.csv"
    other.write_text("when,tokens\n1,2\n")
    for extra in ([], ["--skip-bad-rows"]):
        assert sim_main(["replay", "--trace", str(other), "--no-progress", *extra]) == 2
        assert "epp-sim trace convert --from mooncake|azure|burstgpt|stack" in " ".join(
            capsys.readouterr().err.split())


def test_prefix_reuse_is_what_the_trace_could_hit() -> None:
    shared = build_generator("shared-prefix", {"num_groups": 2, "num_prompts_per_group": 8,
                                               "system_prompt_len": 1024, "question_len": 64})  # fmt: skip
    reuse = prefix_reuse(shared, 16)
    # 16 prompts of ~1,088 tokens: 14 repeat their group's 1,024-token system prompt
    assert 0.75 < reuse < 0.85


def _stats(policy: str, hit: float, p90: float) -> PolicyStats:
    return PolicyStats(policy, 100, 100, 0, hit, p90 / 2, p90, p90 * 2, 1.0, 2.0, 100.0, 0.1,
                       1.1, [50, 50], 1.0, 100.0)  # fmt: skip


def test_advice_explains_the_columns_names_the_policy_to_run_and_asks_for_more_kv() -> None:
    stats = [_stats("epp", 0.05, 0.8), _stats("oracle", 0.06, 0.5), _stats("random", 0.02, 2.0)]
    lines = advice(stats, 0.7, 1024, 16, "cache-aware")
    text = "\n".join(lines)
    for column in ("hit rate", "queue share", "imbalance", "rejected"):
        assert any(line.startswith(f"{column}: ") for line in lines), column
    assert "TTFT pred. error" not in text  # no column, no legend
    # the oracle knows what no router knows: the best deployable policy is named, with its config
    assert "best here: epp" in text and "2.50x" in text and "epp serve --config cache-aware" in text
    assert "--kv-blocks 4096" in text and "70.0%" in text
    roomy = advice([replace(s, hit_rate=0.6) for s in stats], 0.7, 1024, 16)
    assert not any("--kv-blocks" in line for line in roomy)
    assert "epp serve --config default" in "\n".join(roomy)


def test_a_small_cache_replay_suggests_kv_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["replay", "--workload", "shared-prefix", "--set", "num_groups=8",
                     "--set", "num_prompts_per_group=8", "--set", "system_prompt_len=2048",
                     "--set", "rate=50", "--replicas", "2", "--kv-blocks", "200", "--block-size", "16",
                     "--policies", "epp,random", "--no-progress"]) == 0  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert "what this trace could hit" in out and "best here:" in out
    assert "--kv-blocks 800" in out


def _replay(kv_blocks: int, out: Path) -> None:
    assert sim_main(["replay", "--workload", "chat", "--kv-blocks", str(kv_blocks), "--policies", "epp,random",
                     "--no-progress", "--out", str(out)]) == 0  # fmt: skip


def test_requests_larger_than_the_kv_cache_are_said_first_with_a_size_that_fits_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA's run: a chat workload on 40-block caches rejects every request. The replay says so
    before any figure, prints none for what nothing served, and names the least --kv-blocks
    that serves them all: with it nothing is rejected, with one block less something is."""
    _replay(40, tmp_path / "small.json")
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert flat.startswith("warning: every request of the trace needs more KV than a replica holds")
    assert "nothing was served" in flat
    assert "nan" not in out and "every policy recomputes" not in flat and "TTFT no policy beats" not in flat
    rows = [line for line in out.splitlines() if line.startswith(("│ epp", "│ random"))]
    assert len(rows) == 2
    for row in rows:  # no figure for nothing served, the rejections counted
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1:11] == ["-"] * 10 and cells[11] == "384", cells
    suggested = int(re.search(r"replay with --kv-blocks (\d+) or more", flat).group(1))  # type: ignore[union-attr]
    for blocks, rejected in ((suggested, 0), (suggested - 1, None)):
        _replay(blocks, tmp_path / f"{blocks}.json")
        results = json.loads((tmp_path / f"{blocks}.json").read_text())
        if rejected == 0:
            assert [r["rejected"] for r in results] == [0, 0]
            assert "warning:" not in capsys.readouterr().out
        else:
            assert all(r["rejected"] > 0 for r in results)
            assert "the table's figures are of the others" in " ".join(capsys.readouterr().out.split())
