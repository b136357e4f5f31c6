"""Hostile out-dirs and full disks (docs/robustness.md; the shared helpers: hostile.py): one run
per out-dir, held by a lock that outlives a dead launcher's workers; out-dirs that cannot hold a run;
a disk that fills at the metrics, at a checkpoint, under a Hugging Face export or import: one line,
exit 2, and nothing trained lost or half-written."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hostile import ckpt, flags, losses, main_in_process, one_line_error, saved_step, _export
from hostile import base, run_copy  # (fixtures: pytest finds them where they are imported)


# ---------------------------------------------------------------------------
# One run per out-dir; out-dirs that are not runs; nothing left behind
# ---------------------------------------------------------------------------

def test_a_held_out_dir_is_refused_with_the_holders_pid(run_copy, cache_dir, capsys):
    from nanohlat.run import checkpoint, runlock
    lock = runlock.acquire(str(run_copy))        # another run (an flock on another open file: it conflicts)
    try:
        code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6), capsys)
        assert code == 2
        one_line_error(err, "is in use by another run", f"PID {os.getpid()}")
        assert checkpoint.latest(str(run_copy)) == ckpt(run_copy, 4)     # untouched
    finally:
        lock.release()
    # a lock file left by a dead process holds no flock: it is taken over
    (run_copy / "run.lock").write_text("999999999\n")
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6), capsys)
    assert code == 0, err
    assert sorted(losses(run_copy)) == [1, 2, 3, 4, 5, 6]


def test_a_new_run_waits_for_the_workers_of_a_dead_launcher(tmp_path, monkeypatch):
    """run.lock names a launcher that is gone, but its workers still hold the lock
    (shared, as `--nproc N` workers do): a new run waits for them, and takes the lock
    once they are gone; if they stay, it says so in one line (UserError)."""
    import fcntl
    import threading
    from nanohlat.config import UserError
    from nanohlat.run import runlock
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text("999999999\n")       # no such process
    worker = os.open(out / "run.lock", os.O_RDWR)         # another open file: a worker's shared lock
    fcntl.flock(worker, fcntl.LOCK_SH)
    threading.Timer(0.5, os.close, (worker,)).start()     # the worker dies half a second later
    runlock.acquire(str(out)).release()
    worker = os.open(out / "run.lock", os.O_RDWR)
    fcntl.flock(worker, fcntl.LOCK_SH)
    os.pwrite(worker, b"999999999\n", 0)
    monkeypatch.setattr(runlock, "WAIT_FOR_ORPHANS_S", 0.3)
    try:
        with pytest.raises(UserError, match=r"still held by the workers of a run whose launcher \(PID 999999999\)"):
            runlock.acquire(str(out))
    finally:
        os.close(worker)


def test_a_run_killed_before_its_first_step_does_not_block_resume_never(tmp_path, cache_dir, capsys):
    """kill -9 before step 1 leaves config.json and an empty metrics.jsonl (no
    cleanup runs); nothing was trained, so a retry with --resume never starts."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    code, err = main_in_process(flags(cache_dir, out, "--resume", "never", "--steps", 2), capsys)
    assert code == 0, err
    assert sorted(losses(out)) == [1, 2]


@pytest.mark.parametrize("device", ["cuda", "xla"])
def test_overwrite_asking_for_a_missing_device_keeps_the_old_run(device, run_copy, cache_dir, capsys):
    """--resume never --overwrite removes the old run only once the new one can
    start: a device this machine lacks is refused first, and the old run stays."""
    import importlib.util
    import torch
    if (torch.cuda.is_available() if device == "cuda" else importlib.util.find_spec("torch_xla") is not None):
        pytest.skip(f"this machine has {device}")
    before = sorted(os.listdir(run_copy / "checkpoints"))
    code, err = main_in_process(flags(cache_dir, run_copy, "--resume", "never", "--overwrite", "--device", device),
                                capsys)
    assert code == 2
    one_line_error(err, f"--device {device}")
    assert sorted(os.listdir(run_copy / "checkpoints")) == before and len(losses(run_copy)) == 4


@pytest.mark.parametrize("kind", ["a file", "not writable", "foreign files", "a Hugging Face config.json"])
def test_an_out_dir_that_cannot_hold_a_run_is_one_line(kind, tmp_path, cache_dir, capsys):
    out = tmp_path / "out"
    if kind == "a file":
        out.write_text("notes")
    elif kind == "not writable":
        out = "/sys/nanohlat-test-run"       # sysfs: even root cannot create folders there
    elif kind == "foreign files":
        out.mkdir()
        (out / "thesis.tex").write_text("...")
    else:
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, err = main_in_process(flags(cache_dir, out), capsys)
    assert code == 2
    one_line_error(err, str(out))
    if kind in ("foreign files", "a Hugging Face config.json"):
        assert "not a nanohlat run" in err
        assert sorted(os.listdir(out)) in (["thesis.tex"], ["config.json"])
    if kind == "a file":
        assert out.read_text() == "notes"


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json"])
def test_a_folder_where_a_run_file_should_be_is_one_line(name, tmp_path, cache_dir, capsys):
    """metrics.jsonl/ received metrics.jsonl/metrics.jsonl, exit 0: now refused before anything is written."""
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    code, err = main_in_process(flags(cache_dir, out), capsys)
    assert code == 2
    one_line_error(err, str(out / name), "is a folder")
    assert os.listdir(out) == [name] and os.listdir(out / name) == []


def test_disk_full_at_metrics_and_at_the_checkpoint_leaves_nothing(tmp_path, cache_dir, capsys, monkeypatch):
    """Neither the metrics file nor the checkpoint of step 2 can be written (ENOSPC):
    one line naming metrics.jsonl and the shard, exit 2, and the out-dir the run
    created is gone again (nothing trained was kept), so `--resume never` is not refused later."""
    import errno
    from nanohlat.run import trainlog
    from nanohlat.run.checkpoint import saving
    out = tmp_path / "run"

    def full(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(str(out), "metrics.jsonl"))
    real = saving._atomic_write

    def full_save(path, write):
        if ".tmp_step_" not in path:
            return real(path, write)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(trainlog.MetricsWriter, "write", full)
    monkeypatch.setattr(saving, "_atomic_write", full_save)
    code, err = main_in_process(flags(cache_dir, out), capsys)
    assert code == 2
    one_line_error(err, f"cannot write {str(out / 'metrics.jsonl')!r}: No space left on device",
                   "the run stopped at step 2 and could not save it either", "shard_00000.pt")
    assert not out.exists()
    monkeypatch.undo()
    code, err = main_in_process(flags(cache_dir, out, "--resume", "never"), capsys)
    assert code == 0, err


class _FullAfter:
    """A text file that takes `lines` writes, then raises ENOSPC as a full disk does
    (the file object's OSError names no file)."""

    def __init__(self, f, lines: int):
        self.f, self.left = f, lines

    def write(self, text):
        if self.left <= 0:
            import errno
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= 1
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_disk_full_at_metrics_saves_what_was_trained(tmp_path, cache_dir, capsys, monkeypatch):
    """metrics.jsonl takes 3 rows, then the disk is full: the run does not drop its
    trained steps. Every rank stops at the next step, saves it, and the run ends with
    one line naming metrics.jsonl and the checkpoint, exit 2; --resume auto goes on."""
    from nanohlat.system import files
    out = tmp_path / "run"
    real = files.open_append
    monkeypatch.setattr(files, "open_append", lambda path: _FullAfter(real(path), 3))
    code, err = main_in_process(flags(cache_dir, out, "--steps", 8), capsys)
    assert code == 2
    one_line_error(err, f"cannot write {str(out / 'metrics.jsonl')!r}: No space left on device",
                   f"the run stopped at step 5 and saved what it trained in {ckpt(out, 5)}", "--resume auto")
    assert saved_step(out) == 5 and sorted(losses(out)) == [1, 2, 3]
    monkeypatch.undo()
    code, err = main_in_process(flags(cache_dir, out, "--steps", 8), capsys)
    assert code == 0, err
    assert sorted(losses(out)) == [1, 2, 3, 6, 7, 8]     # rows 4 and 5 could not be written


def test_disk_full_while_saving_is_one_line_and_keeps_the_previous_checkpoint(run_copy, cache_dir, capsys,
                                                                              monkeypatch):
    import errno
    from nanohlat.run import checkpoint
    from nanohlat.run.checkpoint import saving

    real = saving._atomic_write

    def full(path, write):
        if ".tmp_step_" not in path:
            return real(path, write)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    monkeypatch.setattr(saving, "_atomic_write", full)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6), capsys)
    assert code == 2
    one_line_error(err, "shard_00000.pt", "No space left on device")
    monkeypatch.undo()
    assert checkpoint.latest(str(run_copy)) == ckpt(run_copy, 4)
    checkpoint.ShardSet(ckpt(run_copy, 4))


def test_hf_export_onto_a_full_disk_leaves_hf_dir_as_it_was(base, tmp_path, capsys, monkeypatch):
    """The weights do not fit: one line naming the file, exit 2, no HF_DIR (nor its
    temporary) left, so the retry is not refused as "not empty"."""
    import errno
    from nanohlat.system import files
    from nanohlat.serving import hf
    real = files.atomic_write

    def full(path, write):
        if path.endswith("model.safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, write)
    monkeypatch.setattr(files, "atomic_write", full)
    hf_dir = tmp_path / "hf"
    assert _export(["export", str(base), str(hf_dir)]) == 2
    one_line_error(capsys.readouterr().err, "model.safetensors", "No space left on device", "left as it was")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert _export(["export", str(base), str(hf_dir)]) == 0
    assert sorted(os.listdir(hf_dir)) == sorted(hf.EXPORT_FILES)


@pytest.mark.parametrize("out_exists", [False, True])
def test_hf_import_onto_a_full_disk_leaves_nothing(base, tmp_path, capsys, monkeypatch, out_exists):
    """torch.save's RuntimeError around ENOSPC while the shard is written: one line
    naming the checkpoint's temporary folder, exit 2; no run.lock, tokenizer.model
    or .tmp_step_ left (an OUT_DIR the import made is gone, one it found empty is
    empty again), so the retry is not refused."""
    import errno
    from nanohlat.run.checkpoint import saving
    hf_dir, out = tmp_path / "hf", tmp_path / "run"
    assert _export(["export", str(base), str(hf_dir)]) == 0
    if out_exists:
        out.mkdir()
    real = saving._atomic_write

    def full(path, write):
        if "shard_" not in path:
            return real(path, write)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(saving, "_atomic_write", full)
    capsys.readouterr()
    assert _export(["import", str(hf_dir), str(out)]) == 2
    one_line_error(capsys.readouterr().err, str(out / "checkpoints" / ".tmp_step_00000000"),
                   "No space left on device", "nothing of the import")
    assert (os.listdir(out) == []) if out_exists else not out.exists()
    monkeypatch.undo()
    assert _export(["import", str(hf_dir), str(out)]) == 0


@pytest.fixture
def small_disk(tmp_path):
    """A real full disk: a 600 KB tmpfs, too small for the tiny model's 1 MB of weights
    (mounting one needs root; skipped otherwise)."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_hf_export_and_import_onto_a_real_full_disk_leave_it_empty(base, tmp_path, small_disk, capsys):
    assert _export(["export", str(base), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    for args, name in ((["export", str(base), str(small_disk / "hf")], "model.safetensors"),
                       (["import", str(tmp_path / "hf"), str(small_disk / "run")], ".tmp_step_00000000")):
        assert _export(args) == 2
        one_line_error(capsys.readouterr().err, name, "No space left on device")
        assert os.listdir(small_disk) == []
