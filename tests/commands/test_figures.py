"""`python -m nanohlat.figures`: the committed figures (docs/figures/NAME.svg and NAME.json) are what
the code draws now, every chapter 1-12 of tutorial.md shows one with a caption naming the command,
and a stale figure is caught.

A figure drawn from structure (the mesh, the schedules, the plan, the zigzag, the loader, what
torch.compile counts, bf16 sums that are exact in any order, the server's passes, a run's comm
ledger) must be redrawn to the last digit. The two drawn from a training run's floats (moe_load,
lab_compare) are held to figures.TOLERANCE, which says why each bound is what another CPU's float
kernels need and far from what the figure shows. The three that start training processes (those two
and the ledger's) are `slow`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from nanohlat import figures
from nanohlat.figures.__main__ import main

ROOT = figures.ROOT
QUICK = [n for n, f in figures.FIGURES.items() if not f.slow]
TRAINING = [n for n, f in figures.FIGURES.items() if f.slow]


@pytest.mark.parametrize("name", QUICK)
def test_a_figure_is_what_the_code_draws_now(name):
    assert not figures.FIGURES[name].trained    # (exactly: no tolerance)
    assert figures.check(name) == [], f"redraw it: python -m nanohlat.figures --only {name}"


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINING)
def test_a_figure_of_training_runs_is_what_they_draw_now(name):
    """Exactly for the ledger's byte counts; within TOLERANCE for a trained figure's floats."""
    assert figures.FIGURES[name].trained == (name in figures.TOLERANCE)
    assert figures.check(name) == [], f"redraw it: python -m nanohlat.figures --only {name}"


def test_a_stale_figure_is_caught(tmp_path):
    """The check can fail: a number of the JSON changed, the SVG edited, a file missing."""
    for name in ("mesh", "lab_compare"):
        for path in figures.paths(name):
            shutil.copy(path, tmp_path)
    drawn = figures.draw("mesh")
    assert figures.check("mesh", str(tmp_path), drawn) == []
    jpath, spath = figures.paths("mesh", str(tmp_path))
    data = json.load(open(jpath))
    data["groups"]["tp"][0] = [0, 2]                       # a group that is not the mesh's
    open(jpath, "w").write(figures.json_of(data))
    problems = figures.check("mesh", str(tmp_path), drawn)
    assert any("groups.tp[0]" in p for p in problems) and any("not the drawing" in p for p in problems), problems
    shutil.copy(figures.paths("mesh")[0], jpath)
    open(spath, "a").write(" ")                            # the SVG no longer the drawing of its JSON
    assert figures.check("mesh", str(tmp_path), drawn) == ["mesh.svg is not the drawing of mesh.json by the code now"]
    os.remove(spath)
    assert "missing" in figures.check("mesh", str(tmp_path), drawn)[0]


def test_a_trained_figure_tolerates_round_off_not_a_change():
    """lab_compare's committed numbers, moved by 1e-4 relative (within the 0.1% the tutorial allows
    across machines) pass; moved by 1e-2, or with another first differing step, they do not."""
    data = json.load(open(figures.paths("lab_compare")[0]))
    rel, abs_ = figures.TOLERANCE["lab_compare"]

    def moved(factor, first=None):
        d = json.loads(json.dumps(data))
        d["runs"]["dp 2"]["loss"] = [v * factor for v in d["runs"]["dp 2"]["loss"]]
        if first is not None:
            d["runs"]["dp 2"]["first_step_differing"] = first
        return figures.close(d, data, rel, abs_)

    assert moved(1 + 1e-4) == []
    assert len(moved(1 + 1e-2)) == len(data["runs"]["dp 2"]["loss"])
    assert moved(1, first=2) != []
    assert data["runs"]["dp 2"]["first_step_differing"] is None            # a right layout agrees
    assert data["runs"]["dp 2, bug 0"]["first_step_differing"] == 1         # bug 0 is off from step 1


def test_the_command_writes_lists_checks_and_refuses(tmp_path, capsys):
    out = str(tmp_path / "figs")
    assert main(["--only", "tp_block", "cp_pairs", "--out", out]) == 0
    for name in ("tp_block", "cp_pairs"):
        for mine, committed in zip(figures.paths(name, out), figures.paths(name)):
            assert open(mine).read() == open(committed).read()
    assert main(["--only", "tp_block", "--out", out, "--check"]) == 0
    open(figures.paths("tp_block", out)[1], "a").write("<!-- edited -->")
    assert main(["--only", "tp_block", "--out", out, "--check"]) == 1
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in figures.FIGURES)
    assert main(["--only", "no_such_figure", "--out", out]) == 2
    assert "--list" in capsys.readouterr().err
    os.mkfifo(figures.paths("mesh", out)[0])               # not a file: refused before anything is written
    assert main(["--only", "mesh", "--out", out]) == 2
    assert not os.path.exists(figures.paths("mesh", out)[1])


def _chapters() -> dict[int, str]:
    text = open(os.path.join(ROOT, "tutorial.md"), encoding="utf-8").read()
    text = text[:text.index("\n## Solutions")]
    parts = re.split(r"\n## (\d+)\. ", text)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_chapter_shows_a_figure_the_command_draws():
    chapters = _chapters()
    assert sorted(chapters) == list(range(1, 13))
    shown = {}
    for number, body in chapters.items():
        images = re.findall(r"!\[[^\]]+\]\(docs/figures/(\w+)\.svg\)\n\*([^*]+)\*", body)
        assert images, f"chapter {number} shows no figure of docs/figures with its caption under it"
        for name, caption in images:
            assert name in figures.FIGURES and os.path.isfile(figures.paths(name)[1]), name
            assert f"`python -m nanohlat.figures --only {name}`" in caption, (number, name, caption)
            assert figures.FIGURES[name].chapter == number, (name, number)
            shown[name] = number
    assert sorted(shown) == sorted(figures.FIGURES), "a figure drawn but shown nowhere, or shown twice"


def test_drawing_needs_no_matplotlib():
    code = ("import sys; from nanohlat import figures; [figures.draw(n) for n in ('mesh', 'precision')]; "
            "assert 'matplotlib' not in sys.modules, 'figures imported matplotlib'")
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
