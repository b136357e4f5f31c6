"""What a planted mistake is (`Plant`) and the helpers that write one, for the plants of
plants_chapters_1_to_8.py and plants_chapters_10_and_11.py, which test_classroom_mistakes.py
plants one at a time in a copy of the repository."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Plant:
    ex: str                      # the exercise whose check runs
    what: str                    # the mistake (or the rewrite), in one line
    edits: list                  # ("body", k, code): region k of ex becomes `code`; ("sub", old, new) inside ex's regions
    catches: str = ""            # a mistake: words of the verdict naming the case that caught it
    right: bool = False          # a correct rewrite: must pass
    extra: dict = field(default_factory=dict)


def body(k: int, code: str):
    return ("body", k, textwrap.dedent(code).strip("\n"))


def reference(ex: str, k: int = 0) -> str:
    """Region k of exercise ex as the reference has it (dedented): the code a
    mistake edits, read from the source so that it cannot go stale."""
    from nanohlat.classroom import kit
    path, begin, end, _ = kit.find_regions(ROOT)[ex][k]
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return textwrap.dedent("\n".join(f.read().splitlines()[begin + 1:end])) + "\n"


def sub(old: str, new: str):
    return ("sub", old, new)


def wrong(ex, what, catches, *edits):
    return Plant(ex, what, list(edits), catches=catches)


def right(ex, what, *edits):
    return Plant(ex, what, list(edits), right=True)


# words of the verdicts that several chapters' plants expect
WRONG_COMM = "right values, but"
WROTE_INTO = "right values, but it wrote into"
