"""Nothing lost, nothing hung: what nanohlat promises for each hostile input or
event (the table in docs/robustness.md), one test per promise.

Every case ends in one of three ways, and the tests check which: exit 0 by
design, exit 2 with one line starting "error: " and no traceback, or a
documented signal exit (143 after SIGTERM, 130 after Ctrl-C) with a
checkpoint saved. Runs are the tiny preset for a few steps, in this process
where possible; the few tests that need a real second process start one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics

TINY = ["--preset", "tiny", "--steps", "4", "--eval-every", "0", "--no-progress", "--threads", "1"]


def one_line_error(err: str, *needles: str) -> None:
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def main_in_process(argv, capsys) -> tuple[int, str]:
    import train
    code = train.main(argv)
    return code, capsys.readouterr().err


def run_py(args, check=True, timeout=240, **kw):
    p = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


# ---------------------------------------------------------------------------
# Every flag against its meaning (config.py, sample.py, eval.py)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--min-lr", "nan"], "--min-lr must be a finite number in [0, --lr]"),
    (["--beta1", "1.5"], "--beta1 must be a finite number in [0, 1), got 1.5"),
    (["--beta2", "1"], "--beta2 must be a finite number in [0, 1)"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number >= 0 (0 = no clipping)"),
    (["--warmup-steps", "-10"], "--warmup-steps must be >= 0, got -10"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--vocab-multiple", "0"], "--vocab-multiple must be positive, got 0"),
    (["--eval-every", "5", "--eval-batches", "0"], "--eval-batches 0 with evaluation on"),
    (["--rendezvous-timeout", "0"], "--rendezvous-timeout must be a finite number > 0"),
    (["--norm-eps", "nan"], "--norm-eps must be a finite number > 0"),
    (["--n-heads", "0"], "--n-heads must be positive, got 0"),
    (["--n-kv-heads", "0"], "--n-kv-heads must be positive, got 0"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
    (["--threads", "100000"], "--threads 100000 is more than 1024"),
    (["--resume", ""], "--resume is empty; give auto"),
    # in range, but what they would cause is refused (preflight.check_values)
    (["--bucket-mb", "1e-30"], "--bucket-mb 1e-30 cuts a rank's ~250,432 gradients into 250,432 buckets"),
    (["--collective-timeout", "1e300"], "--collective-timeout 1e+300 is outside [1, 604800] seconds"),
    (["--collective-timeout", "1e-9"], "--collective-timeout 1e-09 is outside [1, 604800] seconds"),
    (["--rendezvous-timeout", "1e300"], "--rendezvous-timeout 1e+300 is outside [1, 604800] seconds"),
])
def test_flags_out_of_range_exit_2_before_anything(args, message, tmp_path, capsys, cache_dir):
    out = tmp_path / "run"
    code, err = main_in_process(TINY + ["--cache-dir", cache_dir, "--out-dir", str(out)] + args, capsys)
    assert code == 2
    one_line_error(err, message)
    assert not out.exists()          # before training: nothing written, so `--resume never` is never blocked


@pytest.mark.parametrize("args, message", [
    (["--top-k", "-5"], "--top-k must be >= 0, got -5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
])
def test_sample_flags_out_of_range(args, message, tmp_path, capsys):
    import sample
    assert sample.main(["--out-dir", str(tmp_path / "nothing")] + args) == 2
    one_line_error(capsys.readouterr().err, message)


def test_speculative_decoding_flags_out_of_range(capsys):
    from nanohlat.serving import server as serving
    for args, message in ((["--temperature", "nan"], "--temperature must be a finite number >= 0"),
                          (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                          (["--seed", "-1"], "--seed must be in [0, 2**63)"),
                          (["--threads", "-1"], "--threads must be at least 1")):
        assert serving.main(["--target", "none", "--draft", "none"] + args) == 2
        one_line_error(capsys.readouterr().err, message)


@pytest.mark.parametrize("command, args, message", [
    ("train", ["--zero", "1.5"], "argument --zero: invalid int value: '1.5'"),
    ("train", ["--collective-timeout", "abc"], "argument --collective-timeout: invalid float value: 'abc'"),
    ("train", ["--check-replicas", "1.5"], "argument --check-replicas: invalid int value: '1.5'"),
    ("train", ["--warmup-steps", "1e3"], "argument --warmup-steps: invalid int value: '1e3'"),
    ("train", ["--lr", "-1e-3"], "argument --lr: expected one argument (a value that starts with '-' is written "
                                 "--lr=-1e-3)"),
    ("train", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("sample", ["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    ("eval", ["--shots", "1.5"], "argument --shots: invalid int value: '1.5'"),
    ("serving", ["--k", "z"], "argument --k: invalid int value: 'z'"),
    ("hf", ["export"], "the following arguments are required: RUN_OR_CKPT, HF_DIR"),
    ("bench", ["--warmup", "q"], "argument --warmup: invalid int value: 'q'"),
    ("classroom", ["check", "99z"], "unknown exercise 99z"),
    ("classroom", ["bogus"], "argument cmd: invalid choice: 'bogus'"),
])
def test_a_bad_command_line_is_one_error_line_and_exit_2(command, args, message, capsys):
    """argparse printed the whole usage (34 lines for train.py) before the line that matters;
    the classroom's unknown exercise exited 1 (a failed check's code)."""
    import importlib
    main = {"train": "train", "sample": "sample", "eval": "eval", "serving": "nanohlat.serving.server",
            "hf": "nanohlat.serving.hf", "bench": "nanohlat.bench.bench", "classroom": "nanohlat.classroom.kit"}
    with pytest.raises(SystemExit) as e:
        importlib.import_module(main[command]).main(args)
    assert e.value.code == 2
    one_line_error(capsys.readouterr().err, message)


def test_a_bad_flag_points_to_the_commands_help():
    p = run_py(["train.py", "--zero", "1.5"], check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "error: argument --zero: invalid int value: '1.5' (python train.py --help lists the flags)")
    p = run_py(["-m", "nanohlat.classroom", "check", "99z"], check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "unknown exercise 99z")


def test_a_tiny_temperature_samples_the_largest_logit():
    """logits / 1e-40 overflowed to inf (softmax: nan, and a crash); shifted by the
    row's largest logit first, the scaled logits stay <= 0."""
    import torch
    from nanohlat.serving import generate
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    assert torch.equal(generate.probabilities(logits, 1e-40), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(generate.probabilities(logits, 1.0), torch.softmax(logits, -1))


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder; give a file path"),
    ("under_a_file", "is a file, not a folder"),
])
def test_eval_json_that_cannot_be_written_is_refused_before_evaluating(where, message, tmp_path, capsys):
    import eval as eval_py
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("x")
    target = {"folder": tmp_path / "folder", "under_a_file": tmp_path / "afile" / "eval.json"}[where]
    # --out-dir holds no run: the path is refused before any checkpoint is even looked for
    assert eval_py.main(["--out-dir", str(tmp_path / "norun"), "--json", str(target)]) == 2
    one_line_error(capsys.readouterr().err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder"]


def test_prompt_and_task_files_that_are_not_regular_files_are_refused(tmp_path, capsys):
    """A FIFO would block and /dev/zero never ends: refused before reading; a folder is named as one."""
    import eval as eval_py
    import sample
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert sample.main(["--out-dir", str(tmp_path), "--prompt-file", str(fifo)]) == 2
    one_line_error(capsys.readouterr().err, "is not a regular file")
    for task in (fifo, tmp_path):
        assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(task)]) == 2
        one_line_error(capsys.readouterr().err, "is not a regular file", str(task))


def test_a_task_with_an_empty_choice_is_refused(tmp_path, capsys):
    """An empty continuation scores log-likelihood 0 and would always win (or, with an
    empty context too, crash the scorer)."""
    import eval as eval_py
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "", "choices": ["", "b"], "label": 1}\n')
    assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(task)]) == 2
    one_line_error(capsys.readouterr().err, "t.jsonl:1", "a choice is empty")

def test_a_failed_atomic_write_leaves_the_old_file_and_no_partial(tmp_path):
    """files.atomic_write (checkpoints, the data cache, eval.json): a write that
    fails part-way keeps the old file whole and removes its `.partial`."""
    import errno
    from nanohlat.system.files import atomic_write
    target = tmp_path / "eval.json"
    target.write_text("old")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    with pytest.raises(OSError):
        atomic_write(str(target), full)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]

def test_binary_prompt_and_task_files_are_one_line(tmp_path, capsys):
    import eval as eval_py
    import sample
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert sample.main(["--out-dir", str(tmp_path), "--prompt-file", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))
    assert eval_py.main(["--out-dir", str(tmp_path), "--task", str(binary)]) == 2
    one_line_error(capsys.readouterr().err, "is not UTF-8 text", str(binary))


# ---------------------------------------------------------------------------
# Shared: a finished tiny run (checkpoints at steps 2 and 4) and a small corpus
# ---------------------------------------------------------------------------

def train_here(argv):
    import train
    from nanohlat import recipe
    from nanohlat.run import preflight
    model_cfg, tcfg = recipe.parse_args(argv)
    return train.train(*preflight.inputs(model_cfg, tcfg))


def flags(cache_dir, out_dir, *extra):
    return TINY + ["--cache-dir", cache_dir, "--out-dir", str(out_dir)] + [str(e) for e in extra]


def ckpt(out_dir, step: int) -> str:
    return os.path.join(str(out_dir), "checkpoints", f"step_{step:08d}")


def losses(out_dir) -> dict:
    return {m["step"]: m["loss"] for m in read_metrics(str(out_dir))}


@pytest.fixture(scope="module")
def base(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    train_here(flags(cache_dir, out, "--save-every", 2))
    return out


@pytest.fixture
def run_copy(base, tmp_path):
    import shutil
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A folder of a few Python files (json's sources): a tokenizer trains on it in a second."""
    import shutil
    import sysconfig
    folder = tmp_path_factory.mktemp("corpus")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            shutil.copyfile(os.path.join(src, name), folder / name)
    return folder


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


# ---------------------------------------------------------------------------
# Checkpoints: incomplete ones, older ones, identity, Hugging Face targets
# ---------------------------------------------------------------------------

def test_a_run_moved_away_from_its_tokenizer_cache_still_samples(run_copy, capsys):
    """Each checkpoint holds a copy of the run's tokenizer: with the cached
    original gone (a cleared cache, the run copied to another machine),
    sample.py, eval.py and the rest load the copy."""
    import filecmp
    import sample
    from nanohlat.run import checkpoint
    path = ckpt(run_copy, 4)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert filecmp.cmp(os.path.join(path, "tokenizer.model"), manifest["tokenizer"], shallow=False)
    manifest["tokenizer"] = str(run_copy / "gone" / "tokenizer.model")     # the original, somewhere else
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    assert checkpoint.read_manifest(path)["tokenizer"] == os.path.join(path, "tokenizer.model")
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "4", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")

def test_a_checkpoint_without_manifest_is_skipped_named_and_cleared(run_copy, cache_dir, capsys):
    from nanohlat.run import checkpoint
    os.remove(os.path.join(ckpt(run_copy, 4), "manifest.json"))
    os.makedirs(os.path.join(run_copy, "checkpoints", ".tmp_step_00000005"))
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--save-every", 2), capsys)
    assert code == 0, err
    assert "warning: skipping incomplete checkpoint(s)" in err and "step_00000004" in err and ".tmp_step_" in err
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(run_copy))] == \
        ["step_00000002", "step_00000004", "step_00000006"]
    assert checkpoint.incomplete_checkpoints(str(run_copy)) == []
    assert sorted(losses(run_copy)) == [1, 2, 3, 4, 5, 6]


def test_resume_with_another_tokenizer_is_refused(run_copy, cache_dir, small_corpus, capsys):
    """The same vocabulary size, trained on other data: another tokenizer. Refused
    (exit 2, nothing changed); the message names the three ways on, and each works."""
    from nanohlat.run import checkpoint
    before = sorted(os.listdir(run_copy / "checkpoints"))
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--data", small_corpus), capsys)
    assert code == 2
    one_line_error(err, "another tokenizer", "--resume never --overwrite", "--allow-tokenizer-change", "--tokenizer ")
    assert sorted(os.listdir(run_copy / "checkpoints")) == before and sorted(losses(run_copy)) == [1, 2, 3, 4]
    # new data, the run's own tokenizer: allowed, and said
    tokenizer = json.load(open(os.path.join(ckpt(run_copy, 4), "manifest.json")))["tokenizer"]
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 5, "--data", small_corpus,
                                      "--tokenizer", tokenizer), capsys)
    assert code == 0, err
    assert "note: resuming" in err and "on other data" in err
    # deliberately another tokenizer
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--data", small_corpus,
                                      "--allow-tokenizer-change"), capsys)
    assert code == 0, err
    assert "warning: resuming" in err and "another tokenizer" in err
    assert checkpoint.latest(str(run_copy)) == ckpt(run_copy, 6)


def test_hf_import_into_a_run_is_refused_and_its_checkpoints_stay(run_copy, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from nanohlat.run import checkpoint
    from nanohlat.serving import hf
    hf.main(["export", str(run_copy), str(tmp_path / "hf")])
    before = {p: checkpoint.read_manifest(p)["files"] for p in checkpoint.list_checkpoints(str(run_copy))}
    for argv in (["import", str(tmp_path / "hf"), str(run_copy)],             # into a run
                 ["export", str(run_copy), str(tmp_path / "hf")]):            # over an earlier export
        assert hf.main(argv) == 2
        one_line_error(capsys.readouterr().err, "is not empty", "--overwrite")
    assert {p: checkpoint.read_manifest(p)["files"] for p in checkpoint.list_checkpoints(str(run_copy))} == before
    checkpoint.ShardSet(ckpt(run_copy, 4))
    # told --overwrite, import replaces the run; export rewrites the folder
    hf.main(["export", str(run_copy), str(tmp_path / "hf"), "--overwrite"])
    hf.main(["import", str(tmp_path / "hf"), str(run_copy), "--overwrite"])
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(run_copy))] == ["step_00000000"]


# ---------------------------------------------------------------------------
# Data: verified caches, files that are not text files
# ---------------------------------------------------------------------------

def test_a_truncated_token_cache_is_rebuilt_never_used(small_corpus, tmp_path):
    from nanohlat.run import data
    from nanohlat.config import UserError
    cache = str(tmp_path / "cache")
    first = data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    tokens = first.train.copy()
    train_bin = os.path.join(first.directory, "train.bin")
    with open(train_bin, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(UserError, match="damaged"):            # opened directly: refused, one line
        data.Dataset(first.tokenizer, first.directory)
    notes = []
    again = data.prepare_data(str(small_corpus), "", 512, cache, log=notes.append)
    assert any("damaged" in n and "train.bin has 4,096 bytes" in n and "rebuilding" in n for n in notes), notes
    assert (again.train == tokens).all() and len(again.train) == len(tokens)
    # same size, one changed block: the full hash notices
    with open(train_bin, "r+b") as f:
        f.write(b"\xff\xff" * 8)
    assert "does not match its hash" in data.verify_shards(again.directory)


def test_damaged_cache_that_cannot_be_rebuilt_is_one_line(small_corpus, tmp_path, monkeypatch):
    from nanohlat.run import data
    from nanohlat.config import UserError
    cache = str(tmp_path / "cache")
    first = data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    os.remove(os.path.join(first.directory, "val.bin"))

    real = os.makedirs

    def read_only(path, *args, **kw):      # the cache dir exists; nothing new can be made in it
        if ".tmp-" in str(path):
            raise PermissionError(13, "Read-only file system", path)
        return real(path, *args, **kw)
    monkeypatch.setattr(data.os, "makedirs", read_only)
    with pytest.raises(UserError) as e:
        data.prepare_data(str(small_corpus), "", 512, cache, log=lambda *a: None)
    assert "cannot be built" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "broken symlink in a folder"])
def test_data_that_is_not_a_regular_file_is_refused(kind, small_corpus, tmp_path):
    import shutil
    from nanohlat.run import data
    from nanohlat.config import UserError
    if kind == "fifo":
        path = str(tmp_path / "pipe.txt")
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "folder")
        shutil.copytree(small_corpus, path)
        os.symlink(str(tmp_path / "gone.py"), os.path.join(path, "link.py"))
    with pytest.raises(UserError) as e:
        data.prepare_data(path, "", 512, str(tmp_path / "cache"), log=lambda *a: None)
    msg = str(e.value)
    assert "\n" not in msg and ("broken symbolic link" in msg if "symlink" in kind else "not a regular file" in msg)


# ---------------------------------------------------------------------------
# Concurrent runs, preemption (SIGTERM, Ctrl-C), rendezvous
# ---------------------------------------------------------------------------

LONG = 400    # steps the signalled runs are told to do (they are stopped long before)


def start_run(cache_dir, out, *extra, env=None):
    log = open(os.path.join(os.path.dirname(str(out)), f"{os.path.basename(str(out))}.log"), "w")
    argv = [sys.executable, "train.py", *flags(cache_dir, out, "--steps", LONG, *extra)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env), log.name


def wait_for_rows(proc, out, rows: int, timeout: float = 180) -> None:
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended early with {proc.returncode}"
        try:
            if len(read_metrics(str(out))) >= rows:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the run logged no steps in time")


def saved_step(out) -> int:
    from nanohlat.run import checkpoint
    return checkpoint.step_of(checkpoint.latest(str(out)))


@pytest.mark.slow
def test_second_run_refused_then_sigterm_saves_and_resume_is_exact(tmp_path, cache_dir, capsys):
    """Run A trains; run B into the same out-dir exits 2 naming A's PID and touches
    nothing. SIGTERM stops A after its current step with a checkpoint (exit 143) and
    every metrics row up to it; --resume auto then continues exactly: the losses equal
    those of a run never interrupted, bit for bit."""
    import signal
    out = tmp_path / "run"
    a, log = start_run(cache_dir, out)
    try:
        wait_for_rows(a, out, 2)
        code, err = main_in_process(flags(cache_dir, out, "--steps", LONG), capsys)
        assert code == 2
        one_line_error(err, "is in use by another run", f"PID {a.pid}")
        assert a.poll() is None                      # A was running all along
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=120) == 143, open(log).read()[-3000:]
    finally:
        a.kill()
    text = open(log).read()
    assert "SIGTERM: finishing this step, saving a checkpoint" in text and "Traceback" not in text, text[-3000:]
    k = saved_step(out)
    assert sorted(losses(out)) == list(range(1, k + 1))       # every row of the steps it trained
    code, err = main_in_process(flags(cache_dir, out, "--steps", LONG, "--stop-after", k + 2), capsys)
    assert code == 0, err
    ref = tmp_path / "ref"
    train_here(flags(cache_dir, ref, "--steps", LONG, "--stop-after", k + 2))
    assert losses(out) == losses(ref) and sorted(losses(ref)) == list(range(1, k + 3))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step(tmp_path, cache_dir):
    """--nproc 2 --dp 2: SIGTERM to the launcher is forwarded to both workers; they
    agree on the step, both shards of its checkpoint are saved, exit 143."""
    import signal
    out = tmp_path / "run"
    a, log = start_run(cache_dir, out, "--nproc", 2, "--dp", 2)
    try:
        wait_for_rows(a, out, 2)
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=180) == 143, open(log).read()[-3000:]
    finally:
        a.kill()
    text = open(log).read()
    assert "Traceback" not in text and "stopped by SIGTERM" in text, text[-3000:]
    k = saved_step(out)
    assert sorted(losses(out)) == list(range(1, k + 1))
    from nanohlat.run import checkpoint
    assert sorted(checkpoint.read_manifest(ckpt(out, k))["files"]) == ["shard_00000.pt", "shard_00001.pt"]


def _slow_save_worker(*args, **kwargs):
    """preflight.worker whose shard of one save (TEST_SLOW_SAVE's step) waits a few
    seconds first, each rank noting its pid in TEST_SLOW_SAVE's folder: a window in
    which to kill the launcher during the save. Runs in each spawned worker."""
    import time
    from nanohlat.run import preflight
    from nanohlat.run.checkpoint import saving
    hook = json.loads(os.environ["TEST_SLOW_SAVE"])
    real = saving._atomic_write

    def write(path, fn):
        if f".tmp_step_{hook['step']:08d}" in path and "shard_" in path:
            with open(os.path.join(hook["notes"], f"rank{os.environ['RANK']}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(hook["sleep"])
        return real(path, fn)
    saving._atomic_write = write
    return preflight.worker(*args, **kwargs)


@pytest.mark.slow
def test_kill_9_of_the_launcher_during_a_save_leaves_one_writer(tmp_path, cache_dir):
    """The issue's case: `kill -9` of the --nproc 2 launcher as the step-4 save starts.
    Its workers die with it (within 5 s: at once on Linux) and publish nothing; a run
    started right away into the same out-dir is its only writer: it trains steps 1-8
    itself and nothing of the dead run is moved to abandoned_*. (It starts over with
    --resume never --overwrite: the dead run saved no checkpoint, and --resume auto
    refuses to start from scratch over its metrics.jsonl records.)"""
    import signal
    import time
    from nanohlat.run import checkpoint, runlock
    out, notes = tmp_path / "run", tmp_path / "notes"
    notes.mkdir()
    argv = flags(cache_dir, out, "--nproc", 2, "--zero", 3, "--steps", 8, "--save-every", 4)
    code = ("import sys\n"
            f"sys.path[:0] = [{ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}, {os.path.join(ROOT, 'tests')!r}]\n"
            "import test_robustness, train\n"
            "from nanohlat.run import preflight\n"
            "preflight.worker = test_robustness._slow_save_worker\n"
            f"sys.exit(train.main({argv!r}))\n")
    env = dict(os.environ, TEST_SLOW_SAVE=json.dumps({"step": 4, "notes": str(notes), "sleep": 20}))
    first = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while len(os.listdir(notes)) < 2:
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.05)
        workers = [int((notes / name).read_text()) for name in sorted(os.listdir(notes))]
        first.send_signal(signal.SIGKILL)           # the launcher, mid-save
        first.wait()
        killed = time.time()
        second = subprocess.Popen([sys.executable, "train.py", *argv, "--resume", "never", "--overwrite"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while any(runlock._alive(pid) for pid in workers) and time.time() < killed + 5:
            time.sleep(0.05)
        alive = [pid for pid in workers if runlock._alive(pid)]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"workers {alive} outlived their launcher by 5 s"
        stdout, stderr = second.communicate(timeout=300)
    finally:
        first.kill()
        first.stderr.close()
    assert second.returncode == 0 and "Traceback" not in stderr, stdout[-2000:] + stderr[-3000:]
    names = os.listdir(out / "checkpoints")
    assert not [n for n in names if n.startswith("abandoned_")], names
    assert checkpoint.latest(str(out)) == ckpt(out, 8)
    steps = [m["step"] for m in read_metrics(str(out))]
    assert steps == list(range(1, 9)), steps      # each step once: the second run's


def _slow_step_worker(*args, **kwargs):
    """preflight.worker whose every optimizer step first sleeps TEST_SLOW_STEP seconds."""
    import time
    from nanohlat import optim
    from nanohlat.run import preflight
    real, pause = optim.FlatAdamW.reduce_gradients, float(os.environ["TEST_SLOW_STEP"])

    def reduce_gradients(self):
        time.sleep(pause)
        return real(self)
    optim.FlatAdamW.reduce_gradients = reduce_gradients
    return preflight.worker(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["the launcher", "the process group"])
def test_a_second_ctrl_c_under_nproc_quits_at_once(to, tmp_path, cache_dir):
    """Ctrl-C twice, 1.2 s apart, in steps of 2 s: to the launcher alone (`kill -INT`; the
    agent passes the second on as SIGTERM) or to the whole group (a terminal's Ctrl-C).
    The job ends within seconds of the second, exit 130, without finishing the step;
    the last checkpoint (step 2) is intact and no worker is left."""
    import signal
    import time
    from nanohlat.run import checkpoint
    out = tmp_path / "run"
    argv = flags(cache_dir, out, "--nproc", 2, "--dp", 2, "--steps", LONG, "--save-every", 2)
    code = ("import sys\n"
            f"sys.path[:0] = [{ROOT!r}, {os.path.dirname(os.path.abspath(__file__))!r}, {os.path.join(ROOT, 'tests')!r}]\n"
            "import test_robustness, train\n"
            "from nanohlat.run import preflight\n"
            "preflight.worker = test_robustness._slow_step_worker\n"
            f"sys.exit(train.main({argv!r}))\n")
    a = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TEST_SLOW_STEP="2"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_rows(a, out, 3)
        press = (lambda: os.killpg(a.pid, signal.SIGINT)) if to == "the process group" else \
            (lambda: os.kill(a.pid, signal.SIGINT))
        press()
        time.sleep(1.2)
        press()
        second = time.time()
        assert a.wait(timeout=120) == 130
        took = time.time() - second
        err = a.stderr.read()
    finally:
        a.kill()
    assert took < 15, took
    assert "Traceback" not in err and "--resume auto continues from the last complete checkpoint" in err, err
    assert checkpoint.latest(str(out)) == ckpt(out, 2) and sorted(losses(out)) == [1, 2, 3]
    checkpoint.ShardSet(ckpt(out, 2))
    assert subprocess.run(["pgrep", "-f", "_slow_step_worker"], capture_output=True).returncode == 1


def test_first_ctrl_c_sets_the_flag_a_second_one_interrupts(monkeypatch):
    """The handler itself: a first SIGINT only asks to stop; the same press delivered
    twice (terminal and launcher) is one; a later press raises KeyboardInterrupt."""
    import signal
    from nanohlat.run import preempt
    before = signal.getsignal(signal.SIGINT)
    with preempt.catch_signals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert preempt.requested()
        os.kill(os.getpid(), signal.SIGINT)                     # within DOUBLE_DELIVERY_S: the same press
        monkeypatch.setattr(preempt, "_received_at", preempt._received_at - 2 * preempt.DOUBLE_DELIVERY_S)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signals.exit_code == 130 and not preempt.requested()
    assert signal.getsignal(signal.SIGINT) is before            # the previous handler is back
    # under --nproc a second Ctrl-C that reached only the launcher arrives as its SIGTERM: now too
    with preempt.catch_signals():
        os.kill(os.getpid(), signal.SIGINT)
        monkeypatch.setattr(preempt, "_received_at", preempt._received_at - 2 * preempt.DOUBLE_DELIVERY_S)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    with preempt.catch_signals() as signals:                    # but a repeated SIGTERM stays one request
        os.kill(os.getpid(), signal.SIGTERM)
        monkeypatch.setattr(preempt, "_received_at", preempt._received_at - 2 * preempt.DOUBLE_DELIVERY_S)
        os.kill(os.getpid(), signal.SIGTERM)
    assert signals.exit_code == 143


def test_ctrl_c_during_a_save_exits_130_and_keeps_the_previous_checkpoint(tmp_path, cache_dir, capsys,
                                                                          monkeypatch):
    from nanohlat.run import checkpoint
    from nanohlat.run.checkpoint import saving
    real = saving._atomic_write

    def interrupted(path, write):
        if ".tmp_step_00000003" in path:
            raise KeyboardInterrupt
        return real(path, write)
    monkeypatch.setattr(saving, "_atomic_write", interrupted)
    out = tmp_path / "run"
    code, err = main_in_process(flags(cache_dir, out, "--save-every", 1, "--keep-last", 0), capsys)
    assert code == 130 and err.strip().endswith("interrupted") and "Traceback" not in err, err
    assert checkpoint.latest(str(out)) == ckpt(out, 2)
    checkpoint.ShardSet(ckpt(out, 2))


@pytest.mark.slow
def test_rendezvous_with_a_missing_rank_ends_within_the_timeout(tmp_path, cache_dir):
    import socket
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.time()
    p = run_py(["train.py", *flags(cache_dir, tmp_path / "run", "--rendezvous-timeout", 2)], check=False,
               env=env, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    one_line_error(p.stderr, "rank 0 of 2 waited 2s", "rank 1 did not arrive", f"MASTER_PORT={port}")
    assert time.time() - t0 < 100
    assert not (tmp_path / "run").exists()           # the lock and the out-dir it made are gone


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not an integer >= 0"),
    ({"WORLD_SIZE": "2"}, "RANK is not set but WORLD_SIZE is"),
])
def test_bad_launcher_variables_are_refused_up_front(env, message, tmp_path, cache_dir, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, err = main_in_process(flags(cache_dir, tmp_path / "run"), capsys)
    assert code == 2
    one_line_error(err, message)


def test_an_early_failure_under_nproc_2_is_one_line(tmp_path, cache_dir):
    """Both workers fail the same way before training: said once, exit 2, none of
    torch's launcher boilerplate (log lines, ChildFailedError tables, tracebacks)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the failure is --device cuda)")
    p = run_py(["train.py", *flags(cache_dir, tmp_path / "run", "--nproc", 2, "--dp", 2, "--device", "cuda")],
               check=False)
    assert p.returncode == 2
    one_line_error(p.stderr, "--device cuda")
    assert not (tmp_path / "run").exists()


def test_max_new_tokens_beyond_the_context_says_where_it_stops(base, capsys):
    import sample
    assert sample.main(["--out-dir", str(base), "--prompt", "def ", "--max-new-tokens", "500", "--seed", "0"]) == 0
    err = capsys.readouterr().err
    assert "note: the model's context is 64 tokens" in err and "not --max-new-tokens 500" in err, err


# ---------------------------------------------------------------------------
# Sizes checked before allocation (preflight.check_memory)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, why", [
    (["--max-seq-len", "10000000000"], "--max-seq-len 10,000,000,000"),   # the rotary tables alone
    (["--d-model", "65536", "--n-heads", "4", "--n-kv-heads", "4"], "GiB"),   # weights and optimizer
])
def test_a_model_that_cannot_fit_is_refused_before_allocating(tmp_path, capsys, args, why):
    """One line with the estimate and this machine's memory, exit 2, nothing written
    (and no allocation: a 10^10-position rotary table would take 1 TiB)."""
    code, err = main_in_process([*TINY, "--device", "cpu", "--out-dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2
    one_line_error(err, "this model does not fit: it needs about", "this machine has", why)
    assert not (tmp_path / "run").exists()


def test_memory_check_counts_every_local_rank(monkeypatch):
    """--nproc N on the CPU: N ranks share the RAM; what fits once may not fit N times."""
    from nanohlat import config
    from nanohlat import recipe
    from nanohlat.run import preflight
    from nanohlat import plan
    model_cfg, tcfg = recipe.parse_args([*TINY, "--device", "cpu", "--nproc", "4", "--dp", "4"])
    per_rank = plan.peak_memory_per_rank(model_cfg, tcfg, 4) + preflight.rotary_bytes(model_cfg)
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 1}.get(name, 2 * per_rank))
    preflight.check_memory(model_cfg, tcfg, 4, 1, spawns=False)        # one local rank: fits
    with pytest.raises(config.UserError, match=r"\(4 ranks of"):
        preflight.check_memory(model_cfg, tcfg, 4, 4, spawns=True)      # four: does not


def test_a_full_disk_at_the_start_names_the_lock_and_leaves_nothing(tmp_path, cache_dir, capsys, monkeypatch):
    """The disk is full when the run lock records its PID: one line naming run.lock,
    exit 2, and the out-dir it created is gone (no 0-byte run.lock left behind)."""
    import errno
    from nanohlat.run import runlock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(runlock.os, "pwrite", full)
    out = tmp_path / "run"
    code, err = main_in_process([*TINY, "--cache-dir", cache_dir, "--out-dir", str(out)], capsys)
    assert code == 2
    one_line_error(err, str(out / "run.lock"), "No space left on device", "--out-dir")
    assert not out.exists()


# ---------------------------------------------------------------------------
# Run files parsed defensively: damaged manifests, damaged metrics lines
# ---------------------------------------------------------------------------

DAMAGED_MANIFESTS = {
    "step": lambda m: m.update(step="4"),
    "tokens": lambda m: m.update(tokens=-1),
    "layout": lambda m: m["layout"].update(tp=0),
    "world": lambda m: m["layout"].update(world=3),
    "model": lambda m: m["config"]["model"].update(d_model="big"),
    "config": lambda m: m.update(config=[1, 2]),
    "files": lambda m: m.update(files={"../x.pt": {"bytes": 1, "sha256": "0" * 64}}),
    "checksum": lambda m: next(iter(m["files"].values())).update(sha256=5),
    "schedule": lambda m: m.update(schedule={"optimizer_step": "x"}),
    "tokenizer": lambda m: m.update(tokenizer=7),
    # the layout's ZeRO stage and chunks: each was trusted unchecked (a KeyError, ValueError or TypeError
    # deep in the load, or a wrong value silently accepted)
    "zero abc": lambda m: m["layout"].update(zero="abc"),
    "zero null": lambda m: m["layout"].update(zero=None),
    "zero 7": lambda m: m["layout"].update(zero=7),
    "zero1 abc": lambda m: m["layout"].update(zero1="abc"),
    "zero and zero1 gone": lambda m: [m["layout"].pop(k) for k in ("zero", "zero1")],
    "zero and zero1 disagree": lambda m: m["layout"].update(zero=0, zero1=True),
    "virtual_stages 0": lambda m: m["layout"].update(virtual_stages=0),
    "virtual_stages 2 at pp 1": lambda m: m["layout"].update(virtual_stages=2),
    "cp 0": lambda m: m["layout"].update(cp=0),                       # context parallelism's degree
    "cp 2, world not tp*pp*dp*cp": lambda m: m["layout"].update(cp=2),
    # fields read later and trusted: a traceback deep in the resume, or a wrong run silently
    "optimizer null": lambda m: m.update(optimizer=None),            # falsy: fresh Adam moments, silently
    "optimizer abc": lambda m: m.update(optimizer="abc"),
    "identity tokenizer_sha256 5": lambda m: m["identity"].update(tokenizer_sha256=5),   # a TypeError on resume
    "identity data 5": lambda m: m["identity"].update(data=5),
    "tokenizer_copy file 5": lambda m: m["tokenizer_copy"].update(file=5),
    "step not its folder's": lambda m: m.update(step=5),
    "bad_steps beyond step": lambda m: m["schedule"].update(bad_steps=10**12),   # stopped as "10^12 bad steps"
    "optimizer_step 10^30": lambda m: m["schedule"].update(optimizer_step=10**30),   # an OverflowError
    "tokens 10^30": lambda m: m.update(tokens=10**30),
}


@pytest.mark.parametrize("field", sorted(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_one_line_on_resume_sample_eval_and_export(field, run_copy, cache_dir, capsys, tmp_path):
    import eval as evalpy
    import sample
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    DAMAGED_MANIFESTS[field](m)
    with open(path, "w") as f:
        json.dump(m, f)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 2
    one_line_error(err, path, "is damaged")
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, path, "is damaged")
    assert not os.path.exists(tmp_path / "hf")


DAMAGED_MANIFEST_TEXTS = {   # manifest.json bytes that are no manifest
    "not UTF-8": (b'{"format": 2, "step": "\xff\xfe"}', "unreadable (UnicodeDecodeError)"),   # was a traceback
    "nested too deep": (b"[" * 100_000, "unreadable (RecursionError)"),                     # was a traceback
    "truncated": (b'{"format": 2, "st', "unreadable (JSONDecodeError)"),
    "format a string": (b'{"format": "2"}', "has format '2', this nanohlat reads 2"),
    "a list": (b"[2]", "has format None"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_MANIFEST_TEXTS))
def test_a_manifest_that_is_not_json_is_one_line_on_resume_sample_eval_and_export(case, run_copy, cache_dir,
                                                                                   capsys, tmp_path):
    import eval as evalpy
    import sample
    text, message = DAMAGED_MANIFEST_TEXTS[case]
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path, "wb") as f:
        f.write(text)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 2
    one_line_error(err, path, message)
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, path, message)


def test_a_manifest_without_zero1_resumes_from_its_zero_stage(run_copy, cache_dir, capsys):
    """"zero1" is only for older readers: with "zero" present its absence is no damage (it was a KeyError)."""
    path = os.path.join(ckpt(run_copy, 4), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["layout"].pop("zero1")
    with open(path, "w") as f:
        json.dump(m, f)
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 0, err


def _edit_manifest(run_dir, step: int, edit) -> str:
    path = os.path.join(ckpt(run_dir, step), "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)
    return path


def _export(args) -> int:
    """`python -m nanohlat.hf ARGS`'s exit code (main returns it; a bad flag exits from the parser)."""
    from nanohlat.serving import hf
    try:
        return hf.main(args)
    except SystemExit as e:
        return e.code


DAMAGED_CONFIGS = {   # manifest["config"] fields that pass read_manifest: refused before a model is built
    "max_seq_len 10^12": (lambda m: m["config"]["model"].update(max_seq_len=10**12),
                          "this model does not fit: it needs about"),
    "seq_len 0": (lambda m: m["config"]["train"].update(seq_len=0), "config.train: --seq-len must be positive"),
    "seq_len abc": (lambda m: m["config"]["train"].update(seq_len="abc"), "config.train.seq_len is 'abc'"),
    "seq_len -5": (lambda m: m["config"]["train"].update(seq_len=-5), "--seq-len must be positive, got -5"),
    "lr nan": (lambda m: m["config"]["train"].update(lr=float("nan")), "config.train.lr is nan"),
    "zero 1.5": (lambda m: m["config"]["train"].update(zero=1.5), "config.train.zero is 1.5"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_CONFIGS))
def test_a_damaged_config_is_one_line_in_every_command_that_builds_its_model(case, run_copy, tmp_path, capsys):
    """sample.py, eval.py, the HF export and speculative decoding: one line naming the
    checkpoint, exit 2, before the model is built (10^12 positions: 4 TB of rotary
    tables), and no export folder left behind."""
    import eval as evalpy
    import sample
    from nanohlat.serving import server
    edit, message = DAMAGED_CONFIGS[case]
    _edit_manifest(run_copy, 4, edit)
    for main in (lambda: sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(run_copy), str(tmp_path / "hf")]),
                 lambda: server.main(["--target", str(run_copy), "--draft", str(run_copy), "--max-new-tokens", "2"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, ckpt(run_copy, 4), message)
    assert not (tmp_path / "hf").exists() and not (run_copy / "eval.json").exists()


def test_the_cheap_checks_come_before_the_shards_are_hashed(run_copy, capsys):
    """A model too big for this machine and a corrupt shard: the size, known from the
    manifest alone, is what sample.py says, before reading every shard's bytes for its sha256."""
    import sample
    _edit_manifest(run_copy, 4, lambda m: m["config"]["model"].update(max_seq_len=10**12))
    shard = os.path.join(ckpt(run_copy, 4), "shard_00000.pt")
    with open(shard, "r+b") as f:   # same size, other bytes: only the hash can tell
        f.seek(100)
        f.write(b"\0" * 16)
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, "this model does not fit", ckpt(run_copy, 4))
    assert "sha256" not in err, err


def test_hf_import_of_a_model_too_big_for_this_machine_is_refused_before_reading_it(base, tmp_path, capsys):
    """The size comes from config.json, checked before any weight is read."""
    from nanohlat.serving import hf
    assert _export(["export", str(base), str(tmp_path / "hf")]) == 0
    config = tmp_path / "hf" / "config.json"
    cfg = json.loads(config.read_text())
    cfg.update(hidden_size=2**20, intermediate_size=2**20, head_dim=2**20 // cfg["num_attention_heads"])
    config.write_text(json.dumps(cfg))
    capsys.readouterr()
    assert _export(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    one_line_error(capsys.readouterr().err, "this model does not fit", str(config))
    assert not (tmp_path / "run").exists()
    assert hf.from_hf_config(cfg).d_model == 2**20


DAMAGED_HF_CONFIGS = {   # an HF model's config.json: each field nanohlat reads, damaged
    "num_attention_heads 0": ({"num_attention_heads": 0}, "--n-heads must be positive, got 0"),   # ZeroDivisionError
    "hidden_size true": ({"hidden_size": True}, "no integer 'hidden_size' (got True)"),
    "num_key_value_heads abc": ({"num_key_value_heads": "abc"}, "num_key_value_heads is 'abc', not a whole number"),
    "max_position_embeddings 1.5": ({"max_position_embeddings": 1.5}, "max_position_embeddings is 1.5"),
    "rms_norm_eps NaN": ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number"),
    "rms_norm_eps 0": ({"rms_norm_eps": 0}, "--norm-eps must be a finite number > 0, got 0"),  # was the default
    "rope_theta abc": ({"rope_theta": "abc", "rope_parameters": None}, "rope_theta is 'abc'"),
    "rope_parameters' rope_theta a list": ({"rope_parameters": {"rope_theta": []}}, "rope_theta is [], not a number"),
    "rope_scaling abc": ({"rope_scaling": "abc"}, "rope_scaling is 'abc', not a record or null"),   # AttributeError
    "architectures 5": ({"architectures": 5, "model_type": None}, "architectures is 5"),          # TypeError
    "tie_word_embeddings yes": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes'"),
    "head_dim abc": ({"head_dim": "abc"}, "head_dim is 'abc', not a whole number"),
}


@pytest.fixture(scope="module")
def hf_dir(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert _export(["export", str(base), str(out)]) == 0
    return out


@pytest.mark.parametrize("case", sorted(DAMAGED_HF_CONFIGS))
def test_a_damaged_hf_config_is_one_line_and_imports_nothing(case, hf_dir, tmp_path, capsys):
    import shutil
    edit, message = DAMAGED_HF_CONFIGS[case]
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(edit)
    (model / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert _export(["import", str(model), str(tmp_path / "run")]) == 2
    one_line_error(capsys.readouterr().err, str(model / "config.json"), message)
    assert not (tmp_path / "run").exists()


def test_a_non_utf8_metrics_file_counts_as_a_run_record(tmp_path):
    """An untrained run's leftovers are removed only when metrics.jsonl is empty; a damaged,
    non-UTF-8 one was a UnicodeDecodeError there."""
    from nanohlat.run import runlock
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\n")
    runlock.forget_untrained_run(str(tmp_path))
    assert (tmp_path / "metrics.jsonl").exists()


def test_damaged_metrics_lines_are_dropped_with_a_note_on_resume(run_copy, cache_dir, capsys):
    path = run_copy / "metrics.jsonl"
    good = path.read_bytes()
    # ({"loss": 1.0}: a record without a step was kept as step 0)
    path.write_bytes(good + b'{"step": 3, "loss": \xff\xfe}\n[1, 2]\n{"step": "x"}\n{"step": null}\n'
                            b'{"loss": 1.0}\n{"step": 3, "los')
    code, err = main_in_process(flags(cache_dir, run_copy, "--steps", 6, "--resume", "auto"), capsys)
    assert code == 0 and "Traceback" not in err, err
    assert f"note: {path}" in err and "6 damaged line(s)" in err, err
    assert sorted(losses(run_copy)) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------
# Non-finite numbers: refused models, strict JSON
# ---------------------------------------------------------------------------

def test_a_checkpoint_with_a_nan_weight_is_refused_by_every_command_that_uses_it(base, tmp_path, capsys):
    """eval.py scored it (val_loss nan beside an accuracy) and the HF export wrote it:
    now they, like sample.py and speculative decoding, refuse it in sample.py's line."""
    import eval as evalpy
    import sample
    from nanohlat import device
    from nanohlat.run import checkpoint
    from nanohlat.serving import server
    from nanohlat.serving.generate import load_model   # the loader of every command
    model, manifest = load_model(str(base), device.get_device("cpu"))
    state = model.state_dict()
    state["layers.1.mlp.up.weight"][3, 5] = float("nan")
    bad = tmp_path / "nan"
    checkpoint.save_full(str(bad), model.cfg, state, manifest["tokenizer"])
    line = "has non-finite weights (NaN or inf) in layers.1.mlp.up.weight: it cannot be sampled, evaluated or exported"
    for main in (lambda: sample.main(["--out-dir", str(bad), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(bad), "--examples", "4", "--max-batches", "1"]),
                 lambda: _export(["export", str(bad), str(tmp_path / "hf")]),
                 lambda: server.main(["--target", str(bad), "--draft", str(bad), "--max-new-tokens", "2"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, str(bad), line)
    assert not (tmp_path / "hf").exists() and not (bad / "eval.json").exists()


def _strict(text: str):
    def reject(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=reject)


def test_every_json_file_is_strict_after_lr_1e30(tmp_path, cache_dir, capsys):
    """--lr 1e30: the gradient norms of the steps after the first are NaN. metrics.jsonl
    (each line), summary.json, config.json and eval.json parse as strict JSON; a
    non-finite number is the string "NaN" / "Infinity" / "-Infinity"."""
    import eval as evalpy
    out = tmp_path / "run"
    code, err = main_in_process(flags(cache_dir, out, "--lr", "1e30", "--min-lr", 0, "--max-bad-steps", 0,
                                      "--eval-every", 2, "--eval-batches", 1), capsys)
    assert code == 0, err
    rows = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in rows if "grad_norm" in r][1:] == ["NaN"] * 3, rows
    assert float(rows[1]["grad_norm"]) != float(rows[1]["grad_norm"])      # float() reads it back: nan
    for name in ("summary.json", "config.json"):
        _strict((out / name).read_text())
    assert evalpy.main(["--out-dir", str(out), "--examples", "4", "--max-batches", "1"]) == 0
    _strict((out / "eval.json").read_text())
    evalpy.write_json(str(tmp_path / "e.json"), {"val_loss": float("inf"), "x": [float("-inf"), float("nan")]})
    assert _strict((tmp_path / "e.json").read_text()) == {"val_loss": "Infinity", "x": ["-Infinity", "NaN"]}


# ---------------------------------------------------------------------------
# Messages that name the right thing
# ---------------------------------------------------------------------------

def test_nproc_under_a_launcher_of_another_world_size_is_refused(base, cache_dir, tmp_path, capsys, monkeypatch):
    import sample
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = main_in_process(flags(cache_dir, tmp_path / "run", "--nproc", 2), capsys)
    assert code == 2
    one_line_error(err, "--nproc 2", "WORLD_SIZE=1")
    assert not (tmp_path / "run").exists()
    assert sample.main(["--out-dir", str(base), "--nproc", "2"]) == 2
    one_line_error(capsys.readouterr().err, "--nproc 2", "WORLD_SIZE=1")


def test_sample_and_eval_say_when_the_newest_checkpoint_has_no_manifest(run_copy, capsys):
    import eval as evalpy
    import sample
    os.remove(os.path.join(ckpt(run_copy, 4), "manifest.json"))
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"the newest checkpoint {ckpt(run_copy, 4)} has no manifest.json" in err and ckpt(run_copy, 2) in err
    assert evalpy.main(["--out-dir", str(run_copy), "--examples", "4", "--max-batches", "1"]) == 0
    assert f"the newest checkpoint {ckpt(run_copy, 4)} has no manifest.json" in capsys.readouterr().err


def test_a_folder_given_as_tokenizer_is_named_a_folder(tmp_path, cache_dir, capsys):
    code, err = main_in_process(flags(cache_dir, tmp_path / "run", "--tokenizer", tmp_path), capsys)
    assert code == 2
    one_line_error(err, "is a folder", "tokenizer.model")


def test_corrupt_shard_messages_suggest_flags_the_reader_has(run_copy, capsys):
    import sample
    shard = os.path.join(ckpt(run_copy, 4), "shard_00000.pt")
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    assert sample.main(["--out-dir", str(run_copy), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    one_line_error(err, shard, "sample.py or eval.py --checkpoint PATH")


def test_a_signal_under_sample_nproc_does_not_suggest_resume(tmp_path, capsys):
    import signal
    import types
    from nanohlat.run import launch
    failures = {0: types.SimpleNamespace(exitcode=128 + signal.SIGINT)}
    assert launch._report_failures(failures, str(tmp_path), stop_hint="") == 130
    err = capsys.readouterr().err
    assert err.strip() == "stopped by a signal", err
    launch._report_failures(failures, str(tmp_path))
    assert "--resume auto" in capsys.readouterr().err     # train.py's workers saved a checkpoint


# ---------------------------------------------------------------------------
# Every size answered at once: arithmetic, never counting (issue 50)
# ---------------------------------------------------------------------------

BIG = "9" * 21   # 999999999999999999999 ranks: divisors() counted up to it


@pytest.mark.parametrize("args, message", [
    (["--plan", "--preset", "hlat-7b", "--nproc", BIG],
     f"--nproc {BIG} is more than 2^53 = 9,007,199,254,740,992, the largest count nanohlat records exactly"),
    (["--preset", "tiny", "--nproc", BIG], f"--nproc {BIG} is more than 2^53"),
    (["--preset", "tiny", "--cp", "2", "--nproc", "1000000000001"],
     "--tp 1 x --pp 1 x --cp 2 = 2 does not divide the world size 1000000000001; choose tp*pp*cp among 1, 73, 137, "
     "10001, 99990001, 7299270073, 13698630137 or 1000000000001"),
    (["--preset", "tiny", "--tp", "2", "--nproc", "1000000000001"],
     "--tp 2 x --pp 1 = 2 does not divide the world size 1000000000001"),
    (["--preset", "tiny", "--steps", BIG], f"--steps {BIG} is more than 2^53"),
    (["--preset", "moe", "--n-layers", "1000000000000"], "this model does not fit"),   # (its sparse layers: counted)
])
def test_every_size_is_answered_at_once(args, message, tmp_path, capsys):
    """A --nproc of 21 digits (and training at --cp 2 or --tp 2 with 10^12 + 1 ranks, a MoE of
    10^12 layers) never answered: divisors and the sparse layers were counted one by one."""
    import time
    start = time.perf_counter()
    code, err = main_in_process(args + ["--out-dir", str(tmp_path / "run")], capsys)
    assert time.perf_counter() - start < 5
    assert code == 2
    one_line_error(err, message)


def test_a_launchers_world_of_21_digits_and_a_search_over_10_12_ranks_answer_at_once(tmp_path, capsys, monkeypatch):
    import time
    start = time.perf_counter()
    code, _ = main_in_process(["--plan", "--search", "--preset", "tiny", "--nproc", "1000000000000"], capsys)
    assert code == 0 and time.perf_counter() - start < 5
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", BIG)
    start = time.perf_counter()
    code, err = main_in_process(["--preset", "tiny", "--out-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and time.perf_counter() - start < 5
    one_line_error(err, f"a world of {BIG} ranks is more than 2^53")


def test_divisors_come_from_the_factors():
    import random
    from nanohlat.recipe import choices, divisors
    rng = random.Random(0)
    for n in list(range(1, 500)) + [rng.randrange(1, 10**6) for _ in range(50)]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    # large primes, their products and squares, the largest count allowed: all at once
    for n in (2**53, 2**53 - 111, (2**31 - 1) * (2**31 - 19), 4294967291**2, 999999999999999999999, 10**21):
        d = divisors(n)
        assert d[0] == 1 and d[-1] == n and all(n % x == 0 for x in d) and d == sorted(set(d))
    assert len(divisors(8086598962041600)) == 41472
    assert choices(divisors(8086598962041600)) == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... or 8086598962041600 (41,472 in all)"


# ---------------------------------------------------------------------------
# A mixture's capacity factor: bounded, and its buffer counted (issue 50)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A 1-step run of the moe preset (dropless), for sample.py and eval.py to read."""
    out = tmp_path_factory.mktemp("moe") / "run"
    cache = out.parent / "cache"     # (its tokenizer: a resume needs the same)
    assert train_here(["--preset", "moe", "--steps", "1", "--eval-every", "0", "--no-progress", "--threads", "1",
                       "--batch-size", "4", "--cache-dir", str(cache), "--out-dir", str(out)]) is not None
    return out


@pytest.mark.parametrize("factor", ["1e30", "1e6"])
def test_a_capacity_factor_beyond_every_token_is_refused_in_every_command(factor, moe_run, tmp_path, capsys):
    """--moe-capacity-factor 1e30 was an OverflowError, 1e6 a 131 GB buffer the memory pre-flight did not
    count: above --moe-experts / --moe-top-k (2 here) each expert already takes every token, so the
    factor is refused there, by train.py and (through a checkpoint's manifest) sample.py and eval.py."""
    import shutil
    import eval as evalpy
    import sample
    want = f"--moe-capacity-factor {float(factor):g} is above --moe-experts / --moe-top-k = 2: at 2 each expert"
    code, err = main_in_process(["--preset", "moe", "--moe-capacity-factor", factor, "--out-dir", str(tmp_path / "x")],
                                capsys)
    assert code == 2
    one_line_error(err, want, "give at most 2, or 0 (dropless)")
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    mpath = _edit_manifest(copy, 1, lambda m: m["config"]["model"].update(moe_capacity_factor=float(factor)))
    for main in (lambda: sample.main(["--out-dir", str(copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(copy), "--examples", "4", "--max-batches", "1"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, f"checkpoint manifest {mpath} is damaged", want)


def test_the_memory_preflight_counts_the_capacity_buffer():
    import dataclasses
    from nanohlat import recipe
    from nanohlat.plan.memory import moe_layer_bytes
    model, _ = recipe.parse_args(["--preset", "moe", "--moe-experts", "64", "--moe-top-k", "1"])
    N, d = 4096, model.d_model
    dropless = moe_layer_bytes(model, N, 1, 4)
    at_most = moe_layer_bytes(dataclasses.replace(model, moe_capacity_factor=64.0), N, 1, 4)
    # 64 queues of every token: 64 x the experts' rows, the dispatch buffer (64 N + 1 rows), the keep mask
    assert at_most - dropless == 4 * (4 * model.ffn_dim * 63 * N + (64 * N + 1) * d) + N


# ---------------------------------------------------------------------------
# The launcher's lines: the cause first, below the progress bar (issue 50)
# ---------------------------------------------------------------------------

def test_a_rank_killed_without_a_word_is_named_before_the_peers_it_cut_off(tmp_path, capsys):
    """After kill -9 of one cp worker the first line blamed rank 0's gloo connection, the true
    cause second: a rank that died without a word (a signal first) now comes first."""
    import signal
    from nanohlat.run import launch

    class Failure:
        def __init__(self, code):
            self.exitcode = code

        def signal_name(self):
            return signal.Signals(-self.exitcode).name
    errors = tmp_path / "errors"
    errors.mkdir()
    (errors / "rank0.txt").write_text("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert launch._report_failures({0: Failure(1), 1: Failure(-9)}, str(errors)) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 1 failed with exit code -9 (signal SIGKILL)",
        "error: rank 0: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer"]


def _killed_worker(*args, **kwargs):
    """preflight.worker whose rank 1 kills itself (SIGKILL) at the optimizer step of step 3."""
    import signal
    from nanohlat import optim
    from nanohlat.run import preflight
    if os.environ["RANK"] == "1":
        real, calls = optim.FlatAdamW.reduce_gradients, []

        def reduce_gradients(self):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self)
        optim.FlatAdamW.reduce_gradients = reduce_gradients
    return preflight.worker(*args, **kwargs)


@pytest.mark.slow
def test_kill_9_of_one_cp_worker_is_named_first_on_a_line_of_its_own(tmp_path, cache_dir, capfd, monkeypatch):
    """--nproc 2 --cp 2, rank 1 killed mid-run: the launcher's first line names it."""
    import train
    from nanohlat.run import preflight
    monkeypatch.setattr(preflight, "worker", _killed_worker)
    code = train.main(["--preset", "tiny", "--steps", "6", "--eval-every", "0", "--threads", "1", "--nproc", "2",
                       "--cp", "2", "--collective-timeout", "60", "--cache-dir", cache_dir,
                       "--out-dir", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]
    assert errors and all(line.startswith("error: ") for line in errors), err[-3000:]
    assert errors[0] == "error: rank 1 failed with exit code -9 (signal SIGKILL)", err[-3000:]


@pytest.mark.slow
def test_a_stopped_workers_line_is_not_printed_onto_the_progress_bar(tmp_path, cache_dir, capfd, monkeypatch):
    """Rank 1 stopped (SIGSTOP) at step 3 with rank 0's progress bar drawn: the bar's line is left
    unfinished (rank 0 is ended from outside), and the launcher's line was printed onto it."""
    import time
    import train
    from nanohlat.run import preflight
    from test_watchdog import _stopping_worker
    monkeypatch.setenv("TEST_WATCHDOG_STOP", json.dumps({"rank": 1, "step": 3, "note": str(tmp_path / "note")}))
    monkeypatch.setattr(preflight, "worker", _stopping_worker)
    code = train.main(["--preset", "tiny", "--steps", "8", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
                       "--threads", "1", "--cache-dir", cache_dir, "--out-dir", str(tmp_path / "run"), "--nproc", "2",
                       "--tp", "2", "--collective-timeout", "8"])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "train:" in err, err[-3000:]     # (the bar was drawn)
    stopped = [line for line in err.replace("\r", "\n").splitlines() if "stopped (SIGSTOP" in line]
    assert len(stopped) == 1 and stopped[0].startswith("error: rank 1 (pid "), err[-3000:]


# ---------------------------------------------------------------------------
# Messages that point the right way (issue 50, item 8)
# ---------------------------------------------------------------------------

def test_a_cp_layout_is_refused_for_its_world_before_its_sequence(tmp_path, capsys):
    """--cp 3 --nproc 2 was refused for --seq-len (not a multiple of 6) before the world size."""
    code, err = main_in_process(["--preset", "tiny", "--cp", "3", "--nproc", "2", "--out-dir", str(tmp_path)], capsys)
    assert code == 2
    one_line_error(err, "--tp 1 x --pp 1 x --cp 3 = 3 does not divide the world size 2; choose tp*pp*cp among 1 or 2")


def test_a_search_says_why_the_presets_own_layout_is_not_valid(capsys):
    """--plan --search --preset moe --nproc 6 said "not valid for 6 ranks" and nothing more."""
    import train
    assert train.main(["--plan", "--search", "--preset", "moe", "--nproc", "6"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("the preset's own layout is not valid for 6 ranks: --batch-size 8 must split into "
                                 "dp 6 x microbatches 1 equal micro-batches; use a multiple of 6"), out[-2000:]
    assert "(no layout the search tries splits this model and batch over 6 ranks)" in out


def test_a_damaged_moe_experts_in_a_manifest_is_named_as_damage(moe_run, tmp_path, capsys):
    """The manifest's config.model says 8 experts, its shards hold 4: reported as a shape mismatch
    ("the model being loaded has ..."), as if another model were being loaded; it is the manifest."""
    import shutil
    import eval as evalpy
    import sample
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    mpath = _edit_manifest(copy, 1, lambda m: m["config"]["model"].update(moe_experts=8))
    for main in (lambda: sample.main(["--out-dir", str(copy), "--max-new-tokens", "2"]),
                 lambda: evalpy.main(["--out-dir", str(copy), "--examples", "4", "--max-batches", "1"])):
        assert main() == 2
        one_line_error(capsys.readouterr().err, f"checkpoint manifest {mpath} is damaged (its config.model makes "
                       f"'layers.0.mlp.router.weight' [8, 64], its shards hold [4, 64])")


def test_a_resume_that_changes_the_routing_says_so(moe_run, tmp_path, capsys):
    """Changing --moe-top-k, --moe-capacity-factor or --moe-aux-coef on resume was accepted silently:
    allowed (the weights fit: no shape changes), and announced in one note."""
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(moe_run, copy)
    code, err = main_in_process(["--preset", "moe", "--steps", "2", "--eval-every", "0", "--no-progress", "--threads",
                                 "1", "--batch-size", "4", "--cache-dir", str(moe_run.parent / "cache"), "--out-dir",
                                 str(copy), "--moe-top-k", "1", "--moe-capacity-factor", "1.5"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: resuming")]
    assert notes == [f"note: resuming {ckpt(copy, 1)} with --moe-top-k 1 (it trained with 2), --moe-capacity-factor "
                     f"1.5 (it trained with 0.0): the same weights, another model from here on"], err
