"""``epp-sim calibrate --from-log``: a cost profile scaled until the replay of a loaded run
matches it (simulator/fitlog.py). A run made by the replay itself with known scales is
fitted back to those scales."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
import yaml

from simulator.cli import main as sim_main
from simulator.fitlog import (
    MISS_GRID,
    NOISE_GRID,
    STALL_GRID,
    StackRun,
    fit_scales,
    live_figures,
    replay_policy_for,
    scaled,
    stack_rows,
)
from simulator.model.cost import CostModel, CostProfile, dump_profile
from simulator.replay.convert import convert
from simulator.replay.policies import policy_factory
from simulator.replay.replayer import ReplayConfig, Replayer
from simulator.replay.requestlog import RequestLog

BASE = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.0002, prefill_per_cached_token_s=0.000002,
                 decode_base_s=0.01, decode_per_seq_s=0.005)  # fmt: skip
TRUE_PREFILL, TRUE_DECODE = 2.0, 2.83


def skeleton(tmp_path: Path, users: int = 12, policy: str = "round-robin") -> Path:
    """A stack log's shape: ``users`` users, 4 at a time, 3 turns each (times filled in later)."""
    rows = []
    for user in range(users):
        for turn in range(3):
            rows.append({"policy": policy, "round": 0, "user": user, "turn": turn, "group": user % 3,
                         "start_s": user // 4 * 30.0 + user * 0.01 + turn * 9.0, "e2e_s": 8.0, "status": 200,
                         "prompt_tokens": 900 + 150 * turn, "completion_tokens": 24, "upstream": f"s{user % 2}"})  # fmt: skip
    path = tmp_path / "skeleton.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def live_run(tmp_path: Path, noise: float = 0.0, stalls: tuple[float, float] = (0.0, 0.0),
             users: int = 12, policy: str = "round-robin", prefill: float = TRUE_PREFILL,
             miss: float = 1.0) -> Path:  # fmt: skip
    """The skeleton replayed with ``policy`` and the base costs scaled by the true factors
    (``prefill`` for the prefill costs, an uncached token's ``miss`` times more; ``noise`` as
    the steps' noise), written back as the stack's request log: what a loaded server would
    have logged."""
    shape = skeleton(tmp_path, users, policy)
    log = tmp_path / "as-log.jsonl"
    converted = list(convert("stack", shape))
    log.write_text("".join(json.dumps(r) + "\n" for r in converted))
    name, factory = policy_factory(policy)
    shaped = dataclasses.replace(BASE, prefill_per_token_s=BASE.prefill_per_token_s * miss)
    cost = dataclasses.replace(scaled(shaped, prefill, TRUE_DECODE), step_noise=noise,
                               host_stall_rate_hz=stalls[0], host_stall_s=stalls[1])  # fmt: skip
    cfg = ReplayConfig(replicas=2, kv_blocks=512, block_size_tokens=32, cost=cost, seed=7)
    result = Replayer(cfg).run(RequestLog.load(log), factory, name)
    by_order = sorted(converted, key=lambda r: r["timestamp"])
    rows = []
    for o in result.outcomes:
        row = by_order[int(o.request_id[1:])]
        user, turn = (int(x) for x in row["id"][1:].split("t"))
        rows.append({"policy": policy, "round": 0, "user": user, "turn": turn, "group": user % 3,
                     "start_s": o.arrival_s, "ttft_s": o.first_token_s - o.arrival_s, "e2e_s": o.finish_s - o.arrival_s,
                     "status": 200, "upstream": f"s{o.replica}", "prompt_tokens": o.prompt_tokens,
                     "cached_tokens": o.cached_tokens, "completion_tokens": o.output_tokens})  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_run_replayed_at_known_scales_is_fitted_back_to_them(tmp_path: Path) -> None:
    path = live_run(tmp_path)
    run = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin")
    live = live_figures(stack_rows(path), "round-robin", 0)
    fit = fit_scales(BASE, [(live, run.figures)])
    assert fit.prefill_scale == pytest.approx(TRUE_PREFILL, rel=0.1)
    assert fit.decode_scale == pytest.approx(TRUE_DECODE, rel=0.1)
    assert all(abs(e) < 0.05 for e in live.errors(fit.replayed[0]))


def test_step_noise_is_fitted_where_the_run_had_some_and_not_where_it_had_none(tmp_path: Path) -> None:
    """--fit-noise: the steps of a run made with noisy steps are fitted noisy, those of a run
    with exact steps exactly (the replays use another seed than the run)."""
    for noise, folder in ((0.0, "exact"), (0.75, "noisy")):
        (tmp_path / folder).mkdir()
        path = live_run(tmp_path / folder, noise)
        run = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin")
        live = live_figures(stack_rows(path), "round-robin", 0)
        fit = fit_scales(BASE, [(live, run.figures)], NOISE_GRID)
        assert (fit.cost.step_noise > 0) == (noise > 0), (noise, fit.cost.step_noise)
        assert fit.replays > len(NOISE_GRID) * 49


def test_host_stalls_are_fitted_where_the_run_had_some_and_not_where_it_had_none(tmp_path: Path) -> None:
    """--fit-stalls: a run made on a host that stalls (1 a second, 0.4 s each) is fitted with
    stalls, one made without them without (the run is made with seed 7, the fit's replays
    with seed 0: another draw of the same process)."""
    for stalls, folder in (((0.0, 0.0), "exact"), ((1.0, 0.4), "stalled")):
        (tmp_path / folder).mkdir()
        path = live_run(tmp_path / folder, stalls=stalls, users=48)
        run = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin")
        live = live_figures(stack_rows(path), "round-robin", 0)
        fit = fit_scales(BASE, [(live, run.figures)], stalls=STALL_GRID[5::5])  # 0.5/s of 0.2 s .. 2/s of 0.8 s
        got = fit.cost.host_stall_rate_hz * fit.cost.host_stall_s
        assert (got > 0) == (stalls[0] > 0), (stalls, fit.cost)


def test_an_uncached_tokens_own_cost_is_fitted_from_the_runs_wall_time(tmp_path: Path) -> None:
    """--fit-miss-cost: a run whose uncached tokens cost 3x what the base says against its
    other prefill costs is fitted back to 3x, with the prefill and decode scales it was made
    with; a run made with the base's shape keeps it (factor 1)."""
    for miss, folder in ((1.0, "shape"), (3.0, "misses")):
        (tmp_path / folder).mkdir()
        path = live_run(tmp_path / folder, miss=miss, users=24)
        run = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin")
        live = live_figures(stack_rows(path), "round-robin", 0)
        assert live.wall_s > 30
        fit = fit_scales(BASE, [(live, run.figures)], misses=MISS_GRID)
        assert fit.miss_scale == miss, (miss, fit)
        assert fit.prefill_scale == pytest.approx(TRUE_PREFILL, rel=0.1)
        assert fit.decode_scale == pytest.approx(TRUE_DECODE, rel=0.1)
        assert fit.cost.prefill_per_token_s == pytest.approx(BASE.prefill_per_token_s * miss * TRUE_PREFILL, rel=0.1)


def test_the_command_writes_the_fitted_profile_and_names_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = live_run(tmp_path)
    base = tmp_path / "probe.yaml"
    base.write_text(dump_profile(CostProfile("probe", BASE, "a test", {"kv_blocks": 512, "block_size": 32})))
    out = tmp_path / "fitted.yaml"
    assert sim_main(["calibrate", "--from-log", str(path), "--profile", str(base), "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["cost"]["decode_per_seq_s"] == pytest.approx(BASE.decode_per_seq_s * TRUE_DECODE, rel=0.1)
    assert "scaled to the run 'round-robin'" in doc["source"] and doc["server"]["kv_blocks"] == 512
    printed = capsys.readouterr().out
    assert "round 0: TTFT p50" in printed and "the run " in printed  # its wall time, live / replayed
    assert sim_main(["calibrate", "--from-log", str(path), "--profile", str(base), "--out", str(out),
                     "--fit-miss-cost"]) == 0  # fmt: skip
    doc = yaml.safe_load(out.read_text())  # made with the base's shape: the uncached token keeps its cost
    assert doc["cost"]["prefill_per_token_s"] == pytest.approx(BASE.prefill_per_token_s * TRUE_PREFILL, rel=0.1)
    packed = path.with_name("requests.jsonl.gz")  # a run kept gzipped fits as it is
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert sim_main(["calibrate", "--from-log", str(packed), "--profile", str(base), "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["cost"]["decode_per_seq_s"] == pytest.approx(
        BASE.decode_per_seq_s * TRUE_DECODE, rel=0.1)
    capsys.readouterr()
    for argv, reason in (
        (["--profile", str(base), "--run", "sglang"], "no run of 'sglang' in round 0"),
        (["--profile", str(base), "--round", "x"], "--round expects a round number"),
        ([], "--from-log needs --profile"),
    ):
        assert sim_main(["calibrate", "--from-log", str(path), "--out", str(out), *argv]) == 2
        assert reason in capsys.readouterr().err


def test_several_policies_runs_are_fitted_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--run twice: the loss sums over both policies' runs. Runs made with prefill x1.5
    (round-robin) and x3 (least-load) are each fitted back alone; fitted together, the scale
    lies between the two."""
    logs = []
    for policy, prefill in (("round-robin", 1.5), ("least-load", 3.0)):
        (tmp_path / policy).mkdir()
        logs.append(live_run(tmp_path / policy, policy=policy, prefill=prefill))
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(p.read_text() for p in logs))
    base = tmp_path / "probe.yaml"
    base.write_text(dump_profile(CostProfile("probe", BASE, "a test", {"kv_blocks": 512, "block_size": 32})))
    got = {}
    for runs in (("round-robin",), ("least-load",), ("round-robin", "least-load")):
        out = tmp_path / f"{'+'.join(runs)}.yaml"
        argv = ["calibrate", "--from-log", str(path), "--profile", str(base), "--out", str(out)]
        assert sim_main([*argv, *(x for run in runs for x in ("--run", run))]) == 0
        doc = yaml.safe_load(out.read_text())
        got[runs] = doc["cost"]["prefill_per_token_s"] / BASE.prefill_per_token_s
    printed = capsys.readouterr().out
    assert got[("round-robin",)] == pytest.approx(1.5, rel=0.15), got
    assert got[("least-load",)] == pytest.approx(3.0, rel=0.15), got
    assert 1.5 * 1.1 < got[("round-robin", "least-load")] < 3.0 / 1.1, got
    assert "scaled to the runs 'round-robin' (round 0) and 'least-load' (round 0)" in doc["source"]
    assert "replayed as round-robin, least-load" in printed and "  least-load, round 0: TTFT p50" in printed
    argv += ["--run", "round-robin", "--run", "least-load", "--replay-policy", "random"]
    assert sim_main(argv) == 2
    assert "--replay-policy names how one run routed" in capsys.readouterr().err


def test_runs_map_to_the_replay_policy_that_routes_as_they_did() -> None:
    assert replay_policy_for("epp default") == "epp" and replay_policy_for("epp") == "epp"
    assert replay_policy_for("epp predicted-ttft") == "epp:predicted-ttft"
    assert replay_policy_for("SGLang router (via epp)") == "cache-aware"
    assert replay_policy_for("random (via epp)") == "random"
    with pytest.raises(ValueError, match="no shipped profile or config file named 'mine'"):
        replay_policy_for("epp mine")


VLLM_TTFT_EDGES = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, float("inf"))  # fmt: skip
"""vLLM 0.32's ``vllm:time_to_first_token_seconds`` buckets."""


def with_a_hop(path: Path, hop_s: float) -> Path:
    """The run as a client behind a router would have logged it (``hop_s`` more to every first
    token and answer), and beside it the demo.json the stack writes: the servers' own TTFT
    histogram, which no hop reaches, and their count."""
    import numpy as np

    rows = stack_rows(path)
    ttft = np.sort([r["ttft_s"] for r in rows])
    buckets = [["+Inf" if le == float("inf") else repr(le), int(np.searchsorted(ttft, le, side="right"))]
               for le in VLLM_TTFT_EDGES]  # fmt: skip
    (path.parent / "demo.json").write_text(json.dumps(
        {"replicas": 2, "runs": [{"policy": "round-robin", "round": 0, "server_ttft_buckets": buckets,
                                  "per_replica_requests": [30, 6]}]}))  # fmt: skip
    for r in rows:
        r["ttft_s"] += hop_s
        r["e2e_s"] += hop_s
        r["upstream"] = "router"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_servers_own_ttft_fits_the_servers_where_a_router_in_front_inflates_the_clients(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """--measure server: fitted to the servers' TTFT histogram (the replay's binned alike), the
    scales come back near the truth though a router in front added 0.3 s to every first token
    the client saw; fitted to the client's, the prefill is scaled up to pay for the hop. The
    servers' count comes from demo.json: the log's one upstream is the router."""
    path = with_a_hop(live_run(tmp_path, users=24), 0.3)
    base = tmp_path / "probe.yaml"
    base.write_text(dump_profile(CostProfile("probe", BASE, "a test", {"kv_blocks": 512, "block_size": 32})))
    prefill = {}
    for measure in ("server", "client"):
        out = tmp_path / f"{measure}.yaml"
        argv = ["calibrate", "--from-log", str(path), "--profile", str(base), "--out", str(out), "--measure", measure]
        assert sim_main(argv) == 0
        assert f"by the {measure}'s TTFT" in capsys.readouterr().out
        prefill[measure] = yaml.safe_load(out.read_text())["cost"]["prefill_per_token_s"] / BASE.prefill_per_token_s
    assert prefill["server"] == pytest.approx(TRUE_PREFILL, rel=0.25), prefill
    assert prefill["client"] > 1.3 * prefill["server"], prefill
    (tmp_path / "demo.json").unlink()
    assert sim_main(["calibrate", "--from-log", str(path), "--profile", str(base), "--out", str(tmp_path / "x.yaml"),
                     "--measure", "server"]) == 2  # fmt: skip
    assert "demo.json: not found" in capsys.readouterr().err


def test_a_replay_read_through_histogram_buckets_reads_as_prometheus_would(tmp_path: Path) -> None:
    from simulator.stack.report import histogram_quantile

    path = live_run(tmp_path)
    exact = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin")
    binned = StackRun(path, "round-robin", 0, 2, 512, 32, "round-robin", VLLM_TTFT_EDGES)
    outcomes = exact.run(BASE).outcomes
    import numpy as np

    ttft = np.sort([o.first_token_s - o.arrival_s for o in outcomes])
    buckets = [(le, int(np.searchsorted(ttft, le, side="right"))) for le in VLLM_TTFT_EDGES]
    got = binned.figures(BASE)
    assert got.ttft_p90_s == histogram_quantile(buckets, 0.9)
    assert got.ttft_p50_s == histogram_quantile(buckets, 0.5)
    assert got.tpot_p50_s == exact.figures(BASE).tpot_p50_s
    assert got.busiest_share == 0.5  # round-robin: the busiest server served half


def test_the_servers_split_of_a_run_is_read_live_and_replayed(tmp_path: Path) -> None:
    """How a run's requests split between the servers: live from demo.json's per-server
    counts (the log's one upstream is the router), replayed from the replicas picked."""
    from simulator.fitlog import run_summaries, server_figures

    path = with_a_hop(live_run(tmp_path), 0.1)
    live, _ = server_figures(run_summaries(path), stack_rows(path), "round-robin", 0)
    assert live.busiest_share == pytest.approx(30 / 36)
    replayed, _ = StackRun(path, "round-robin", 0, 2, 512, 32, "random").replay(BASE)
    assert 0.5 <= replayed.busiest_share < 1.0
