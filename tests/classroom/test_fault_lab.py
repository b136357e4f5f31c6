"""The fault lab (classroom/fault_lab.py): a run killed again and again restarts itself from its newest
complete checkpoint, reports what each failure cost, and ends with the uninterrupted run's loss; its
verdict holds the steps recomputed to Young/Daly's expectation. CI runs a bounded lab (2 kills, one
process); the tutorial's 20-kill tables are made by the same command (tutorial.md chapter 8)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from nanohlat.classroom import fault_lab


def test_the_kills_are_drawn_from_the_seed_and_come_one_after_another():
    plan = fault_lab.kill_plan(20, 6.0, 0, 4)
    assert plan == fault_lab.kill_plan(20, 6.0, 0, 4) != fault_lab.kill_plan(20, 6.0, 1, 4)
    steps = [s for _, s in plan]
    assert steps == sorted(set(steps)) and steps[0] >= 1 and all(0 <= r < 4 for r, _ in plan)
    assert 3 < (steps[-1] - steps[0]) / 19 < 12   # gaps of mean 6 (exponential), at least 1


def test_the_expectation_and_its_tolerance_by_hand():
    # --save-every 4: a kill at the end of step c+1 .. c+4 loses 1..4 steps, mean 2.5; their standard
    # deviation is sqrt((16 - 1) / 12) = 1.118, three standard errors of 20 kills 3 x 1.118 / sqrt(20) = 0.75
    mean, tol = fault_lab.expected(4, 20)
    assert mean == 2.5 and tol == pytest.approx(0.75, abs=1e-3)


def _records(kills: list[tuple[int, int, int]], final: float) -> list[dict]:
    """A faulted run's records: (resumed from, steps recomputed, seconds lost) per restart, the last loss."""
    out = [{"step": 9, "loss": final, "tokens": 9 * 256, "tokens_per_s": 2560.0}]
    for i, (c, n, s) in enumerate(kills, 1):
        out += [{"step": c, "restart": i, "steps_recomputed": n}, {"step": c, "recovered": i, "seconds_lost": s}]
    return out


def test_the_verdict_fails_when_the_lost_work_or_the_final_loss_is_off(capsys):
    ref = [{"step": 9, "loss": 5.0, "tokens": 9 * 256, "tokens_per_s": 2560.0}]
    plan = [(0, 3), (0, 6)]
    assert fault_lab.report(plan, 2, 9, ref, _records([(2, 1, 4.0), (4, 2, 5.0)], 5.0)) == 0
    out = capsys.readouterr().out
    assert "3 in all, 1.50 per kill" in out and "the same, bit for bit" in out and "9.0 in all" in out
    assert fault_lab.report(plan, 2, 9, ref, _records([(2, 1, 4.0), (4, 2, 5.0)], 5.0001)) == 1   # another loss
    assert fault_lab.report(plan, 2, 9, ref, _records([(2, 9, 4.0), (4, 9, 5.0)], 5.0)) == 1      # far too much
    assert "NO" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_killed_twice_restarts_itself_and_ends_as_the_uninterrupted_one(cache_dir, tmp_path):
    cmd = [sys.executable, "-m", "nanohlat.classroom", "fault", str(tmp_path), "--kills", "2", "--gap", "3", "--",
           "--preset", "tiny", "--save-every", "2", "--eval-every", "0", "--threads", "1", "--cache-dir", cache_dir]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("     ") and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2], done.stdout
    for (_, rank, step, resumed, recomputed, seconds), (r, s) in zip(rows, fault_lab.kill_plan(2, 3.0, 0, 1)):
        assert (int(rank), int(step)) == (r, s) and int(resumed) == (s - 1) // 2 * 2 and int(recomputed) == s - int(resumed)
        assert float(seconds) > 0
    assert any("the same, bit for bit" in line for line in lines), done.stdout
    summary = (tmp_path / "faulted" / "summary.json").read_text()
    assert '"restarts": 2' in summary, summary
