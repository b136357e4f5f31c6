"""The classroom kit can fail: for every exercise, the stub fails its check,
plausible wrong implementations fail it, and the reference passes it.

Three `check` runs cover every exercise: the repository itself (all pass), a
student copy with every region stubbed (all "not done yet"), and a copy with
one typical mistake planted in each exercise listed in WRONG (all FAIL, and
not as "not done": the check caught the mistake itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from nanohlat.classroom import kit as classroom, checks as classroom_checks, needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# exercise id -> (file, text in its region, the mistake a student typically makes)
WRONG = {
    "1a": ("nanohlat/model.py", "h.pow(2).mean(-1, keepdim=True) + self.eps", "h.pow(2).mean(-1, keepdim=True)"),
    "1b": ("nanohlat/model.py", "torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)"),
    "1c": ("nanohlat/serving/generate.py", "cache_v[:, :, :S], mask.unsqueeze(1)", "cache_v[:, :, :S], None"),
    "3a": ("nanohlat/data_parallel.py", "flat[a:b] = comm.all_reduce(flat[a:b].contiguous(), group, inplace=True)",
            "comm.all_reduce(flat[a:b].clone(), group)"),
    "3b": ("nanohlat/zero1.py", "piece = rows[:, a:b].contiguous().view(-1)",
            "piece = flat[a * group.size:b * group.size]"),
    "4a": ("nanohlat/tensor_parallel.py", "return comm.all_reduce(g, ctx.group), None", "return g, None"),
    "4b": ("nanohlat/tensor_parallel.py",
            "return leave(self.linear(x, self.weight), self.group, self.sequence_parallel)",
            "return self.linear(x, self.weight)"),
    "4c": ("nanohlat/tensor_parallel.py",
            "m = comm.all_gather(local_max.unsqueeze(0), group, dim=0).amax(dim=0)",
            "m = local_max"),
    "5a": ("nanohlat/pipeline.py", "warmup = min(pp - stage - 1, m)", "warmup = min(pp - stage, m)"),
    "5b": ("nanohlat/pipeline.py", 'grad = right[1] if right is not None and right[0] == "B" else None',
            'grad = left[1] if left is not None and left[0] == "B" else None'),
    "6a": ("nanohlat/mesh.py", "return (rank // tp) % dp, rank // (tp * dp), rank % tp",
            "return rank // (tp * pp), (rank // tp) % pp, rank % tp"),
    "6b": ("nanohlat/mesh.py", "return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]",
            "return [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]"),
    "7a": ("nanohlat/precision.py", "rounded = (bits + noise) & -65536", "rounded = bits & -65536"),
    "8a": ("nanohlat/run/checkpoint/reshard.py", "out.narrow(tp_dim, part * size, size), covered.narrow(tp_dim, part * size, size)",
            "out.narrow(tp_dim, part, size), covered.narrow(tp_dim, part, size)"),
    "8b": ("nanohlat/run/checkpoint/background.py",
           "self.wait_for_previous(step)               # written, gathered, published (every rank together)",
           "self.finish()"),
    "10a": ("nanohlat/beyond/moe.py", "balance = E * (f * P).sum(dim=-1)", "balance = (f * P).sum(dim=-1)"),
    "11a": ("nanohlat/beyond/context_parallel.py", "w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)",
            "w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)"),
}


def run_check(cwd: str, *args: str, trace: str | None = None, env: dict | None = None,
              pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """`check *args` in `cwd`; with `trace` (a folder), what each check reaches is recorded there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})
    env["PYTHONPATH"] = pythonpath or cwd         # the copy's own nanohlat, not the repository's
    if trace:
        env = needs.trace_env(trace, env)
    return subprocess.run([sys.executable, "-m", "nanohlat.classroom", "check", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def verdicts(out: str) -> dict[str, str]:
    """{exercise id: 'pass' | 'FAIL'} from check's output."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^exercise\s+(\d+[a-z])\s+(pass|FAIL)", out, re.M)}


def test_every_exercise_has_a_region_a_check_and_a_stub_message():
    regions = classroom.find_regions(ROOT)
    ids = [e.id for e in classroom.EXERCISES]
    assert len(ids) >= 14
    assert sorted(regions) == sorted(ids), "the registry and the code's regions disagree"
    assert sorted(classroom_checks.CHECKS) == sorted(ids)
    for e in classroom.EXERCISES:
        assert f"tutorial.md section {e.section}" in e.stub_message()


def test_stubbed_source_is_valid_python_and_keeps_the_markers():
    text = ("def f(x):\n    y = 1\n    # exercise 1a: begin\n    y = x * 2\n    return y\n"
            "    # exercise 1a: end\n")
    out = classroom.stub_source(text, {"1a"})
    assert "y = x * 2" not in out and "# exercise 1a: begin" in out and "# exercise 1a: end" in out
    compile(out, "f.py", "exec")
    ns: dict = {}
    exec(out, ns)
    with pytest.raises(NotImplementedError, match="exercise 1a"):
        ns["f"](3)
    assert classroom.stub_source(text, {"4b"}) == text     # other exercises untouched


@pytest.mark.slow
def test_the_reference_passes_every_check(tmp_path):
    r = run_check(ROOT, "--all", trace=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(verdicts(r.stdout).values()) == {"pass"} and len(verdicts(r.stdout)) == len(classroom.EXERCISES)
    # the exercises each check ran through are what needs.json says (a check names every missing one from it)
    traced = needs.check_needs(needs.read_hits(str(tmp_path)), [e.id for e in classroom.EXERCISES])
    assert traced == needs.load()["checks"], (
        f"nanohlat/classroom/needs.json is out of date for the checks: run `{needs.UPDATE}`")


@pytest.mark.slow
def test_a_student_copy_fails_every_check_as_not_done(tmp_path):
    dest = tmp_path / "class-copy"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "nanohlat.classroom", "new", str(dest)], cwd=ROOT,
                       capture_output=True, text=True, env=env | {"PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    for rel in {reg[0] for regs in classroom.find_regions(ROOT).values() for reg in regs}:
        compile((dest / rel).read_text(), rel, "exec")     # every stubbed file still imports
    r = run_check(str(dest), "--all")
    assert r.returncode != 0
    v = verdicts(r.stdout)
    assert v == {e.id: "FAIL" for e in classroom.EXERCISES}, r.stdout
    assert r.stdout.count("not done yet: exercise") == len(classroom.EXERCISES), r.stdout
    # an exercise that builds on others names every one still a stub (1c's attention runs 1a's RMSNorm,
    # 1b's rotary embeddings and 4b's linears)
    assert "not done yet: exercise 1c needs exercises 1a, 1b and 4b first" in r.stdout, r.stdout
    # a second `new` into the same folder refuses instead of overwriting the student's work
    r = subprocess.run([sys.executable, "-m", "nanohlat.classroom", "new", str(dest)], cwd=ROOT,
                       capture_output=True, text=True, env=env | {"PYTHONPATH": ROOT})
    assert r.returncode == 2 and "not empty" in r.stderr


@pytest.mark.slow
def test_typical_mistakes_fail_their_checks(tmp_path):
    dest = tmp_path / "mistakes"
    classroom.make_copy(str(dest), [], ROOT)
    regions = classroom.find_regions(ROOT)
    for ex, (rel, right, wrong) in WRONG.items():
        path = dest / rel
        text = path.read_text()
        lines = text.splitlines()
        inside = "\n".join("\n".join(lines[b:e]) for f, b, e, _ in regions[ex] if f == rel)
        assert right in inside, f"{ex}: the planted mistake must sit inside the exercise's region"
        assert text.count(right) == 1
        path.write_text(text.replace(right, wrong))
    chapters = {ex[:-1] for ex in WRONG}
    assert chapters >= {str(e.chapter) for e in classroom.EXERCISES}, "a mistake for every chapter"
    r = run_check(str(dest), *WRONG)
    v = verdicts(r.stdout)
    assert r.returncode != 0 and v == {ex: "FAIL" for ex in WRONG}, r.stdout
    assert "not done yet" not in r.stdout and "differs" in r.stdout, r.stdout


def test_a_raised_verdict_points_at_the_students_code_not_the_checks():
    """An error raised inside the checks (an oracle's comparison, grading.py's
    compare) is reported at the last frame outside them: the student's line
    that led there."""
    from nanohlat.classroom.checks import grading
    oracle = {}
    exec(compile("def compare():\n    raise ValueError('shapes differ')\n",
                 grading.__file__, "exec"), oracle)

    def students_code():
        oracle["compare"]()   # the line the verdict names

    try:
        students_code()
    except ValueError as e:
        verdict = classroom_checks.explain(e)
    line = students_code.__code__.co_firstlineno + 1
    assert verdict.startswith("raised ValueError: shapes differ at "), verdict
    assert verdict.endswith(f"test_exercise_checks.py:{line}"), verdict


def test_the_readme_reading_order_names_the_exercises_each_file_holds():
    """README's reading order tells a course student which rows hold solutions (its
    "exercises" column) and how to read them stubbed: the column is what the regions say."""
    from nanohlat.classroom import kit
    held: dict[str, set[str]] = {}
    for ex, regions in kit.find_regions(ROOT).items():
        for path, *_ in regions:
            held.setdefault(path, set()).add(ex)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = re.search(r"^## Reading order\n(.*?)(?=^## )", f.read(), re.S | re.M).group(1)
    assert "python -m nanohlat.classroom new reading-copy" in section
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \|.*\| ([^|]*) \|$", section, re.M)
    assert len(rows) >= 10, rows
    for path, said in rows:
        said_ids = set() if said.strip() == "-" else {x.strip() for x in said.split(",")}
        assert said_ids == held.get(path, set()), (path, said, sorted(held.get(path, set())))
    listed = {path for path, _ in rows}
    for path, ids in held.items():
        if path not in listed:   # outside the core: the paragraph above the table names them
            assert all(f"{i} (`{path}`)" in " ".join(section.split()) for i in ids), (path, ids)


# ---------------------------------------------------------------------------
# A check that cannot be fooled (issue 50): exits, endless loops, missing files, no copy
# ---------------------------------------------------------------------------

def plant_region(dest, ex: str, code: str) -> None:
    """Exercise `ex`'s region in the copy at `dest` becomes `code` (indented as the region)."""
    rel, begin, end, indent = classroom.find_regions(str(dest))[ex][0]
    path = dest / rel
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:begin + 1] + [indent + line for line in code.splitlines()] + lines[end:]) + "\n")


def test_an_exit_or_an_endless_loop_in_an_exercise_fails_its_check(tmp_path):
    """The student's code ran in `check`'s own process: sys.exit(0) and os._exit(0) ended it with
    nothing printed and exit code 0 (a pass), and a loop that never ends hung it (only the
    distributed checks had a time limit). Now each is a FAIL of its exercise, and the loop is
    stopped at the limit (here 3 s)."""
    import time
    dest = tmp_path / "copy"
    classroom.make_copy(str(dest), [], ROOT)
    plant_region(dest, "1a", "while True:\n    pass")
    plant_region(dest, "1b", "import sys\nsys.exit(0)")
    plant_region(dest, "6a", "import os\nos._exit(0)")
    start = time.monotonic()
    r = run_check(str(dest), "1a", "1b", "6a", "7a", env={"NANOHLAT_CHECK_TIME_LIMIT": "3"})
    took = time.monotonic() - start
    assert r.returncode == 1, r.stdout + r.stderr
    assert verdicts(r.stdout) == {"1a": "FAIL", "1b": "FAIL", "6a": "FAIL", "7a": "pass"}, r.stdout
    assert "check_rmsnorm did not finish within 13 s: the code never returned" in r.stdout, r.stdout
    assert "exercise 1b's code exited (sys.exit(0), at nanohlat/model.py:" in r.stdout, r.stdout
    assert ("the check ended without a verdict: the process running it exited (exit code 0) during check_coords"
            in r.stdout), r.stdout
    assert "3 failed" in r.stdout
    assert took < 13 + 120, took     # the limit, and two fresh children's start-up on a busy machine


def test_a_check_grades_only_the_copy_it_is_run_in(tmp_path):
    """A copy without the exercise's file (or with a folder in its place), or without a module the
    check imports, was graded against the installed reference (an editable install found the
    file) and passed; `check` outside any copy passed too. Now the first two fail naming the
    file, and the last is refused (exit 2)."""
    dest = tmp_path / "copy"
    classroom.make_copy(str(dest), [], ROOT)
    os.remove(dest / "nanohlat" / "precision.py")
    os.remove(dest / "nanohlat" / "shard_spec.py")
    os.remove(dest / "nanohlat" / "mesh.py")
    (dest / "nanohlat" / "mesh.py").mkdir()
    r = run_check(str(dest), "7a", "6a", "1a")
    assert r.returncode == 1 and verdicts(r.stdout) == {"7a": "FAIL", "6a": "FAIL", "1a": "FAIL"}, r.stdout
    assert ("nanohlat/precision.py, the file of exercise 7a, is missing from this copy (it is not there)"
            in r.stdout), r.stdout
    assert "nanohlat/mesh.py, the file of exercise 6a, is missing from this copy (a folder stands in its place)" \
        in r.stdout, r.stdout
    # 1a's own file is there, but the model imports shard_spec.py: not taken from elsewhere either
    assert "nanohlat/shard_spec.py is missing from this copy" in r.stdout.split("exercise   1a")[1], r.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_check(str(elsewhere), "1a", pythonpath=ROOT)
    assert r.returncode == 2 and not r.stdout, r.stdout
    err = r.stderr.strip()
    assert err == (f"error: {elsewhere} is not a copy of nanohlat (no nanohlat/classroom/ here): check grades the "
                   f"copy it is run in; cd into your copy's top folder (`python -m nanohlat.classroom new DIR` "
                   f"makes one)"), err


def test_the_registry_names_each_exercises_file():
    regions = classroom.find_regions(ROOT)
    for e in classroom.EXERCISES:
        assert {r[0] for r in regions[e.id]} == {e.file}, e.id
