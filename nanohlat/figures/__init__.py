"""`python -m nanohlat.figures`: every figure of tutorial.md, drawn from nanohlat's own objects.

A figure is its numbers, read from the code that trains (the mesh's groups, the schedules' orders,
the planner, the loader, a short run's metrics), and an SVG drawn from exactly those numbers
(tools/svg.py): never a number typed in by hand, so a figure cannot drift from the code without the
test noticing. Each figure is written as docs/figures/NAME.svg beside NAME.json, the numbers drawn;
`check` redraws them and says which committed file is no longer what the code draws
(tests/commands/test_figures.py runs it). structure.py holds the figures that need no run,
runs.py those that run something.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import partial

from nanohlat.figures import runs, structure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(ROOT, "docs", "figures")


@dataclass(frozen=True)
class Figure:
    chapter: int
    data: object          # () -> the numbers drawn (a JSON-able dict)
    svg: object           # (numbers) -> the SVG text
    trained: bool = False  # drawn from a training run's floats: they agree across machines within TOLERANCE
    caption: str = ""
    slow: bool = False     # it starts processes that train (the test marks it slow)


FIGURES = {
    "model_parts": Figure(1, structure.model_parts_data, structure.model_parts_svg,
                          caption="parameters and training FLOPs per token by part, tiny and hlat-7b"),
    "compile_lessons": Figure(2, runs.compile_lessons_data, runs.compile_lessons_svg,
                              caption="what torch.compile makes of each way of writing a step"),
    "zero_bytes": Figure(3, structure.zero_bytes_data, structure.zero_bytes_svg,
                         caption="what a rank keeps between steps at ZeRO 0 to 3, from the plan"),
    "tp_block": Figure(4, structure.tp_block_data, structure.tp_block_svg,
                       caption="a block's weights at tp 2, the slice each rank holds, and its f and g"),
    "ledger": Figure(4, runs.ledger_data, runs.ledger_svg, slow=True,
                     caption="tp 2 with SP: the first step's comm ledger against the plan, per collective"),
    **{f"pipeline_{s.replace('-', '_')}": Figure(5, partial(structure.schedule_data, s, v=2 if s == "interleaved"
                                                           else 1), structure.schedule_svg,
                                                 caption=f"{s}'s timetable as the runner runs it, and ideal")
       for s in ("afab", "1f1b", "interleaved", "zb-h1")},
    "mesh": Figure(6, structure.mesh_data, structure.mesh_svg,
                   caption="the ranks of a tp 2, cp 2, dp 2, pp 2 mesh and every group of each kind"),
    "precision": Figure(7, runs.precision_data, runs.precision_svg,
                        caption="small updates kept in fp32, bf16 rounded to nearest, bf16 rounded stochastically"),
    "reshard": Figure(8, structure.reshard_data, structure.reshard_svg,
                      caption="a checkpoint saved at tp 2 x pp 2, loaded at tp 4: who reads what"),
    "serving_slots": Figure(9, runs.serving_slots_data, runs.serving_slots_svg,
                            caption="continuous batching's slots over model passes"),
    "moe_load": Figure(10, runs.moe_load_data, runs.moe_load_svg, trained=True, slow=True,
                       caption="the experts' load over 20 steps: no balancing, the balance loss, the bias"),
    "cp_pairs": Figure(11, structure.cp_pairs_data, structure.cp_pairs_svg,
                       caption="the zigzag chunks and each rank's (query chunk, key chunk) pairs"),
    "lab_compare": Figure(12, runs.lab_compare_data, runs.lab_compare_svg, trained=True, slow=True,
                          caption="compare: one process, dp 2, and dp 2 with bug 0"),
}

# How far a trained figure's numbers may move on another machine (another CPU's float kernels, another
# thread count, torch 2.9), relative and absolute: (rel, abs) per figure.
# * lab_compare's losses and grad norms: the tutorial's own bound for losses across machines, 0.1%
#   (tutorial.md's opening; tests/repo/test_tutorial.py's REL_TOL), while bug 0 moves them by whole percents.
# * moe_load's loads are token counts over their mean: round-off can tip a token whose two likeliest
#   experts tie, and each token moved changes moe_load_max by E / (N k) = 4 / 512 ~ 0.008 (N = 8 x 32
#   tokens a step, top-2 of 4). 0.05 lets about six tokens of 512 go elsewhere, far less than the
#   figure's lesson (no balancing reaches 2.0, the balance loss and the bias stay near 1.3-1.6).
TOLERANCE = {"lab_compare": (1e-3, 0.0), "moe_load": (0.0, 0.05)}


def draw(name: str) -> tuple[dict, str]:
    """(the numbers, the SVG) of figure `name`, as the code draws it now. The numbers are taken
    through JSON first, so that what is drawn is exactly what NAME.json holds."""
    fig = FIGURES[name]
    data = json.loads(json.dumps(fig.data()))
    return data, fig.svg(data)


def paths(name: str, folder: str = FOLDER) -> tuple[str, str]:
    return os.path.join(folder, f"{name}.json"), os.path.join(folder, f"{name}.svg")


def json_of(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


def close(a, b, rel: float, abs_: float, where: str = "") -> list[str]:
    """Where the numbers `a` (drawn now) and `b` (committed) differ by more than rel x |b| + abs_
    (anything but a number: at all)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where or 'top'}: keys {list(a)} != {list(b)}"]
        return [p for k in a for p in close(a[k], b[k], rel, abs_, f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in close(x, y, rel, abs_, f"{where}[{i}]")]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if numbers and math.isfinite(a) and math.isfinite(b):
        return [] if abs(a - b) <= rel * abs(b) + abs_ else [f"{where}: {a} now, {b} committed"]
    return [] if a == b else [f"{where}: {a!r} now, {b!r} committed"]


def check(name: str, folder: str = FOLDER, drawn: tuple[dict, str] | None = None) -> list[str]:
    """What is wrong with figure `name`'s committed files: [] when NAME.json holds the numbers the
    code draws now (exactly; a trained figure's within TOLERANCE) and NAME.svg is the drawing of
    NAME.json's numbers by the code now."""
    jpath, spath = paths(name, folder)
    if not (os.path.isfile(jpath) and os.path.isfile(spath)):
        return [f"{name}: {jpath} or {spath} is missing"]
    with open(jpath, encoding="utf-8") as f:
        committed = json.load(f)
    with open(spath, encoding="utf-8") as f:
        svg_text = f.read()
    data, _ = drawn or draw(name)
    rel, abs_ = TOLERANCE.get(name, (0.0, 0.0)) if FIGURES[name].trained else (0.0, 0.0)
    problems = [f"{name}.json{p}" for p in close(data, committed, rel, abs_)][:5]
    if svg_text != FIGURES[name].svg(committed):
        problems.append(f"{name}.svg is not the drawing of {name}.json by the code now")
    return problems
