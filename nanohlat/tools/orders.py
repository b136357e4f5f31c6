"""Any --schedule's orders, timetable and layers, for what measures and predicts a step.

The core runs AFAB and 1F1B (pipeline.py); interleaved and ZB-H1 live beyond it
(beyond/schedules.py), which these functions import only when a schedule of its
own is asked for: a run of HLAT's recipe, its --timeline and its plan never load
nanohlat/beyond/ (tests/run/test_core_runs_alone.py). Each answers as
beyond/schedules.py's function of the same name does, for every schedule.
"""

from __future__ import annotations

from nanohlat import pipeline

CORE = ("afab", "1f1b")   # the schedules pipeline.py runs itself


def stage_ops(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Stage `stage`'s ops in order, as (kind, micro-batch, chunk)."""
    if schedule in CORE:
        return pipeline.stage_ops(schedule, pp, m, stage)
    from nanohlat.beyond import schedules
    return schedules.stage_ops(schedule, pp, m, stage, v)


def depends_on(schedule: str, op: tuple[str, int, int], stage: int, pp: int, v: int = 1) -> tuple | None:
    """The op that must finish before `op` of `stage` starts (pipeline.depends_on; ZB-H1's W: its own B)."""
    if schedule in CORE:
        return pipeline.depends_on(op, stage, pp, v)
    from nanohlat.beyond import schedules
    return schedules.depends_on(op, stage, pp, v)


def timetable(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int] | None]]:
    """The ticks of the schedule: ticks[t][s], stage s's op in tick t or None (pipeline.timetable)."""
    if schedule in CORE:
        return pipeline.timetable([pipeline.stage_ops(schedule, pp, m, s) for s in range(pp)], pp)
    from nanohlat.beyond import schedules
    return schedules.timetable(schedule, pp, m, v)


def chunk_layers(n_layers: int, pp: int, stage: int, chunk: int = 0, v: int = 1) -> range:
    """The layers of chunk `chunk` of stage `stage`: with one chunk a stage, pipeline.stage_layers."""
    if v == 1:
        return pipeline.stage_layers(n_layers, pp, stage)
    from nanohlat.beyond import schedules
    return schedules.chunk_layers(n_layers, pp, stage, chunk, v)
