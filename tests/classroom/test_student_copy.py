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

from nanohlat.classroom import kit as classroom, needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from nanohlat.system.cli import not_done
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
def test_a_stub_on_some_ranks_only_is_named_last_and_its_peers_say_why_they_stopped(student_copy, cache_dir,
                                                                                    tmp_path):
    """4c (the vocab-parallel loss) runs on the last pipeline stage only: ranks 2 and 3
    stop at it, ranks 0 and 1 then lose their peers mid-exchange and say so in one line.
    A peer the launcher stops before its failed collective returns says nothing (seen
    once for rank 0, on two cores that two suites shared): each line a peer does print
    is that one, none is a traceback or an exit code, and the stub's line is last."""
    stub_only(student_copy, ["4c"])
    r = run_in(student_copy, "train.py", "--preset", "tiny", "--steps", "1", "--nproc", "4", "--pp", "2", "--tp",
               "2", "--cache-dir", cache_dir, "--out-dir", str(tmp_path / "pp2"), "--no-progress")
    assert_names_exercise(r, "4c")
    assert "error: ranks 2, 3: exercise 4c is not done yet" in r.stderr, r.stderr
    peers = re.findall(r"^error: ranks? ([\d, ]+): (.*)$", r.stderr, re.M)
    said = [(ranks, why) for ranks, why in peers if "exercise 4c" not in why]
    assert said and all(why == "stopped: a peer rank reached an exercise stub (below)" for _, why in said), r.stderr
    assert {int(x) for ranks, _ in said for x in ranks.split(", ")} <= {0, 1}, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ranks 2, 3: exercise 4c is not done yet"), r.stderr
    assert "Traceback" not in r.stderr and "failed with exit code" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_stubbed_loader_is_not_a_corrupt_checkpoint(student_copy, cache_dir, tmp_path):
    """sample.py (one process and its tp workers), eval.py and python -m nanohlat.serving with 8a
    (resharding) a stub: the checkpoint is fine, 8a is named."""
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
    assert_names_exercise(run_in(student_copy, "-m", "nanohlat.serving", "--target", str(out), "--draft", str(out),
                                 "--max-new-tokens", "2"), "8a")
    # the same checkpoint in the reference: fine
    r = run_in(ROOT, "sample.py", "--out-dir", str(out), "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------
# What needs what (nanohlat/classroom/needs.py, needs.json)
# ---------------------------------------------------------------------------

def test_the_needs_map_lists_every_tutorial_command_and_every_check():
    """needs.json covers exactly tutorial.md's runnable commands (tests/repo/test_tutorial.py
    checks, block by block, what each reaches) and every exercise's check
    (tests/classroom/test_exercise_checks.py checks what each reaches)."""
    import test_tutorial
    assert [cmds for _, cmds in needs.tutorial_blocks(ROOT)] == [cmds for cmds, _ in test_tutorial.runnable_blocks()]
    data = needs.load()
    listed = [(e["chapter"], e["command"]) for e in data["commands"]]
    assert listed == needs.tutorial_commands(ROOT), (
        f"tutorial.md's runnable commands changed: run `{needs.UPDATE}` (a few minutes)")
    assert sorted(data["checks"]) == sorted(ALL), f"the exercises changed: run `{needs.UPDATE}`"
    for entry in data["commands"]:
        assert set(entry["needs"]) <= set(ALL) and entry["needs"] == needs.order(entry["needs"])
    # the facts the teacher's guide and the issue reports rest on
    assert {"1a", "1b", "4b"} <= set(data["checks"]["1c"])
    assert "8a" in needs.chapter_needs(data)[9]      # sample.py loads a checkpoint through ShardSet.full


def test_list_shows_what_each_chapter_and_check_needs():
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert classroom.main(["list"]) == 0
    lines = needs.summary(needs.load())
    assert lines and all(line in out.getvalue().splitlines() for line in lines), out.getvalue()
    assert any(line.startswith("  chapter 1: train.py needs ") for line in lines), lines


def test_a_copy_readme_says_what_needs_its_stubs(student_copy, tmp_path):
    text = (student_copy / "README.md").read_text()
    assert text.startswith("# Student copy") and "stubs for you to write" in text
    assert all(line in text for line in needs.summary(needs.load(), only=set(ALL)))
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert text.endswith(f.read())                 # the repository's README follows, unchanged
    classroom.make_copy(str(tmp_path / "ch4"), ["4a", "4b", "4c"], ROOT)
    text = (tmp_path / "ch4" / "README.md").read_text()
    head = text.split("---")[0]
    assert "exercises 4a, 4b, 4c are stubs" in head
    assert "train.py --nproc N needs 4a 4b 4c" in head and "1a" not in head, head


def test_a_check_names_every_missing_exercise_it_needs(student_copy):
    """1c's check runs through 1a, 1b and 4b: it names those still stubs, not just the first it reaches."""
    stub_only(student_copy, ["1b", "4b"])
    r = run_in(student_copy, "-m", "nanohlat.classroom", "check", "1c")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "not done yet: exercise 1c needs exercises 1b and 4b first" in r.stdout, r.stdout
    assert "check 1b 4b" in r.stdout, r.stdout
    stub_only(student_copy, ["1c", "1a"])
    r = run_in(student_copy, "-m", "nanohlat.classroom", "check", "1c")
    assert "not done yet: exercise 1c needs exercise 1a first (still stubs here" in r.stdout, r.stdout


def test_the_tutorial_and_the_teachers_guide_say_what_the_trace_says():
    """Each chapter of tutorial.md, and docs/teaching.md's course plan, state what
    the chapter's commands and the checks need: the same as needs.json."""
    data = needs.load()
    with open(os.path.join(ROOT, "tutorial.md"), encoding="utf-8") as f:
        tutorial = f.read()
    flat = lambda text: " ".join(text.split())
    chapters = re.split(r"^## ", tutorial, flags=re.M)
    for chapter, ids in needs.chapter_needs(data).items():
        text = flat(next(c for c in chapters if c.startswith(f"{chapter}. ")))
        said = re.findall(r"this chapter's commands need exercises ([^.]*)\.", text)
        if ids:
            assert said == [needs.names(ids)], (chapter, said, ids)
        else:
            assert not said, chapter
    with open(os.path.join(ROOT, "docs", "teaching.md"), encoding="utf-8") as f:
        teaching = f.read()
    assert needs.check_sentence(data) in flat(teaching)
    rows = [line for line in teaching.splitlines() if re.match(r"\| \d+ \| \d+\. ", line)]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        chapters_of_row = [int(n) for n in re.findall(r"(?:^|; )(\d+)\. ", cells[1])]
        want = needs.order(i for c in chapters_of_row for i in needs.chapter_needs(data).get(c, []))
        assert cells[-1] == (" ".join(want) or "none"), row
