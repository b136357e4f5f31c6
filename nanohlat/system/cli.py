"""How every command of nanohlat ends: one line and an exit code, written once.

train.py (its pre-flight's main), sample.py, eval.py and the `python -m` commands (nanohlat.bench,
.hf, .harness, .serving, .classroom, .classroom.compile_lessons) each decorate
their `main` with `command`, which ends it the same way:

  * bad input (a config.UserError): "error: <what to do>", exit code 2;
  * the system refused (an OSError: a full disk, a permission, a missing
    file): "error: <the path and the reason>" (files.py:os_error_message),
    exit code 2;
  * Ctrl-C reaching it (a second one, during training: preempt.py):
    "interrupted", exit code 130;
  * an exercise stub of a student copy reached anywhere (`not_done`): one
    line naming the exercise, exit code 2;
  * anything else is a crash (a bug) and keeps its traceback.

A student copy of the repository (`python -m nanohlat.classroom new DIR`)
replaces each exercise's body with a stub that raises a NotImplementedError
naming the exercise (classroom/kit.py:Exercise.stub_message); workers say the
same line through run/launch.py:worker_stub.
"""

from __future__ import annotations

import functools
import re
import sys

from nanohlat.config import UserError
from nanohlat.system.files import os_error_message

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


def command(main):
    """`main` (a command's, returning its exit code) with the end every command
    shares (this module's docstring): called, it returns main's exit code, or
    2 / 130 after printing the one line."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            return error(str(e))
        except OSError as e:
            return error(os_error_message(e))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            line = not_done(e)
            if line is None:
                raise
            return error(line)
    return run


def error(line: str) -> int:
    print(f"error: {line}", file=sys.stderr)
    return 2
