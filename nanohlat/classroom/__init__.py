"""The classroom kit: exercises students implement inside the reference code.

kit.py finds the exercise regions, writes student copies with stubs and runs
the checks (`python -m nanohlat.classroom list | new DIR | check ID`);
checks/ holds each exercise's check against an independent oracle, a file per chapter;
needs.py traces which exercises each command, chapter and check runs through.
docs/teaching.md is the teacher's guide.

This file holds only what the commands themselves need to know of the kit
(it imports nothing of nanohlat): how to recognise a stub that a student copy
reached (`not_done`), so that every command ends with one line naming the
exercise instead of a traceback or a misleading error. The checks recognise
a stub by the same pattern (classroom/checks/harness.py:explain).
"""

from __future__ import annotations

import re

# A stub's message (kit.py:Exercise.stub_message): "exercise 4b: <task>, see tutorial.md section 4"
STUB = re.compile(r"exercise (\d+[a-z]): (.*?), see tutorial\.md section (\d+)")


def not_done(e: BaseException | None) -> str | None:
    """The one line a command ends with when it reached an exercise stub of a
    student copy: `e`, or an exception it wraps (its cause or context), carries
    a stub's message. None for any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        m = STUB.search(str(e))
        if m:
            ex, task, section = m.groups()
            return (f"exercise {ex} is not done yet ({task}; tutorial.md section {section}) and this command "
                    f"runs through it: implement it, then `python -m nanohlat.classroom check {ex}`")
        e = e.__cause__ or e.__context__
    return None
