"""Chapter 5, pipeline parallelism: the 1F1B order (5a), the exchange plan (5b), the interleaved order (5c).

Against timetables derived by hand from each schedule's definition, for
every stage of several (pp, m) and (pp, m, v), fewer micro-batches than
stages included; 5b against what crosses each boundary after each tick of
the AFAB and 1F1B timetables, 5c also against the bubble (pp-1)/(v m+pp-1).
"""

from __future__ import annotations

from nanohlat.classroom.checks.grading import case


def oracle_1f1b(pp: int, m: int, stage: int) -> list[tuple[str, int]]:
    """1F1B as the tutorial states it: pp-1-stage warm-up forwards (at most m),
    then alternate one forward, one backward, then the remaining backwards."""
    warm = min(pp - 1 - stage, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def check_1f1b() -> str | None:
    from nanohlat.pipeline import stage_order
    for pp, m in ((2, 1), (2, 4), (4, 4), (4, 8), (4, 2), (8, 3)):
        for stage in range(pp):
            name = case(f"pp={pp}, m={m}, stage={stage}" + (" (fewer micro-batches than stages)" if m < pp - 1 - stage else ""))
            got = stage_order("1f1b", pp, m, stage)
            want = oracle_1f1b(pp, m, stage)
            if [tuple(op) for op in got] != want:
                fmt = lambda ops: " ".join(f"{k}{i}" for k, i in ops)
                return (f"{name}: stage_order('1f1b', pp={pp}, m={m}, stage={stage}):\n"
                        f"  got      {fmt(got)}\n  expected {fmt(want)}")
    return None


def check_exchange_plan() -> str | None:
    from types import SimpleNamespace
    from nanohlat.pipeline import PipelineRunner
    from nanohlat.beyond.schedules import timetable
    for schedule in ("afab", "1f1b"):
        for pp, m in ((2, 3), (4, 4), (4, 6)):
            case(f"{schedule}, pp {pp}, m {m}")
            ticks = timetable(schedule, pp, m)
            runner = SimpleNamespace(ticks=ticks)
            when = {(op[0], s, op[1]): t for t, row in enumerate(ticks) for s, op in enumerate(row) if op}
            for t in range(len(ticks)):
                for b in range(pp - 1):
                    # oracle: after tick t, the activation of F(b, i) crosses b -> b+1 if F(b, i) ran at t,
                    # and the gradient of B(b+1, j) crosses b+1 -> b if B(b+1, j) ran at t
                    act = next((i for i in range(m) if when[("F", b, i)] == t), None)
                    grad = next((j for j in range(m) if when[("B", b + 1, j)] == t), None)
                    got = tuple(PipelineRunner._exchange_plan(runner, t, b))
                    if got != (act, grad):
                        return (f"{schedule}, pp {pp}, m {m}: _exchange_plan(tick {t}, boundary {b}->{b + 1}) = "
                                f"{got} (activation, gradient), expected {(act, grad)}")
    return None


def oracle_interleaved(pp: int, m: int, v: int, stage: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B from its definition: the j-th forward of a stage
    takes micro-batch (j // (pp v)) pp + j % pp through chunk (j // pp) % v,
    the j-th backward the same micro-batch through chunk v-1 - (j // pp) % v;
    2(pp-1-stage) + (v-1)pp warm-up forwards (at most v m), then alternate."""
    total = v * m
    fwd = [("F", (j // (pp * v)) * pp + j % pp, (j // pp) % v) for j in range(total)]
    bwd = [("B", (j // (pp * v)) * pp + j % pp, v - 1 - (j // pp) % v) for j in range(total)]
    warm = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)
    order = fwd[:warm]
    for j in range(total - warm):
        order += [fwd[warm + j], bwd[j]]
    return order + bwd[total - warm:]


def check_interleaved() -> str | None:
    from fractions import Fraction as Frac
    from nanohlat.beyond.schedules import interleaved_order, timetable
    fmt = lambda ops: " ".join(f"{k}{i}.{c}" for k, i, c in ops)
    for pp, m, v in ((2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (2, 6, 3)):
        for stage in range(pp):
            name = case(f"pp={pp}, m={m}, v={v}, stage={stage}")
            got = [tuple(op) for op in interleaved_order(pp, m, v, stage)]
            want = oracle_interleaved(pp, m, v, stage)
            if got != want:
                return (f"{name}: interleaved_order(pp={pp}, m={m}, v={v}, stage={stage}) "
                        f"(op micro-batch.chunk):\n  got      {fmt(got)}\n  expected {fmt(want)}")
        name = case(f"pp={pp}, m={m}, v={v}: the timetable's bubble")
        ticks = timetable("interleaved", pp, m, v)
        idle = Frac(sum(op is None for row in ticks for op in row), len(ticks) * pp)
        if idle != Frac(pp - 1, v * m + pp - 1):
            return (f"{name}: the stages idle {idle} of the time, where (pp-1)/(v m+pp-1) = "
                    f"{Frac(pp - 1, v * m + pp - 1)}")
    return None
