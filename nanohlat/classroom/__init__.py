"""The classroom kit: exercises students implement inside the reference code.

kit.py finds the exercise regions, writes student copies with stubs and runs
the checks (`python -m nanohlat.classroom list | new DIR | check ID`);
checks.py holds each exercise's check against an independent oracle.
docs/teaching.md is the teacher's guide.
"""
