"""The step's tools: what runs inside a training step beside the lesson, and
what measures and predicts a step.

Inside the step, when asked for: torch.compile of the stage (compile.py,
`--compile`), the optimizer's faster update (fast_adamw.py: torch's fused
AdamW kernel on the CPU, compiled with --compile elsewhere), the step clock that times every forward
and backward (timeline.py, `--timeline`) and the comm trace that times and
names every collective of the step (comm_trace.py). Beside it: the
timeline's report and its bubble (timeline.py), the collectives' report
(comm_trace.py), what a step is measured in (metrics.py: FLOPs per token,
peaks, MFU, tokens/s, bytes). The plan, which predicts a step before any
runs, stands on these in a floor of its own (nanohlat/plan/); tutorial
chapter 2's graph-compiler lessons, which run compile.py, are the classroom's
(classroom/compile_lessons.py).

run/ builds its step with these; nothing here starts,
resumes or saves a run, so nothing here imports run/ or any floor above it
(docs/design.md 1). The core never imports these.
"""
