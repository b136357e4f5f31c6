"""The pipeline's timeline and its bubble, three ways (`train.py --timeline`).

pipeline.py decides *what* each stage runs in each tick; this file times it
and says how much of the step was idle, the **bubble**:

1. ideal: the stage orders of orders.stage_ops with a forward of a whole
   stage taking 1 unit and a backward 2 (it computes two gradients, for the
   input and for the weights; zb-h1 splits it into B and W, 1 unit each), no
   communication, each op starting as soon as its input exists; an
   interleaved stage's v chunks take 1/v of that each.
   This is the figure to reason with; it equals
2. each schedule's formula: (p-1)/(m+p-1) for AFAB and 1F1B (the GPipe and
   Megatron papers), (p-1)/(v*m+p-1) for interleaved (Megatron-LM 2021:
   the bubble shrinks v times, the exchanges grow v times), (p-1)/(3m+p-1)
   for zb-h1 (Qi et al. 2024: the p-1 idle units of filling and draining
   are single 1-unit ops, where 1F1B's are 3-unit F + B pairs), and
3. measured: the wall time of each forward and backward on each stage in the
   last step. It includes everything the ideal leaves out: communication,
   the lock-step ticks of the runner, a slow last stage (the loss), and, on a
   laptop, processes waiting for a CPU core. So it is a property of this run
   on this machine, not of the schedule; the report says when ranks
   outnumber cores.

With dp > 1 or --cp > 1 the collectives of the step are timed against
these ops too, by the process groups' traces that the clock polls: that is
comm_trace.py, whose lines follow this report's in timeline.txt.

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

from nanohlat import comm
from nanohlat.system import files
from nanohlat.tools import orders

F_UNITS, B_UNITS = 1.0, 2.0     # the ideal timeline's forward and backward
W_UNITS = 1.0                   # zb-h1: the backward's weight-gradient part W; its B takes B_UNITS - W_UNITS


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
    micro-batch, started, chunk) after it and stop() after the last tick; `records`
    then holds (kind, micro-batch, start, end, chunk), times in seconds since start().
    With `synchronize` each reading first waits for the device. With a `trace`
    (comm_trace.py:CommTrace: the gradients' group's) or a `cp_trace` (the cp group's), every
    reading also polls their collectives in flight; they record from start() to end_step()
    (run/session.py, after the optimizer step).
    """

    def __init__(self, device, synchronize: bool = False):
        self.device, self.synchronize = device, synchronize
        self.records: list[tuple[str, int, float, float]] = []
        self.t0 = self.t1 = 0.0
        self.trace = self.cp_trace = None

    def traces(self) -> list:
        return [t for t in (self.trace, self.cp_trace) if t is not None]

    def _now(self) -> float:
        if self.synchronize:
            wait_for_device(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.records = []
        self.t0 = self._now()
        for trace in self.traces():
            trace.events, trace.spans, trace.open = [], [], True

    def end_step(self) -> None:
        """The optimizer step is over (run/session.py): the traces record nothing more until the next start."""
        for trace in self.traces():
            trace.open = False

    def op_start(self) -> float:
        return self._poll(self._now())

    def op_end(self, kind: str, i: int, started: float, chunk: int = 0) -> None:
        self.records.append((kind, i, started - self.t0, self._poll(self._now()) - self.t0, chunk))

    def stop(self) -> None:
        self.t1 = self._poll(self._now())

    def _poll(self, now: float) -> float:
        for trace in self.traces():
            for event in trace.events:
                event.poll(now - self.t0)
        return now

    def busy_fraction(self) -> float:
        """Share of the last step this stage spent inside its forwards and backwards."""
        busy = sum(e - b for _, _, b, e, _ in self.records)
        return busy / max(self.t1 - self.t0, 1e-9)


# ---------------------------------------------------------------------------
# The bubble without measuring
# ---------------------------------------------------------------------------

FORMULAS = {"afab": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(v*m+p-1)",
            "zb-h1": "(p-1)/(3m+p-1)"}


def formula_bubble(pp: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """The idle share of a step for p stages and m micro-batches, by the
    schedule's formula (FORMULAS): the p-1 ops of filling and draining the
    pipeline, each 1/v of a stage's work when stages hold v chunks, 1/3 of
    it (one of F, B, W) for zb-h1."""
    if schedule == "zb-h1":
        return (pp - 1) / (3 * m + pp - 1)
    return (pp - 1) / (v * m + pp - 1) if schedule == "interleaved" else (pp - 1) / (m + pp - 1)


def op_units(kind: str, v: int = 1, f: float = F_UNITS, b: float = B_UNITS, split: bool = False) -> float:
    """How long one op takes in the ideal timeline: a chunk holds 1/v of the
    stage; with the backward split (zb-h1), B takes b - W_UNITS and W W_UNITS."""
    if kind == "W" or split and kind == "B":
        return (W_UNITS if kind == "W" else b - W_UNITS) / v
    return (f if kind == "F" else b) / v


def ideal_timeline(schedule: str, pp: int, m: int, v: int = 1, f: float = F_UNITS, b: float = B_UNITS):
    """Each stage's ops as (kind, micro-batch, start, end, chunk) when a forward
    takes f/v and a backward b/v, with no communication: an op starts when the
    stage is free and its input exists (orders.depends_on). Returns (rows, makespan)."""
    ops = [orders.stage_ops(schedule, pp, m, s, v) for s in range(pp)]
    rows: list[list[tuple[str, int, float, float, int]]] = [[] for _ in range(pp)]
    done: dict = {}                          # (kind, stage, mb, chunk) -> end time
    while any(len(rows[s]) < len(ops[s]) for s in range(pp)):
        for s in range(pp):
            if len(rows[s]) == len(ops[s]):
                continue
            kind, i, c = op = ops[s][len(rows[s])]
            dep = orders.depends_on(schedule, op, s, pp, v)
            if dep is not None and dep not in done:
                continue                     # its input is not computed yet: try the next stage
            free = rows[s][-1][3] if rows[s] else 0.0
            start = max(free, done[dep] if dep else 0.0)
            end = start + op_units(kind, v, f, b, schedule == "zb-h1")
            rows[s].append((kind, i, start, end, c))
            done[(kind, s, i, c)] = end
    return rows, max(r[-1][3] for r in rows)


def ideal_bubble(schedule: str, pp: int, m: int, v: int = 1, f: float = F_UNITS, b: float = B_UNITS) -> float:
    """Idle share of the ideal timeline, averaged over stages."""
    _, span = ideal_timeline(schedule, pp, m, v, f, b)
    return 1.0 - m * (f + b) / span


def lockstep_bubble(ticks, m: int, v: int = 1, f: float = F_UNITS, b: float = B_UNITS) -> float:
    """Idle share when every tick of the timetable lasts as long as its slowest
    op, as PipelineRunner's exchanges after each tick come close to."""
    split = any(op and op[0] == "W" for row in ticks for op in row)
    span = sum(max(op_units(op[0], v, f, b, split) for op in row if op) for row in ticks)
    return 1.0 - m * (f + b) / span


def in_flight(order) -> int:
    """Most activations a stage holds at once in `order` (ops (kind, micro-batch,
    chunk)): a forward keeps its chunk's activations until its backward (zb-h1:
    until its W, which needs the linears' inputs)."""
    frees = "W" if any(op[0] == "W" for op in order) else "B"
    held = peak = 0
    for op in order:
        held += 1 if op[0] == "F" else -1 if op[0] == frees else 0
        peak = max(peak, held)
    return peak


def in_flight_formula(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> tuple[int, str]:
    """(the number, the formula) of activations held at once on `stage`: AFAB
    all m; 1F1B its warm-up and one, min(p - s, m); interleaved its warm-up
    and one, min(2(p-1-s) + (v-1)p + 1, v*m) chunks of 1/v of the stage each;
    zb-h1 1F1B's p - s and the s W's it puts off: p on every stage (m >= p)."""
    if schedule == "afab":
        return m, "m"
    if schedule == "zb-h1":
        return min(pp, m), "min(p, m)"
    if schedule == "interleaved":
        return min(2 * (pp - 1 - stage) + (v - 1) * pp + 1, v * m), "min(2(p-1-s)+(v-1)p+1, v*m)"
    return min(pp - stage, m), "min(p-s, m)"


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------

def op_name(op) -> str:
    """'F3': forward of micro-batch 3 ('B3', 'W3': its backward, or zb-h1's
    input- and weight-gradient parts); with chunks, 'F3.1': ... of chunk 1."""
    kind, i, c = op
    return f"{kind}{i}" + (f".{c}" if c else "")


def render_ticks(ticks, pp: int) -> str:
    """The timetable as text, one row per stage: 'F3' forward of micro-batch 3
    (F3.1 on chunk 1 when stages hold several), '..' idle."""
    width = max(len(op_name(op)) for row in ticks for op in row if op) + 1
    rows = []
    for s in range(pp):
        cells = [(op_name(row[s]) if row[s] else "..").rjust(width) for row in ticks]
        rows.append(f"stage {s} |" + "".join(cells))
    return "\n".join(rows)


def draw_rows(rows, total: float, width: int = 72) -> list[str]:
    """Each stage's ops drawn to scale in `width` characters: F, B (zb-h1: W),
    or . for idle; an interleaved stage's odd chunks in lower case (f, b)."""
    lines = []
    for s, ops in enumerate(rows):
        row = ["."] * width
        for kind, i, b, e, c in ops:
            lo = int(b / total * width)
            hi = max(lo + 1, int(e / total * width))
            for x in range(lo, min(hi, width)):
                row[x] = kind.lower() if c % 2 else kind
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


def gather_records(runner, mesh) -> tuple[list, list[float], list[float], list[int]]:
    """Every stage's op records, step time, busy fraction and peak activations
    in flight (collective over the pp group)."""
    n_ops = sum(row[runner.stage] is not None for row in runner.ticks)   # F, B (zb-h1: W) of each micro-batch, chunk
    clock = runner.clock
    rec = torch.zeros(n_ops, 5, dtype=torch.float64)
    for j, (kind, i, b, e, c) in enumerate(clock.records):
        rec[j] = torch.tensor(["_FBW".index(kind), i, b, e, c], dtype=torch.float64)
    span = torch.tensor([[clock.t1 - clock.t0, clock.busy_fraction(), runner.peak_in_flight]], dtype=torch.float64)
    dev = runner.device.torch_device
    recs = comm.all_gather(rec.to(dev), mesh.pp_group).cpu().view(mesh.pp, n_ops, 5)
    spans = comm.all_gather(span.to(dev), mesh.pp_group).cpu()
    rows = [[("_FBW"[int(k)], int(i), b, e, int(c)) for k, i, b, e, c in recs[s].tolist() if k]
            for s in range(mesh.pp)]
    return rows, [float(x) for x in spans[:, 0]], [float(x) for x in spans[:, 1]], [int(x) for x in spans[:, 2]]


def timeline_report(runner, mesh, tcfg, png_path: str = "", json_path: str = "") -> str:
    """The last step's schedule as text: the tick timetable every rank follows,
    the ideal timeline and the measured one drawn to scale, the bubble three
    ways and the activations in flight on each stage (the step's collectives
    follow it in timeline.txt: comm_trace.py:trace_report). Collective over
    the pp group (every stage calls it); the text is for rank 0, which also
    draws `png_path` when matplotlib is installed and writes the same rows
    as numbers to `json_path` (timeline.json, which the run's report.html draws:
    run/report.py)."""
    rows, spans, busy, held = gather_records(runner, mesh)
    pp, m, v, schedule = mesh.pp, runner.m, len(runner.chunks), tcfg.schedule
    ideal, ideal_span = ideal_timeline(schedule, pp, m, v)
    ideal_b = ideal_bubble(schedule, pp, m, v)
    total = max(spans)
    measured = 1.0 - sum(busy) / len(busy)
    chunks = f", v={v} chunks per stage" if v > 1 else ""
    split = schedule == "zb-h1"
    units = (f"F = {F_UNITS:g} unit, B = {B_UNITS - W_UNITS:g} unit, W = {W_UNITS:g} unit" if split
             else f"F = {F_UNITS:g} unit, B = {B_UNITS:g} units")
    lines = [f"pipeline schedule {schedule}: pp={pp} stages, m={m} micro-batches{chunks}",
             "timetable (ticks; Fi/Bi = forward/backward of micro-batch i"
             + (", Wi its weight gradients" if split else "")
             + (", Fi.c on chunk c > 0" if v > 1 else "") + ", .. = idle):",
             render_ticks(runner.ticks, pp), "",
             f"ideal, {units}"
             + (f" per stage (1/{v} of that per chunk)" if v > 1 else "")
             + f", no communication ({ideal_span:g} units):"]
    lines += draw_rows(ideal, ideal_span)
    lines += ["", f"measured, last step drawn to scale ({total * 1e3:.1f} ms; F forward, B backward, "
              + ("W weight gradients, " if split else "") + ". idle"
              + ("; f, b on odd chunks" if v > 1 else "") + "):"]
    lines += draw_rows(rows, total)
    want = [in_flight_formula(schedule, pp, m, s, v)[0] for s in range(pp)]
    ideal_held = [in_flight(orders.stage_ops(schedule, pp, m, s, v)) for s in range(pp)]
    what = "chunk activations" if v > 1 else "micro-batches"
    lines += [f"bubble: ideal {ideal_b:.2f} "
              f"= formula {FORMULAS[schedule]} = {formula_bubble(pp, m, schedule, v):.2f}; "
              f"in this runner's lock-step ticks {lockstep_bubble(runner.ticks, m, v):.2f}; "
              f"measured {measured:.2f} (idle + communication)",
              f"peak {what} in flight per stage: formula {in_flight_formula(schedule, pp, m, 0, v)[1]} = "
              f"{' '.join(map(str, want))}; ideal {' '.join(map(str, ideal_held))}; "
              f"measured {' '.join(map(str, held))}"]
    warning = oversubscription(runner.device)
    if warning:
        lines.append(warning)
    if runner.device.kind == "xla":
        lines.append("note: on XLA the measured times are the host tracing the graph, not device work")
    if json_path and mesh.rank == 0:
        record = {"schedule": schedule, "pp": pp, "m": m, "v": v, "units": units, "ideal": ideal,
                  "ideal_span": ideal_span, "measured": rows, "measured_span_s": total,
                  "bubble": {"ideal": ideal_b, "formula": FORMULAS[schedule],
                             "formula_value": formula_bubble(pp, m, schedule, v),
                             "lockstep": lockstep_bubble(runner.ticks, m, v), "measured": measured},
                  "in_flight": {"formula": want, "ideal": ideal_held, "measured": held},
                  "warning": warning}
        files.write_text(json_path, files.json_text(record))
    if png_path and mesh.rank == 0:
        draw_png(ideal, ideal_span, rows, total, png_path,
                 f"{schedule}: pp={pp}, m={m}{', v=' + str(v) if v > 1 else ''}; bubble ideal {ideal_b:.2f}, "
                 f"measured {measured:.2f}", v, units)
    return "\n".join(lines)


def draw_png(ideal, ideal_span: float, rows, total: float, path: str, title: str, v: int = 1,
             units: str = "F = 1, B = 2 units") -> None:
    """The ideal timeline (units) above the measured one (ms): one row per
    stage, forward boxes light, backward boxes dark (zb-h1's W boxes grey), labelled by micro-batch
    (and chunk: 3.1 is micro-batch 3 on chunk 1; odd chunks hatched)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pp = len(rows)
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.2 * pp + 2.2))
    unit = "" if v == 1 else f" per stage, 1/{v} per chunk"
    for ax, data, span, scale, label in ((axes[0], ideal, ideal_span, 1.0, f"ideal: {units}{unit}"),
                                         (axes[1], rows, total, 1e3, "measured (ms)")):
        for s, ops in enumerate(data):
            for kind, i, b, e, c in ops:
                ax.barh(s, (e - b) * scale, left=b * scale, color={"F": "#9ecae1", "B": "#3182bd", "W": "#bdbdbd"}[kind],
                        edgecolor="black", linewidth=0.5, hatch="//" if c % 2 else None)
                ax.text((b + e) / 2 * scale, s, f"{i}.{c}" if v > 1 else f"{kind}{i}", ha="center",
                        va="center", fontsize=6 if v > 1 else 7)
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
