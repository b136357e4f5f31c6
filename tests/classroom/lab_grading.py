"""The lab's runs for its tests (test_debugging_lab.py, test_debugging_lab_wrong_fixes.py), made once a session.

Training is the expensive part, so everything the two files assert about is
graded in one call of lab.grade, in one set of worker pools (each one-process
reference run once, shared by every variant that needs it):

  * "ref{n}": the reference fix of bug n (the reference's own code: a run with the
    flags of a one-process reference is that run; test_debugging_lab's
    end-to-end test grades a copy on disk), every case;
  * "bug{n}": bug n planted, every case (LAB.md's "shows" and "trains like one
    process" are both held to them);
  * "wrong{k}": wrong fix k of test_debugging_lab_wrong_fixes.WRONG_FIXES, up to
    its first failing case;
  * LESSON_RUNS: one-process runs a lesson's figure is measured on.
The hangs (bug 10, 12 and the wrong fixes that hang) cost COLLECTIVE_S each
and a fresh pool; lab_workers ends a pool that saw one.
"""

from __future__ import annotations

import atexit
import functools
import time

from conftest import ROOT
from nanohlat.classroom import lab, lab_bugs, lab_workers
from nanohlat.classroom.lab_workers import Job

LESSON_STEPS = 40
# bug 9's symptom: the loss's fall over 40 steps at lr 1e-5, fp32 / bf16-sr / bf16-sr with the bug
LESSON_RUNS = {name: lab.BASE + ["--steps", str(LESSON_STEPS), "--lr", "1e-5", "--min-lr", "1e-5", "--precision", prec]
               for name, prec in (("fp32", "fp32"), ("sr", "bf16-sr"), ("rne", "bf16-sr"))}


@functools.lru_cache(maxsize=None)
def graded() -> dict:
    """lab.grade's verdicts and runs for every variant above, the lesson runs under ("lesson", name), the
    time it took under "seconds"; the pools stay open (their runs' files read by the tests) until exit."""
    from test_debugging_lab_wrong_fixes import WRONG_FIXES, texts
    start = time.perf_counter()
    variants = {f"ref{b.n}": (b, ROOT, {}) for b in lab_bugs.BUGS}
    variants.update({f"bug{b.n}": (b, ROOT, lab.planted(b, ROOT)) for b in lab_bugs.BUGS})
    variants.update({f"wrong{k}": (lab_bugs.BY_N[f.n], ROOT, texts(f)) for k, f in enumerate(WRONG_FIXES)})
    pools = lab_workers.Pools()
    atexit.register(pools.__exit__, None, None, None)
    rne = lab.planted(lab_bugs.BY_N[9], ROOT)
    lessons = pools.run([Job(f"lesson:{name}", ROOT, [argv], 1, rne if name == "rne" else {})
                         for name, argv in LESSON_RUNS.items()])
    got = lab.grade(variants, every={t for t in variants if not t.startswith("wrong")}, pools=pools)
    got.update({("lesson", name): lab.read_steps(r["out"]) for name, r in
                ((k.split(":")[1], v) for k, v in lessons.items())})
    got["seconds"] = time.perf_counter() - start
    return got
