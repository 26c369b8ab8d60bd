"""bench/report_replay_moves.py: the turns a policy moves off their cache in the replay, set
against what the emulated servers really held."""

from __future__ import annotations

from bench.bench_profiles import Point
from bench.report_replay_moves import main, one


def test_a_sticky_policy_moves_nothing_and_the_default_is_checked_against_the_caches() -> None:
    point = Point("chat", 12.0, 1024, 4)
    sticky = one(point, "epp:cache-aware", 0)
    # SGLang's rule holds every conversation on the replica of its system prompt
    assert sticky["moved"] == 0 and sticky["system_homes"] == 1.0 and sticky["index"] is None
    assert sum(sticky["per_replica"]) == sticky["later"] + 64  # 64 conversations' first turns
    spread = one(point, "epp:bench/configs/default-no-saturation.yaml", 0)
    assert spread["moved"] > spread["held"] > 0 and spread["lost_blocks"] > 0
    assert spread["system_homes"] > 1.0
    index = spread["index"]
    assert index is not None and index["level"] > index["below"] + index["above"]
    # every prompt token is prefilled at one of the three kinds of turn, or was cached
    assert abs(sum(spread["miss"].values()) + spread["hit"] - 1.0) < 0.02


def test_the_command_prints_a_line_per_policy_and_seed(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--seeds", "1", "--load", "4", "--policies", "epp,round-robin"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "chat at 4/s, 1024 KV blocks, 4 replicas"
    assert out[1].startswith("epp seed 0: hit ") and "index vs cache: below" in out[1]
    assert out[2].startswith("round-robin seed 0: ") and "index vs cache" not in out[2]


def test_over_six_system_prompts_the_sticky_rule_leaves_the_replicas_uneven() -> None:
    # 8 prompts split 2 a replica; 6 cannot split evenly over 4, and nothing ever moves
    sticky = one(Point("chat", 12.0, 1024, 4, system_prompts=6), "epp:cache-aware", 0)
    assert sticky["moved"] == 0 and sticky["system_homes"] == 1.0
    assert max(sticky["per_replica"]) >= 1.5 * min(sticky["per_replica"])
