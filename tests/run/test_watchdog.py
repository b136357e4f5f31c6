"""A stopped rank ends the job (issue 25): --collective-timeout.

`_stopping_worker` is preflight.worker with a test hook, planted through the
environment as tests/run/test_checkpoint.py's `_fault_worker` does: rank 1 notes
the time and its pid in a file and SIGSTOPs itself at the optimizer step of
step 3 (after the checkpoint of step 2), on the first start only.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from nanohlat.run import launch

TIMEOUT = 8   # short, but long enough for both workers to join the process group (bounded by it too)


def _stopping_worker(*args, **kwargs):
    from nanohlat import optim
    from nanohlat.run import preflight
    hook = json.loads(os.environ["TEST_WATCHDOG_STOP"])
    if int(os.environ["RANK"]) == hook["rank"]:
        real, calls = optim.FlatAdamW.reduce_gradients, []

        def reduce_gradients(self):
            calls.append(1)
            if len(calls) == hook["step"]:
                with open(hook["note"], "w") as f:
                    json.dump({"pid": os.getpid(), "time": time.time()}, f)
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(self)
        optim.FlatAdamW.reduce_gradients = reduce_gradients
    return preflight.worker(*args, **kwargs)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_naming_it(cache_dir, tmp_path, monkeypatch, capfd):
    import train
    from nanohlat.run import checkpoint, preflight, runlock
    out, note = tmp_path / "run", tmp_path / "stopped.json"
    argv = ["--preset", "tiny", "--steps", "8", "--eval-every", "0", "--batch-size", "8", "--seq-len", "32",
            "--no-progress", "--threads", "1", "--cache-dir", cache_dir, "--out-dir", str(out),
            "--nproc", "2", "--tp", "2", "--save-every", "2", "--collective-timeout", str(TIMEOUT)]
    monkeypatch.setenv("TEST_WATCHDOG_STOP", json.dumps({"rank": 1, "step": 3, "note": str(note)}))
    monkeypatch.setattr(preflight, "worker", _stopping_worker)
    code = train.main(argv)
    ended = time.time()
    err = capfd.readouterr().err
    stopped = json.loads(note.read_text())
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1, err[-3000:]
    assert len(errors) == 1 and f"rank 1 (pid {stopped['pid']}) stopped" in errors[0], err[-3000:]
    assert f"--collective-timeout {TIMEOUT}s" in errors[0] and "Traceback" not in err
    assert ended - stopped["time"] < TIMEOUT + 30
    with pytest.raises(ProcessLookupError):            # killed and reaped: no orphan
        os.kill(stopped["pid"], 0)
    latest = checkpoint.latest(str(out))                # the checkpoint of step 2, intact
    assert latest and latest.endswith("step_00000002")
    manifest = checkpoint.read_manifest(latest)
    assert not checkpoint.corrupt_files(latest, manifest) and not checkpoint.incomplete_checkpoints(str(out))
    runlock.acquire(str(out)).release()                 # the run lock was released


def test_collective_timeout_is_recognized_and_said_in_one_line():
    e = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
                     "operation to complete")
    assert launch.is_collective_timeout(e)
    assert not launch.is_collective_timeout(RuntimeError("Connection reset by peer"))
    line = launch.collective_timeout_message(0, 2, 5)
    assert "\n" not in line and "rank 0 of 2 waited 5s (--collective-timeout)" in line


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_collective_timeout_out_of_range_is_refused(value):
    from nanohlat import config
    from nanohlat import recipe
    with pytest.raises(config.UserError, match="--collective-timeout must be a finite number > 0"):
        recipe.parse_args(["--collective-timeout", value])


def test_a_rank_whose_collective_times_out_says_so_in_one_line_and_exits_1(tmp_path):
    """What each waiting rank does (under torchrun this is all there is): the
    process group's timeout error becomes one line and exit 1, and its run lock is
    released. Here train() raises gloo's error itself, in a process of its own
    (the worker leaves with os._exit)."""
    import subprocess
    import sys
    code = (
        "from nanohlat import recipe\n"
        "from nanohlat.run import preflight, runlock\n"
        "def train(*a):\n"
        "    raise RuntimeError('[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 7000ms for recv '\n"
        "                       'operation to complete')\n"
        "preflight.join = lambda *a: None   # (no process group to join: train() fails at once)\n"
        f"lock = runlock.acquire({str(tmp_path / 'run')!r})\n"
        "preflight.worker(train, None, recipe.TrainConfig(collective_timeout=7), None, None)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", PYTHONPATH=repo)
    env.pop("NANOHLAT_WORKER_ERRORS", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip() == "error: " + launch.collective_timeout_message(0, 2, 7), p.stderr[-2000:]
    from nanohlat.run import runlock
    runlock.acquire(str(tmp_path / "run")).release()   # released on the way out
