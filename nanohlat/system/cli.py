"""How a command of nanohlat ends when a student copy's exercise stub stops it.

A student copy of the repository (`python -m nanohlat.classroom new DIR`)
replaces each exercise's body with a stub that raises a NotImplementedError
naming the exercise (classroom/kit.py:Exercise.stub_message). Every command
(train.py, sample.py, eval.py, the `python -m` commands) runs through
`command`, which turns such a stub, reached anywhere, into one line naming the
exercise instead of a traceback or a misleading error; workers say the same
line through run/launch.py:worker_stub.
"""

from __future__ import annotations

import re
import sys

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


def command(main, *args) -> int:
    """Run a command's `main(*args)` (train.py, sample.py, eval.py, python -m
    nanohlat.serving, ...) and return its exit code. An exercise stub of a
    classroom student copy reached anywhere in it (nanohlat/classroom) ends it
    with one line naming the exercise, exit code 2; any other exception is a
    crash and keeps its traceback. (Workers say it through `worker_stub`.)"""
    try:
        return main(*args)
    except Exception as e:
        line = not_done(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
