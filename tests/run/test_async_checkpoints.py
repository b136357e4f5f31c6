"""--async-save (run/checkpoint/background.py): checkpoints written by a writer thread while training
goes on are the same checkpoints, give bit-identical losses, wait for each other, survive a full disk
and a kill -9 in the middle of a background write.

One process in fp32 on the CPU is deterministic, so a run with --async-save must log exactly the
losses of one without, and a run resumed from one of its checkpoints those of the uninterrupted run
(test_checkpoint.py's standard). The faults are run/faults.py's (NANOHLAT_FAULTS), which the fault
lab uses too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, read_metrics

STEPS = 6
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
        "--warmup-steps", "2", "--no-progress", "--threads", "1", "--save-every", "2"]


def flags(cache_dir, out_dir, *extra):
    return BASE + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + [str(e) for e in extra]


def losses(out_dir) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(str(out_dir))}


def ckpts(out_dir) -> list[str]:
    return sorted(os.listdir(os.path.join(str(out_dir), "checkpoints")))


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """A run saving every 2 steps synchronously, and the same with --async-save (in this process)."""
    import train
    root = tmp_path_factory.mktemp("async")
    for name, extra in (("sync", ()), ("async", ("--async-save",))):
        assert train.main(flags(cache_dir, root / name, *extra)) == 0
    return root


def _shard(path: str) -> dict:
    return torch.load(os.path.join(path, "shard_00000.pt"), weights_only=False)


def test_background_checkpoints_are_the_same_checkpoints_and_losses(runs):
    """Same losses to the bit; every checkpoint the same step, the same tensors, the same manifest
    (but the time); summary.json counts the background saves and how long each stopped the steps."""
    assert losses(runs / "async") == losses(runs / "sync") and len(losses(runs / "sync")) == STEPS
    assert ckpts(runs / "async") == ckpts(runs / "sync") == ["latest", "step_00000002", "step_00000004",
                                                           "step_00000006"]
    for step in ("step_00000002", "step_00000004"):
        a, s = (str(runs / r / "checkpoints" / step) for r in ("async", "sync"))
        sa, ss = _shard(a), _shard(s)
        for section in ("model", "optim"):
            assert sa[section].keys() == ss[section].keys()
        for n, w in ss["model"].items():
            assert torch.equal(sa["model"][n], w), n
        for n, st in ss["optim"].items():
            assert all(torch.equal(sa["optim"][n][k], v) if torch.is_tensor(v) else sa["optim"][n][k] == v
                       for k, v in st.items()), n
        assert torch.equal(sa["rng"]["torch_cpu"], ss["rng"]["torch_cpu"])
        ma, ms = (json.load(open(os.path.join(p, "manifest.json"))) for p in (a, s))
        for m in (ma, ms):   # (but the time, and the two flags the runs differ by)
            del m["time"], m["config"]["train"]["async_save"], m["config"]["train"]["out_dir"]
        assert ma == ms
    summary = json.load(open(runs / "async" / "summary.json"))["checkpoints"]
    assert summary["async_saves"] == 2 and len(summary["stall_s"]) == 2 and summary["failed"] == 0
    assert len(summary["sync_stall_s"]) == 1     # the last step's save, at the end, is synchronous
    # the plan's bytes of rank 0's shard: its tensors; the file adds its metadata (names, the RNG, zip records)
    from nanohlat import plan, recipe
    model, tcfg = recipe.parse_args(flags("", runs / "async"))
    size = os.path.getsize(runs / "async" / "checkpoints" / "step_00000004" / "shard_00000.pt")
    assert 0 <= size - plan.rank_bytes(model, tcfg, 1, 0) <= 64 * 1024, size


def test_a_run_resumed_from_a_background_checkpoint_is_the_run(runs, cache_dir, tmp_path):
    import train
    assert train.main(flags(cache_dir, tmp_path, "--async-save", "--stop-after", 3)) == 0
    assert ckpts(tmp_path) == ["latest", "step_00000002", "step_00000003"]   # 2 in the background, 3 at the stop
    assert train.main(flags(cache_dir, tmp_path, "--async-save")) == 0
    assert losses(tmp_path) == losses(runs / "sync")


def test_a_save_due_while_one_is_being_written_waits_and_says_so(runs, cache_dir, tmp_path, monkeypatch, capfd):
    """A writer slowed to 0.4 s a shard, a save every step: each save waits for the one before (one in
    flight), one note says so, the losses do not change, every checkpoint is complete."""
    import train
    from nanohlat.run.checkpoint import background
    real = background.write_shard

    def slow(snap):
        time.sleep(0.4)
        return real(snap)
    monkeypatch.setattr(background, "write_shard", slow)
    assert train.main(flags(cache_dir, tmp_path, "--async-save", "--save-every", 1)) == 0
    err = capfd.readouterr().err
    notes = [line for line in err.splitlines() if "is still being written" in line]
    assert len(notes) == 1 and "waits for it" in notes[0], err
    summary = json.load(open(tmp_path / "summary.json"))["checkpoints"]
    assert summary["async_saves"] == 5 and len(summary["waited_s"]) == 4 and min(summary["waited_s"]) > 0.1
    assert losses(tmp_path) == losses(runs / "sync")
    assert ckpts(tmp_path) == ["latest", "step_00000004", "step_00000005", "step_00000006"]   # (--keep-last 3)


def test_a_full_disk_during_a_background_write_fails_that_save_and_training_goes_on(runs, cache_dir, tmp_path,
                                                                                     monkeypatch, capfd):
    """The disk fills half-way through step 4's shard, written in the background: one line names the file
    and the space, that save is gone (no step_4, no .tmp_ left), `latest` named step 2 until step 6's save,
    and the run trains on with the same losses, exit 0."""
    import train
    monkeypatch.setenv("NANOHLAT_FAULTS", "disk-full:step=4")
    assert train.main(flags(cache_dir, tmp_path, "--async-save")) == 0
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith(("warning", "error"))]
    assert len(err) == 1, err
    assert err[0].startswith("warning: cannot write checkpoint file ") and "shard_00000.pt" in err[0]
    assert "No space left on device" in err[0] and "step 4" in err[0] and "training goes on" in err[0], err
    assert ckpts(tmp_path) == ["latest", "step_00000002", "step_00000006"]
    assert losses(tmp_path) == losses(runs / "sync")
    assert json.load(open(tmp_path / "summary.json"))["checkpoints"]["failed"] == 1


@pytest.mark.slow
def test_kill_9_during_a_background_write_leaves_the_newest_complete_checkpoint(runs, cache_dir, tmp_path):
    """kill -9 of train.py half-way through the background write of step 4's shard: step 2 is the newest
    complete checkpoint (`latest`), loadable; step 4 is a `.tmp_` that nothing reads; --resume auto
    continues from step 2 with the uninterrupted run's losses, bit for bit."""
    env = dict(os.environ, PYTHONPATH=ROOT, NANOHLAT_FAULTS="kill-saving:step=4")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *flags(cache_dir, tmp_path, "--async-save")]
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    root = tmp_path / "checkpoints"
    assert open(root / "latest").read() == "step_00000002"
    assert sorted(os.listdir(root)) == [".tmp_step_00000004", "latest", "step_00000002"]
    assert [n for n in os.listdir(root / ".tmp_step_00000004") if n.endswith(".partial")]
    from nanohlat import recipe
    from nanohlat.run import checkpoint
    model, _ = recipe.parse_args(flags(cache_dir, tmp_path))
    checkpoint.check(str(root / "step_00000002"), model, checksums=True)   # complete, its checksums hold
    env.pop("NANOHLAT_FAULTS")
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step_00000002 at step 2" in resumed.stdout
    assert losses(tmp_path) == losses(runs / "sync")
    assert not [n for n in os.listdir(root) if n.startswith(".tmp_")]   # the next save removed the debris
