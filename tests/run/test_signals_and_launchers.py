"""Signals and launchers (docs/robustness.md; the shared helpers: hostile.py): a second run into a
busy out-dir; SIGTERM and Ctrl-C (once, twice, during a save) to one process and to the --nproc
launcher; kill -9 of the launcher during a save and of one worker; a rendezvous with a missing rank;
bad launcher variables; and the launcher's lines, the cause first, below the progress bar.

Some tests start `python -c` scripts that import this module by name (its folder on sys.path) to
plant one of the workers below (`_slow_save_worker`, `_slow_step_worker`) in the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics
from hostile import ckpt, flags, losses, main_in_process, one_line_error, run_py, saved_step, train_here


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
            "import test_signals_and_launchers, train\n"
            "from nanohlat.run import preflight\n"
            "preflight.worker = test_signals_and_launchers._slow_save_worker\n"
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
            "import test_signals_and_launchers, train\n"
            "from nanohlat.run import preflight\n"
            "preflight.worker = test_signals_and_launchers._slow_step_worker\n"
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
