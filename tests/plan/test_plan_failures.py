"""The interval that loses least (plan/failures.py): Young's formula on numbers worked by hand, a
checkpoint's bytes per rank by hand, HLAT-7B's row of --plan worked out from its inputs, and
--save-every auto. (The bytes per rank are also held to the shards real runs write:
tests/run/test_stragglers.py, tests/run/test_async_checkpoints.py.)"""

from __future__ import annotations

import math

import pytest

from nanohlat import plan, recipe


def test_youngs_interval_and_the_time_lost_on_numbers_worked_by_hand():
    # a save of 60 s, a cluster failing every 30 h = 108,000 s: tau* = sqrt(2 x 60 x 108,000) = sqrt(12,960,000)
    assert plan.optimal_interval(60, 108_000) == pytest.approx(3600, rel=1e-12)
    # at the optimum the two terms are equal: 60 / 3600 + 3600 / (2 x 108,000) = 1/60 + 1/60 = 1/30
    assert plan.lost_fraction(3600, 60, 108_000) == pytest.approx(1 / 30, rel=1e-12)
    # half the interval: saving costs twice as much, rework half: 60/1800 + 1800/216,000 = 1/30 + 1/120 = 1/24
    assert plan.lost_fraction(1800, 60, 108_000) == pytest.approx(1 / 24, rel=1e-12)
    # twice the interval: 1/120 + 1/30 = 1/24 too (the loss is flat near the optimum, symmetric in log tau)
    assert plan.lost_fraction(7200, 60, 108_000) == pytest.approx(1 / 24, rel=1e-12)
    # --async-save: a 2 s stall, 100 h = 360,000 s: sqrt(2 x 2 x 360,000) = 1,200 s; a checkpoint complete
    # 30 s after its snapshot adds 30 s to each failure's rework: 2/1200 + (600 + 30)/360,000 = 0.0034166...
    assert plan.optimal_interval(2, 360_000) == pytest.approx(1200, rel=1e-12)
    assert plan.lost_fraction(1200, 2, 360_000, durable_after_s=30) == pytest.approx(1 / 600 + 630 / 360_000)


def _cfg(*argv):
    return recipe.parse_args(list(argv))


def test_a_checkpoints_bytes_per_rank_by_hand():
    """tiny: 250,432 parameters (padded vocabulary), fp32: 4 B of weight + 12 B of master and moments each."""
    model, tcfg = _cfg("--preset", "tiny")
    assert model.num_params() == 250_432
    assert plan.checkpoint_bytes(model, tcfg) == {"weights": 1_001_728, "optimizer": 3_005_184, "total": 4_006_912}
    assert plan.rank_bytes(model, tcfg, 1, 0) == 4_006_912
    # dp 2 without ZeRO: rank 0 writes everything, rank 1 nothing; with --zero 1 each rank half the state
    _, dp2 = _cfg("--preset", "tiny", "--dp", "2")
    assert [plan.rank_bytes(model, dp2, 2, r) for r in (0, 1)] == [4_006_912, 0]
    _, z1 = _cfg("--preset", "tiny", "--dp", "2", "--zero", "1")
    assert [plan.rank_bytes(model, z1, 2, r) for r in (0, 1)] == [1_001_728 + 1_502_592, 1_502_592]
    # bf16-sr with bf16 moments: 2 B of weight, 4 B of fp32 master (export_state) and 2 x 2 B of moments
    _, sr = _cfg("--preset", "tiny", "--precision", "bf16-sr", "--moments", "bf16")
    assert plan.checkpoint_bytes(model, sr)["total"] == 250_432 * 10
    # --async-save holds rank 0's shard in host memory while it is written
    _, a = _cfg("--preset", "tiny", "--async-save")
    assert plan.snapshot_bytes(model, a, 1) == 4_006_912 and plan.snapshot_bytes(model, tcfg, 1) == 0


def test_hlat_7b_on_64_trn1_nodes_worked_out():
    """HLAT-7B on 2048 NeuronCores (64 trn1.32xlarge of 32): without ZeRO, dp rank 0's 8 tp ranks (all in
    node 0) write its 6,738,415,616 parameters x 10 B; one node fails every 6,335 h."""
    model, tcfg = _cfg("--preset", "hlat-7b", "--save-every", "1000")
    p = plan.interval_plan(model, tcfg, 2048, "NeuronCore-v2")
    total = 6_738_415_616 * 10
    save, mtbf = total / 1e9, 6335 * 3600 / 64   # 67.38 s at 1 GB/s; 356,343.75 s = 98.98 h
    assert (p["nodes"], p["node"], p["writers"], p["node_bytes"]) == (64, 0, 8, total)
    assert p["save"] == pytest.approx(save) and p["mtbf"] == pytest.approx(mtbf)
    best = math.sqrt(2 * save * mtbf)             # ~6,930 s, ~1.9 h
    assert p["optimal_s"] == pytest.approx(best) and 6900 < best < 6960
    assert p["optimal_steps"] == round(best / p["step"])
    assert p["lost_chosen"] == pytest.approx(save / (1000 * p["step"]) + 1000 * p["step"] / (2 * mtbf))
    text = plan.report(model, tcfg, 2048)
    assert "failures and the checkpoint interval" in text and "98.98 h" not in text   # (shown as 99.0 h)
    row = next(line for line in text.splitlines() if line.startswith("  NeuronCore-v2 ") and "GiB (8 ranks)" in line)
    assert " 99.0 h " in row and "62.76 GiB" in row and f"{p['optimal_steps']:,} steps" in row
    # with ZeRO-1 every rank writes 1/256 of the state: node 0 writes the weights (8 x 1/8) and 32 shares
    _, z1 = _cfg("--preset", "hlat-7b", "--zero", "1")
    q = plan.interval_plan(model, z1, 2048, "NeuronCore-v2")
    per_rank_state = 6_738_415_616 // 8 * 8 / 256
    assert q["node_bytes"] == pytest.approx(6_738_415_616 * 2 + 32 * per_rank_state, rel=1e-6)
    assert q["optimal_steps"] < p["optimal_steps"]


def test_save_every_auto_is_youngs_interval_and_said_once():
    model, tcfg = _cfg("--preset", "tiny", "--save-every", "auto")
    assert tcfg.save_every == recipe.SAVE_EVERY_AUTO
    resolved, note = plan.resolve_save_every(model, tcfg, 1, "cpu")
    p = plan.interval_plan(model, tcfg, 1, "cpu")
    assert resolved.save_every == p["optimal_steps"] >= 1
    assert note.startswith(f"--save-every auto: every {p['optimal_steps']:,} steps = sqrt(2 x ")
    same, none = plan.resolve_save_every(model, _cfg("--preset", "tiny", "--save-every", "3")[1], 1, "cpu")
    assert same.save_every == 3 and none == ""
