"""A student copy as a student meets it: every command that reaches an
exercise stub ends with one line naming the exercise (exit code 2, no
traceback), on every rank and through every loader.

One copy serves the module (`student_copy`); `stub_only` rewrites its files
with regions so that exactly the named exercises are stubs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from nanohlat.classroom import kit as classroom

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = [e.id for e in classroom.EXERCISES]


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("student") / "class-copy"
    classroom.make_copy(str(dest), ALL, ROOT)
    return dest


def stub_only(dest, ids) -> None:
    """The copy at `dest` with exactly the regions of `ids` stubbed, the others the reference's."""
    regions = classroom.find_regions(ROOT)
    for rel in sorted({r[0] for regs in regions.values() for r in regs}):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            (dest / rel).write_text(classroom.stub_source(f.read(), set(ids)), encoding="utf-8")


def run_in(cwd, *argv, timeout=600) -> subprocess.CompletedProcess:
    """`python *argv` in `cwd`, importing that folder's nanohlat."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_names_exercise(r: subprocess.CompletedProcess, ex: str | None = None) -> str:
    """Exit code 2, no traceback, and the last line names `ex` (None: any
    exercise) and its check. Returns the exercise named."""
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    last = (r.stderr.strip().splitlines() or [""])[-1]
    named = re.search(r"exercise (\d+[a-z]) is not done yet", last)
    assert last.startswith("error: ") and named and named.group(1) == (ex or named.group(1)), out
    ex = named.group(1)
    assert last.endswith(f"`python -m nanohlat.classroom check {ex}`"), out
    assert "corrupt" not in out and "malformed" not in out, out
    return ex


def test_not_done_reads_a_stub_even_when_wrapped():
    from nanohlat.classroom import not_done
    stub = NotImplementedError(classroom.BY_ID["8a"].stub_message())
    assert "exercise 8a is not done yet" in not_done(stub)
    try:
        try:
            raise stub
        except NotImplementedError as inner:
            raise ValueError("while loading shard_00000.pt") from inner
    except ValueError as outer:
        assert "exercise 8a is not done yet" in not_done(outer)
    assert not_done(RuntimeError("a real crash")) is None
    assert not_done(NotImplementedError("not a stub")) is None


@pytest.mark.slow
def test_train_plan_and_one_process_name_the_first_stub(student_copy, cache_dir, tmp_path):
    stub_only(student_copy, ALL)
    r = run_in(student_copy, "train.py", "--plan", "--preset", "tiny", "--nproc", "2", "--tp", "2")
    assert_names_exercise(r)
    r = run_in(student_copy, "train.py", "--preset", "tiny", "--steps", "1", "--cache-dir", cache_dir,
               "--out-dir", str(tmp_path / "one"), "--no-progress")
    assert_names_exercise(r)


@pytest.mark.slow
def test_a_stub_reached_on_the_ranks_of_nproc_2_is_one_line(student_copy, cache_dir, tmp_path):
    """1a (RMSNorm) is reached inside the workers, on both ranks, after pre-flight."""
    stub_only(student_copy, ["1a"])
    r = run_in(student_copy, "train.py", "--preset", "tiny", "--steps", "1", "--nproc", "2", "--tp", "2",
               "--cache-dir", cache_dir, "--out-dir", str(tmp_path / "tp2"), "--no-progress")
    assert_names_exercise(r, "1a")
    assert "failed with exit code" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_stubbed_loader_is_not_a_corrupt_checkpoint(student_copy, cache_dir, tmp_path):
    """sample.py and eval.py with 8a (resharding) a stub: the checkpoint is fine, 8a is named."""
    out = tmp_path / "ref"
    r = run_in(ROOT, "train.py", "--preset", "tiny", "--steps", "1", "--cache-dir", cache_dir, "--out-dir",
               str(out), "--no-progress", "--eval-every", "0")
    assert r.returncode == 0, r.stderr
    stub_only(student_copy, ["8a"])
    assert_names_exercise(run_in(student_copy, "sample.py", "--out-dir", str(out), "--max-new-tokens", "2"), "8a")
    assert_names_exercise(run_in(student_copy, "sample.py", "--out-dir", str(out), "--max-new-tokens", "2",
                                 "--nproc", "2", "--tp", "2"), "8a")
    assert_names_exercise(run_in(student_copy, "eval.py", "--out-dir", str(out), "--examples", "4",
                                 "--max-batches", "1", "--json", str(tmp_path / "eval.json")), "8a")
    # the same checkpoint in the reference: fine
    r = run_in(ROOT, "sample.py", "--out-dir", str(out), "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
