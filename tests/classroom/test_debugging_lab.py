"""The debugging lab (nanohlat/classroom/lab.py, tutorial.md chapter 12).

For every bug: its patch plants it (and reverting the patch, the reference
fix, gives the reference's file back); the instrument its symptom names
reveals it (`REVEALS`: a loss or grad norm off one process's, a replica
mismatch, exact resume broken, the weights not moving, a hang ended with one
line naming where); the reference passes `check` on every layout of every
bug; and the symptom-hiding non-fix (`Bug.nonfix`: the replica check turned
off, the layout refused, the printed loss rescaled) still fails.

The training is the expensive part: all of it runs in two groups of gloo
workers (lab.evaluate, which runs a job that appears twice once), the
reference's, the bugs' and the non-fixes' runs in one, the hang in its own
(its start-up, one process and the 6 s the stuck collective waits: under 30 s).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from conftest import ROOT
from nanohlat.classroom import kit, lab

# What the named instrument shows, per bug (lab.verdict's words for it).
REVEALS = {
    1: r"step 1 loss 12\.\d+, one process 6\.\d+",             # the loss, dp times one process's
    2: r"step 1 loss .* one process",                           # tp's loss off at step 1
    3: r"step 1 grad_norm",                                     # the grad norm of step 1
    4: r"--check-replicas: after step 1, parameter \S+norm\S* differs between its tp replicas",
    5: r"step 2 loss",                                          # right until the first update
    6: r"step 1 (loss|grad_norm)",
    7: r"--check-replicas: after step 1, parameter \S+ differs between its ep_dp replicas",
    8: r"exact resume: stopped after step 2 and resumed, step 4 loss",
    9: r"rounding: .* \(ratio 0\.[0-5]\d;",                   # (weights near 0 still move: ~0.3)
    10: r"a collective waited \d+ s for its peer at nanohlat/\S+:\d+",
}
HANG = 10


def test_the_lab_has_ten_bugs_in_six_areas_each_patch_plants_it_once_and_reverting_it_is_the_reference():
    assert len(lab.BUGS) >= 10 and len({b.area.split("/")[0] for b in lab.BUGS}) >= 6
    assert set(REVEALS) == set(lab.BY_N)
    for b in lab.BUGS:
        with open(os.path.join(ROOT, b.file), encoding="utf-8") as f:
            ref = f.read()
        planted = lab.apply(ROOT, lab.patches_of(b))[b.file]
        at = ref.index(b.old)
        assert planted == ref[:at] + b.new + ref[at + len(b.old):] != ref
        assert planted[:at] + b.old + planted[at + len(b.new):] == ref        # the reference fix
        assert len(lab.apply(ROOT, lab.patches_of(b, nonfix=True))) == 2     # the non-fix applies on top
        assert b.solution not in lab.brief(b) and b.file not in lab.brief(b)  # symptoms, never where


def test_bug_writes_a_copy_with_that_bug_and_only_its_symptoms(tmp_path, capsys):
    dest = tmp_path / "bug4"
    assert kit.main(["bug", "4", str(dest)]) == 0
    bug = lab.BY_N[4]
    with open(dest / bug.file, encoding="utf-8") as f:
        assert f.read() == lab.apply(ROOT, lab.patches_of(bug))[bug.file]
    brief = (dest / "LAB.md").read_text()
    assert bug.symptom in brief and "check bug4" in brief and bug.solution not in brief
    with pytest.raises(SystemExit) as e:
        kit.main(["bug", "99", str(tmp_path / "x")])
    assert e.value.code == 2 and "no bug 99" in capsys.readouterr().err
    assert kit.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"bug{b.n} " in out for b in lab.BUGS)


@pytest.fixture(scope="module")
def graded():
    """{(variant, bug): verdict} for the reference, every bug and every non-fix, all in one worker group."""
    jobs = []
    variants = {"ref": lambda b: {}, "bug": lambda b: lab.apply(ROOT, lab.patches_of(b)),
                "nonfix": lambda b: lab.apply(ROOT, lab.patches_of(b, nonfix=True))}
    for tag, texts in variants.items():
        for b in lab.BUGS:
            if (tag, b.n) != ("bug", HANG):
                jobs += lab.jobs_for(b, texts(b), tag=tag)
    got = lab.evaluate(ROOT, jobs, limit_s=600)
    hang = lab.BY_N[HANG]
    t0 = time.perf_counter()   # a hang leaves its group out of step: a group of its own
    got.update(lab.evaluate(ROOT, lab.jobs_for(hang, variants["bug"](hang), tag="bug"), limit_s=60))
    out = {(tag, b.n): lab.verdict(b, got, tag=tag) for tag in variants for b in lab.BUGS}
    out["hang took"] = time.perf_counter() - t0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n", sorted(lab.BY_N))
def test_the_instrument_reveals_the_bug_the_reference_fix_passes_and_a_non_fix_fails(graded, n):
    bug = graded[("bug", n)]
    assert bug is not None and re.search(REVEALS[n], bug), bug
    assert graded[("ref", n)] is None, graded[("ref", n)]
    nonfix = graded[("nonfix", n)]
    assert nonfix is not None, f"bug {n}'s non-fix ({lab.BY_N[n].nonfix_what}) passed"
    if n == HANG:
        assert graded["hang took"] < 30


def test_chapter_12_lists_every_bug_in_rising_difficulty_with_its_symptom_and_ends_with_its_solution():
    with open(os.path.join(ROOT, "tutorial.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    chapter = text[text.index("## 12. "):text.index("## Solutions")]
    order = [chapter.index(f"**bug {b.n}** ({b.area}, level {b.level}): {b.symptom}") for b in lab.BUGS]
    levels = [b.level for _, b in sorted(zip(order, lab.BUGS))]
    assert levels == sorted(levels)
    solutions = text[text.index("<summary>12, the lab's bugs</summary>"):]
    assert all(f"bug {b.n} ({b.name}): {b.solution}" in solutions for b in lab.BUGS)
