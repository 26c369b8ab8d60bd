"""``epp-sim calibrate`` against an emulated server whose cost model is known: the fit finds
it back (loosely: the figures are timings on a shared machine), and the profile it writes
drives the replay and the emulator (``--cost``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.calibrate import calibrate, calibrate_host, fit_linear
from simulator.cli import main as sim_main
from simulator.emulator import EmulatorConfig, start_emulator
from simulator.model.cost import CostModel, dump_profile, load_profile, presets

TRUE = CostModel(prefill_base_s=0.01, prefill_per_token_s=0.0002, prefill_per_cached_token_s=0.00001,
                 decode_base_s=0.02, decode_per_seq_s=0.001)  # fmt: skip


def test_the_fit_is_exact_on_exact_data() -> None:
    xs = [[u, c] for u in (100, 400, 900) for c in (0, 300)]
    ys = [0.5 + 0.002 * u + 0.0001 * c for u, c in xs]
    assert fit_linear(xs, ys) == pytest.approx([0.5, 0.002, 0.0001])
    with pytest.raises(ValueError, match="do not determine"):
        fit_linear([[1.0], [1.0]], [2.0, 2.0])


@pytest.mark.asyncio
async def test_calibrate_finds_the_emulators_cost_model_back(tmp_path: Path) -> None:
    emu = await start_emulator(EmulatorConfig(model="m", num_gpu_blocks=4096, block_size=16, cost=TRUE))
    try:
        profile = await calibrate(emu.url, [128, 1024], [1, 8], repeats=2, decode_tokens=24,
                                  progress=lambda _m: None)  # fmt: skip
    finally:
        await emu.close()
    c = profile.cost
    assert c.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.3)
    assert c.decode_base_s == pytest.approx(TRUE.decode_base_s, rel=0.3)
    assert 0.3 * TRUE.decode_per_seq_s < c.decode_per_seq_s < 2 * TRUE.decode_per_seq_s
    assert profile.server == {"kv_blocks": 4096, "block_size": 16}
    path = tmp_path / "m.yaml"
    path.write_text(dump_profile(profile))
    assert load_profile(str(path)) == profile
    # the profile drives the replay
    assert sim_main(["replay", "--workload", "chat", "--set", "num_sessions=4", "--policies", "epp",
                     "--no-progress", "--cost", str(path)]) == 0  # fmt: skip


@pytest.mark.asyncio
async def test_servers_that_do_not_share_a_host_show_no_slowdown(tmp_path: Path) -> None:
    """Two emulators (timed by the clock, not by CPU) probed alone then together: the ratio
    stays near 1, and the profile carries it as shared_host_slowdown."""
    emus = [await start_emulator(EmulatorConfig(model="m", num_gpu_blocks=4096, block_size=16, cost=TRUE))
            for _ in range(2)]  # fmt: skip
    try:
        profile, ratios = await calibrate_host([e.url for e in emus], [128, 1024], [1, 8], repeats=2,
                                               decode_tokens=24, progress=lambda _m: None)  # fmt: skip
    finally:
        for e in emus:
            await e.close()
    assert len(ratios) == 2 and all(0.7 < r < 1.5 for r in ratios)
    assert profile.cost.shared_host_slowdown == pytest.approx(max(0.0, sum(ratios) / 2 - 1))
    assert profile.cost.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.3)
    assert "alone, then together" in profile.source
    path = tmp_path / "host.yaml"
    path.write_text(dump_profile(profile))
    assert load_profile(str(path)).cost == profile.cost


def test_presets_and_bad_profiles(tmp_path: Path) -> None:
    assert "a100-llama3-8b" in presets()
    assert load_profile("a100-llama3-8b").cost == CostModel()  # the shipped default, as data
    bad = tmp_path / "bad.yaml"
    bad.write_text("cost: {prefill_per_token_s: fast}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: cost\.prefill_per_token_s must be a number"):
        load_profile(str(bad))
    bad.write_text("cost: {warp_speed: 1}\n")
    with pytest.raises(ValueError, match="no field 'warp_speed'"):
        load_profile(str(bad))
    bad.write_text("cost: {shared_host_slowdown: -0.5}\n")
    with pytest.raises(ValueError, match="shared_host_slowdown' must be >= 0"):
        load_profile(str(bad))
    bad.write_text("cost: {shared_host_slowdown: lots}\n")
    with pytest.raises(ValueError, match=r"shared_host_slowdown must be a number, got"):
        load_profile(str(bad))
    with pytest.raises(ValueError, match="not a preset"):
        load_profile("h200-nowhere")
