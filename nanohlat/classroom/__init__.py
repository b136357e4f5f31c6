"""The classroom kit: exercises students implement inside the reference code.

kit.py finds the exercise regions, writes student copies with stubs and runs
the checks (`python -m nanohlat.classroom list | new DIR | check ID`);
checks/ holds each exercise's check against an independent oracle, a file per chapter;
isolate.py runs them in a child process the student's code cannot end the verdict of;
needs.py traces which exercises each command, chapter and check runs through.
docs/teaching.md is the teacher's guide.

How a command recognises a stub that a student copy reached, so that it ends
with one line naming the exercise, is system/cli.py's (`not_done`): every
command needs it, and the kit stands above the floors it checks, every one
but the commands (docs/design.md 1). The checks recognise a stub by the same
pattern (system/cli.py:STUB, read by classroom/checks/grading.py:explain).
"""
