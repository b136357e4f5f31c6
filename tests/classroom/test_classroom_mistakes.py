"""The classroom checks against planted student mistakes: neither vacuous nor over-fitted.

For every exercise, several realistic wrong implementations (the kind a
student writes: a wrong sign or scale, an off-by-one, the wrong group, bf16
where fp32 belongs, the right values through a dearer collective, code that
only breaks on large logits or on an odd NaN) are planted in the exercise's
region, and its check must FAIL them, with a verdict that names the case that
caught the mistake. For every chapter, correct rewrites that differ from the
reference must PASS. The reference itself, in the same copy, must pass.

How a mistake is planted: the test writes a copy of the repository, then one
subprocess (its own nanohlat, from the copy) takes the plants one at a time:
it writes the planted file, imports nanohlat afresh (no bytecode cache), runs
that exercise's checks (`checks.run`, what `python -m nanohlat.classroom
check ID` runs, distributed checks with their gloo workers) and puts the file
back. One process for all of them keeps torch's import and the workers' fork
server to one start each. The plants themselves stand in plants_chapters_1_to_8.py,
plants_chapter_7_fp8.py and plants_chapters_10_and_11.py (what a plant is, and the helpers that write one: plants.py).

All of them take minutes. To plant one chapter's (or some exercises') only, name
them in NANOHLAT_PLANTS: `NANOHLAT_PLANTS=10 python -m pytest
tests/classroom/test_classroom_mistakes.py` (chapter 10), or `NANOHLAT_PLANTS="10a 10b"`;
the count that docs/teaching.md states is still held to every plant.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

import plants_chapter_7_fp8
import plants_chapters_1_to_8
import plants_chapters_10_and_11
from plants import ROOT, WRONG_COMM, Plant


BEGIN = re.compile(r"^(\s*)# exercise (\d+[a-z]): begin\s*$")
END = re.compile(r"^\s*# exercise (\d+[a-z]): end\s*$")


# every plant, chapter by chapter
PLANTS = plants_chapters_1_to_8.PLANTS + plants_chapter_7_fp8.PLANTS + plants_chapters_10_and_11.PLANTS


# ---------------------------------------------------------------------------
# Planting
# ---------------------------------------------------------------------------

def regions_of(text: str, ex: str) -> list[tuple[int, int, str]]:
    """[(begin line, end line, indent)] of exercise ex's regions in `text`, in order."""
    out, lines, open_at = [], text.splitlines(), None
    for i, line in enumerate(lines):
        m = BEGIN.match(line)
        if m and m.group(2) == ex:
            open_at = (i, m.group(1))
        elif END.match(line) and open_at and END.match(line).group(1) == ex:
            out.append((open_at[0], i, open_at[1]))
            open_at = None
    return out


def plant(root: str, p: Plant) -> dict[str, str]:
    """{file: its text with p's edits}, read from the copy at `root`."""
    from nanohlat.classroom import kit
    files = sorted({r[0] for r in kit.find_regions(root)[p.ex]})
    texts = {rel: open(os.path.join(root, rel), encoding="utf-8").read() for rel in files}
    changed = {}
    k_base, spans = 0, []
    for rel in files:
        n = len(regions_of(texts[rel], p.ex))
        spans.append((rel, k_base, n))
        k_base += n
    for edit in p.edits:
        if edit[0] == "body":
            _, k, code = edit
            rel, base, _ = next(s for s in spans if s[1] <= k < s[1] + s[2])
            text = changed.get(rel, texts[rel])
            b, e, indent = regions_of(text, p.ex)[k - base]
            lines = text.splitlines()
            new = [indent + ln if ln.strip() else "" for ln in code.splitlines()]
            changed[rel] = "\n".join(lines[:b + 1] + new + lines[e:]) + "\n"
        else:
            _, old, new = edit
            hits = [rel for rel in files if old in changed.get(rel, texts[rel])]
            assert len(hits) == 1, f"{p.ex} ({p.what}): {old!r} is not in exactly one file"
            text = changed.get(hits[0], texts[hits[0]])
            assert text.count(old) == 1, f"{p.ex} ({p.what}): {old!r} is not unique"
            at = text.index(old)
            lines_before = text[:at].count("\n")
            assert any(b < lines_before < e for b, e, _ in regions_of(text, p.ex)), \
                f"{p.ex} ({p.what}): {old!r} is outside the exercise's regions"
            changed[hits[0]] = text.replace(old, new)
    for rel, text in changed.items():
        compile(text, rel, "exec")        # a plant that does not even compile would test nothing
        assert text != texts[rel]
    return changed


DRIVER = r'''
import json, os, sys, time
sys.dont_write_bytecode = True
plan = json.load(open(sys.argv[1]))
results = []
for item in plan:
    saved = {}
    for rel, text in item["files"].items():
        saved[rel] = open(rel, encoding="utf-8").read()
        open(rel, "w", encoding="utf-8").write(text)
    for name in [m for m in sys.modules if m == "nanohlat" or m.startswith("nanohlat.")]:
        del sys.modules[name]                      # import the planted code afresh
    from nanohlat.classroom import checks, kit
    start = time.perf_counter()
    verdict = checks.run(kit.BY_ID[item["ex"]])
    results.append({"verdict": verdict, "seconds": time.perf_counter() - start})
    for rel, text in saved.items():
        open(rel, "w", encoding="utf-8").write(text)
json.dump(results, open(sys.argv[2], "w"))
'''


def chosen(ex: str) -> bool:
    """Whether exercise ex's plants run: NANOHLAT_PLANTS names chapters (10) or exercises (10a), or nothing: all."""
    only = os.environ.get("NANOHLAT_PLANTS", "").split()
    return not only or ex in only or ex[:-1] in only


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every plant's verdict (and the reference's, for each exercise), from one subprocess."""
    from nanohlat.classroom import kit
    dest = tmp_path_factory.mktemp("mistakes") / "copy"
    kit.make_copy(str(dest), [], ROOT)
    reference = [Plant(e.id, "the reference", [], right=True) for e in kit.EXERCISES]
    plants = [p for p in reference + PLANTS if chosen(p.ex)]
    plan = [{"ex": p.ex, "files": plant(str(dest), p)} for p in plants]
    (dest / "plan.json").write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", DRIVER, "plan.json", "results.json"], cwd=dest, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((dest / "results.json").read_text())
    print(f"\n{len(plants)} plants checked in {time.perf_counter() - start:.0f} s; slowest: "
          + ", ".join(f"{p.ex} {res['seconds']:.1f} s" for p, res in
                      sorted(zip(plants, results), key=lambda x: -x[1]["seconds"])[:3]))
    return list(zip(plants, results))


@pytest.mark.slow
def test_every_planted_mistake_fails_with_the_case_that_caught_it(outcomes):
    missed = []
    for p, res in outcomes:
        v = res["verdict"]
        if p.right:
            continue
        if v is None or v.startswith("not done yet") or p.catches not in v:
            missed.append(f"{p.ex} {p.what}: expected a verdict naming {p.catches!r}, got {v!r}")
        elif res["seconds"] > p.extra.get("within_s", float("inf")):   # (a hang: stopped and named in time)
            missed.append(f"{p.ex} {p.what}: its verdict took {res['seconds']:.0f} s, more than {p.extra['within_s']} s")
        if "within_s" in p.extra:
            print(f"{p.ex} {p.what}: {res['seconds']:.1f} s: {v}")
    assert not missed, "\n".join(missed)


@pytest.mark.slow
def test_the_reference_and_every_correct_rewrite_pass(outcomes):
    failed = [f"{p.ex} {p.what}: {res['verdict']}" for p, res in outcomes if p.right and res["verdict"] is not None]
    assert not failed, "\n".join(failed)


def test_the_plants_cover_every_exercise_and_chapter():
    """At least 3 mistakes per exercise and a correct rewrite per chapter; the
    communication exercises each have a mistake with right values through a dearer
    collective or the wrong group; the hostile inputs each catch one."""
    from nanohlat.classroom import kit
    for e in kit.EXERCISES:
        n = sum(1 for p in PLANTS if p.ex == e.id and not p.right)
        assert n >= 3, f"exercise {e.id}: {n} planted mistakes"
    chapters = {e.chapter for e in kit.EXERCISES}
    assert chapters <= {int(p.ex[:-1]) for p in PLANTS if p.right}
    for ex in ("3b", "3c", "3d", "3e", "4a", "4b", "4c", "10c", "11c"):
        assert any(WRONG_COMM in p.catches for p in PLANTS if p.ex == ex), ex
    for ex in ("3a", "3b", "3d", "3e", "4a"):
        assert any("default (world)" in p.catches for p in PLANTS if p.ex == ex), ex
    for ex, words in (("4c", "large logits"), ("7a", "odd NaN"), ("7a", "noise drawn by the function"),
                      ("1a", "1.5 bf16 steps"), ("1c", "ragged rows"), ("11a", "large logits"),
                      ("11c", "bf16 inputs"), ("11c", "a deadlock"), ("10a", "large logits"),
                      ("10b", "bf16 inputs"), ("11c", "no block travelled"), ("10a", "sequence parallelism"),
                      ("10a", "through balance")):
        assert any(words in p.catches for p in PLANTS if p.ex == ex), (ex, words)
    # docs/teaching.md says how many there are
    mistakes = [p for p in PLANTS if not p.right]
    per = [sum(1 for p in mistakes if p.ex == e.id) for e in kit.EXERCISES]
    with open(os.path.join(ROOT, "docs", "teaching.md"), encoding="utf-8") as f:
        guide = " ".join(f.read().split())
    assert f"plants {len(mistakes)} realistic wrong implementations ({min(per)} to {max(per)} per exercise" in guide
