"""The pipeline's timeline and its bubble, three ways (`train.py --timeline`).

pipeline.py decides *what* each stage runs in each tick; this file times it
and says how much of the step was idle, the **bubble**:

1. ideal: the stage orders of pipeline.timetable with a forward taking 1 unit
   and a backward 2 (it computes two gradients, for the input and for the
   weights), no communication, each op starting as soon as its input exists.
   This is the figure to reason with; for AFAB and 1F1B it equals
2. the formula (p-1)/(m+p-1) of the GPipe and Megatron papers, and
3. measured: the wall time of each forward and backward on each stage in the
   last step. It includes everything the ideal leaves out: communication,
   the lock-step ticks of the runner, a slow last stage (the loss), and, on a
   laptop, processes waiting for a CPU core. So it is a property of this run
   on this machine, not of the schedule; the report says when ranks
   outnumber cores.

On CUDA the clock synchronises the device around every op (with --timeline
only): kernels are launched asynchronously, and without the wait the
timeline would show launches, not work. On XLA the host only records the
graph, so the measured timeline shows tracing, not device time.
"""

from __future__ import annotations

import io
import os
import time

import torch

from nanohlat import comm, pipeline
from nanohlat.run import files

F_UNITS, B_UNITS = 1.0, 2.0     # the ideal timeline's forward and backward


def wait_for_device(device) -> None:
    """Block until the device has finished the work queued so far (CUDA);
    CPU ops are done when they return."""
    if device.kind == "cuda":
        torch.cuda.synchronize(device.torch_device)


class StepClock:
    """Start and end of every forward and backward of one step on this stage.

    With --timeline, run/build.py gives the PipelineRunner this clock
    (otherwise it has none and times nothing). The runner calls start()
    before a step's first tick, op_start() before each forward or backward
    (what it returns comes back to op_end as `started`), op_end(kind,
    micro-batch, started) after it and stop() after the last tick; `records`
    then holds (kind, micro-batch, start, end) in seconds since start().
    With `synchronize` each reading first waits for the device.
    """

    def __init__(self, device, synchronize: bool = False):
        self.device, self.synchronize = device, synchronize
        self.records: list[tuple[str, int, float, float]] = []
        self.t0 = self.t1 = 0.0

    def _now(self) -> float:
        if self.synchronize:
            wait_for_device(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.records = []
        self.t0 = self._now()

    def op_start(self) -> float:
        return self._now()

    def op_end(self, kind: str, i: int, started: float) -> None:
        self.records.append((kind, i, started - self.t0, self._now() - self.t0))

    def stop(self) -> None:
        self.t1 = self._now()

    def busy_fraction(self) -> float:
        """Share of the last step this stage spent inside its forwards and backwards."""
        busy = sum(e - b for _, _, b, e in self.records)
        return busy / max(self.t1 - self.t0, 1e-9)


# ---------------------------------------------------------------------------
# The bubble without measuring
# ---------------------------------------------------------------------------

def formula_bubble(pp: int, m: int) -> float:
    """(p-1)/(m+p-1): the idle share of a step for p stages and m micro-batches."""
    return (pp - 1) / (m + pp - 1)


def ideal_timeline(schedule: str, pp: int, m: int, f: float = F_UNITS, b: float = B_UNITS):
    """Each stage's ops as (kind, micro-batch, start, end) when a forward takes f
    and a backward b, with no communication: an op starts when the stage is
    free and its input exists (F(s,i) after F(s-1,i); B(s,i) after B(s+1,i),
    the last stage's after its own F). Returns (rows, makespan)."""
    orders = [pipeline.stage_order(schedule, pp, m, s) for s in range(pp)]
    rows: list[list[tuple[str, int, float, float]]] = [[] for _ in range(pp)]
    done: dict = {}                          # (kind, stage, mb) -> end time
    while any(len(rows[s]) < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            if len(rows[s]) == len(orders[s]):
                continue
            kind, i = orders[s][len(rows[s])]
            dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                  (("B", s + 1, i) if s < pp - 1 else ("F", s, i))
            if dep is not None and dep not in done:
                continue                     # its input is not computed yet: try the next stage
            free = rows[s][-1][3] if rows[s] else 0.0
            start = max(free, done[dep] if dep else 0.0)
            end = start + (f if kind == "F" else b)
            rows[s].append((kind, i, start, end))
            done[(kind, s, i)] = end
    return rows, max(r[-1][3] for r in rows)


def ideal_bubble(schedule: str, pp: int, m: int, f: float = F_UNITS, b: float = B_UNITS) -> float:
    """Idle share of the ideal timeline, averaged over stages."""
    _, span = ideal_timeline(schedule, pp, m, f, b)
    return 1.0 - m * (f + b) / span


def lockstep_bubble(ticks, m: int, f: float = F_UNITS, b: float = B_UNITS) -> float:
    """Idle share when every tick of the timetable lasts as long as its slowest
    op, as PipelineRunner's exchanges after each tick come close to."""
    span = sum(max((f if op[0] == "F" else b) for op in row if op) for row in ticks)
    return 1.0 - m * (f + b) / span


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------

def render_ticks(ticks, pp: int) -> str:
    """The timetable as text, one row per stage: 'F3' forward of micro-batch 3, '..' idle."""
    rows = []
    for s in range(pp):
        cells = [(f"{row[s][0]}{row[s][1]}" if row[s] else "..").rjust(3) for row in ticks]
        rows.append(f"stage {s} |" + "".join(cells))
    return "\n".join(rows)


def _draw(rows, total: float, width: int = 72) -> list[str]:
    """Each stage's ops drawn to scale in `width` characters: F, B, or . for idle."""
    lines = []
    for s, ops in enumerate(rows):
        row = ["."] * width
        for kind, i, b, e in ops:
            lo = int(b / total * width)
            hi = max(lo + 1, int(e / total * width))
            for c in range(lo, min(hi, width)):
                row[c] = kind
        lines.append(f"stage {s} |" + "".join(row) + "|")
    return lines


def oversubscription(device) -> str:
    """A warning when this host runs more compute threads than it has cores, or ''."""
    if device.kind != "cpu":
        return ""
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if procs * threads <= cores:
        return ""
    return (f"warning: {procs} process(es) x {threads} thread(s) share {cores} CPU core(s): the measured "
            f"timeline mostly shows processes waiting for a core, not the schedule")


def gather_records(runner, mesh) -> tuple[list, list[float], list[float]]:
    """Every stage's op records, step time and busy fraction (collective over the pp group)."""
    n_ops = 2 * runner.m
    clock = runner.clock
    rec = torch.zeros(n_ops, 4, dtype=torch.float64)
    for j, (kind, i, b, e) in enumerate(clock.records):
        rec[j] = torch.tensor([1.0 if kind == "F" else 2.0, i, b, e], dtype=torch.float64)
    span = torch.tensor([[clock.t1 - clock.t0, clock.busy_fraction()]], dtype=torch.float64)
    dev = runner.device.torch_device
    recs = comm.all_gather(rec.to(dev), mesh.pp_group).cpu().view(mesh.pp, n_ops, 4)
    spans = comm.all_gather(span.to(dev), mesh.pp_group).cpu()
    rows = [[("F" if k == 1 else "B", int(i), b, e) for k, i, b, e in recs[s].tolist() if k]
            for s in range(mesh.pp)]
    return rows, [float(x) for x in spans[:, 0]], [float(x) for x in spans[:, 1]]


def timeline_report(runner, mesh, tcfg, png_path: str = "") -> str:
    """The last step's schedule as text: the tick timetable every rank follows,
    the ideal timeline and the measured one drawn to scale, and the bubble
    three ways. Collective over the pp group (every stage calls it); the text
    is for rank 0, which also draws `png_path` when matplotlib is installed."""
    rows, spans, busy = gather_records(runner, mesh)
    pp, m = mesh.pp, runner.m
    ideal, ideal_span = ideal_timeline(tcfg.schedule, pp, m)
    total = max(spans)
    measured = 1.0 - sum(busy) / len(busy)
    lines = [f"pipeline schedule {tcfg.schedule}: pp={pp} stages, m={m} micro-batches",
             "timetable (ticks; Fi/Bi = forward/backward of micro-batch i, .. = idle):",
             render_ticks(runner.ticks, pp), "",
             f"ideal, F = {F_UNITS:g} unit, B = {B_UNITS:g} units, no communication ({ideal_span:g} units):"]
    lines += _draw(ideal, ideal_span)
    lines += ["", f"measured, last step drawn to scale ({total * 1e3:.1f} ms; F forward, B backward, . idle):"]
    lines += _draw(rows, total)
    lines += [f"bubble: ideal {ideal_bubble(tcfg.schedule, pp, m):.2f} "
              f"= formula (p-1)/(m+p-1) = {formula_bubble(pp, m):.2f}; "
              f"in this runner's lock-step ticks {lockstep_bubble(runner.ticks, m):.2f}; "
              f"measured {measured:.2f} (idle + communication)",
              f"peak micro-batches in flight on this stage: {runner.peak_in_flight}"]
    warning = oversubscription(runner.device)
    if warning:
        lines.append(warning)
    if runner.device.kind == "xla":
        lines.append("note: on XLA the measured times are the host tracing the graph, not device work")
    if png_path and mesh.rank == 0:
        draw_png(ideal, ideal_span, rows, total, png_path,
                 f"{tcfg.schedule}: pp={pp}, m={m}; bubble ideal {ideal_bubble(tcfg.schedule, pp, m):.2f}, "
                 f"measured {measured:.2f}")
    return "\n".join(lines)


def draw_png(ideal, ideal_span: float, rows, total: float, path: str, title: str) -> None:
    """The ideal timeline (units) above the measured one (ms): one row per
    stage, forward boxes light, backward boxes dark, labelled by micro-batch."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pp = len(rows)
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.2 * pp + 2.2))
    for ax, data, span, scale, label in ((axes[0], ideal, ideal_span, 1.0, "ideal: F = 1, B = 2 units"),
                                         (axes[1], rows, total, 1e3, "measured (ms)")):
        for s, ops in enumerate(data):
            for kind, i, b, e in ops:
                ax.barh(s, (e - b) * scale, left=b * scale, color="#9ecae1" if kind == "F" else "#3182bd",
                        edgecolor="black", linewidth=0.5)
                ax.text((b + e) / 2 * scale, s, f"{kind}{i}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
        ax.invert_yaxis()
        ax.set_xlim(0, span * scale)
        ax.set_xlabel(label)
    axes[0].set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    files.atomic_write(path, lambda f: f.write(buffer.getvalue()))   # never through a link at `path`
    plt.close(fig)
