"""The pipeline's timeline and its bubble, three ways (`train.py --timeline`).

pipeline.py decides *what* each stage runs in each tick; this file times it
and says how much of the step was idle, the **bubble**:

1. ideal: the stage orders of schedules.stage_ops with a forward of a whole
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

With dp > 1 the report also times every collective of the step on the dp
group against this rank's ops (`CommTrace`): each gradient bucket's, the
loss's all-reduce, and under ZeRO the grad norm's all-reduce and the
parameters' all-gathers, each named by what it is (buckets by their place in
the flat gradient buffers, so a bucket has the same number with and without
overlap): when it was issued (during which forward or backward, or after the
backward: the loss, then the optimizer step), when it was known to be
complete, and how long the host was blocked on it. Known complete means: a
blocking call returned, an async work's wait() returned, or its
is_completed() said so when polled at an op boundary. gloo tells nothing in
between, so "complete by" is an upper bound on when it finished.

With --cp > 1 it also lists, for each rank of rank 0's cp group, that rank's
collectives on the cp group in the step (`cp_report`), named by the step of
the algorithm they are (the ring's 'fwd K/V s/n-1', 'bwd K/V s/n-1' and 'bwd
dK/dV s/n' shifts, allgather's 'fwd [K;V]' gather and 'bwd d[K;V]'
reduce-scatter, ulysses' four all-to-alls), and the wall time that rank spent
in context_parallel.attention, forward and backward apart: how much of it the
host was blocked on those collectives, and the rest, its own work, which is
what the zigzag split balances (`CommTrace.timed`; on CUDA each of its
readings waits for the device too). With dp x cp > 1 the gradients' and the
loss's collectives are those of the dp x cp group.

On CUDA the clock synchronises the device around every op (with --timeline
only): kernels are launched asynchronously, and without the wait the
timeline would show launches, not work. That wait includes collectives in
flight, so there a bucket started in a backward is complete by that op's end.
On XLA the host only records the graph, so the measured timeline shows
tracing, not device time.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import time

import torch

from nanohlat import comm, schedules
from nanohlat.system import files

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
    (CommTrace: the gradients' group's) or a `cp_trace` (the cp group's), every reading also polls
    their collectives in flight; they record from start() to end_step() (run/session.py, after the
    optimizer step).
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


class Reduction:
    """One dp collective of the step, in seconds since the step's start: `issued`, `done` (known
    complete by then, and `how`: 'returned' from a blocking call, 'polled' is_completed() at an op
    boundary, 'wait' returned) and `blocked`, the (start, end) spans the host spent in the blocking
    call or in wait(). `label` says what it is (CommTrace.name). For an async one it stands in for
    the work: the caller's wait() and is_completed() go through it (a ring shift's: its list of works)."""

    def __init__(self, trace, op: str, nbytes: int, label: str, work=None):
        self.trace, self.op, self.nbytes, self.label, self.work = trace, op, nbytes, label, work
        # read without waiting for the device: on CUDA that wait would stall the backward
        self.issued, self.done, self.how, self.blocked = trace.now(synchronize=False), None, "", []

    def ended(self) -> None:                    # a blocking collective returned
        self.done, self.how = self.trace.now(), "returned"
        self.blocked.append((self.issued, self.done))

    def works(self) -> list:
        return self.work if isinstance(self.work, list) else [self.work]

    def poll(self, t: float) -> None:
        if self.done is None and self.work is not None and self.is_completed():
            self.done, self.how = t, "polled"

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works())

    def wait(self, *args, **kwargs):
        begin = self.trace.now(synchronize=False)
        self.poll(begin)
        out = [w.wait(*args, **kwargs) for w in self.works()][-1]
        end = self.trace.now()
        if self.done is None:
            self.done, self.how = end, "wait"
        self.blocked.append((begin, end))
        return out


class _Note(torch.autograd.Function):
    """Identity on its tensors whose backward first calls `note` (CommTrace.timed: it reads the clock)."""

    @staticmethod
    def forward(ctx, note, *xs):
        ctx.note = note
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.note()
        return (None, *grads)


def _same_storage(x: torch.Tensor, buffer: torch.Tensor) -> bool:
    """x is a view of buffer's storage (never asked on XLA, whose tensors have no storage to compare)."""
    return (x.device.type != "xla" and buffer is not None and buffer.numel() > 0
            and x.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())


class CommTrace:
    """--timeline, dp > 1: the dp group's `trace` (comm.py; run/build.py sets it on the mesh's
    group, which the optimizer's DP strategy and the loss's all-reduce both use; dp x cp with --cp;
    with --cp another one, without `opt`, on the cp group: its collectives, named by their `what`,
    and the attention they serve, `timed`). From the step's
    start (StepClock.start) to its end (StepClock.end_step) it records every collective on that
    group: each gradient bucket's, the loss's all-reduce, ZeRO's all-gathers of the parameters
    and its grad-norm all-reduce; outside (evaluation, --check-replicas, checkpoints) nothing.
    It changes no result and no byte of the comm ledger: it reads the clock.

    Buckets are numbered by what they are, not by when they go: the flat gradient buffers of the
    strategy in the optimizer's order, each one's buckets in buffer order (the strategy's
    `buckets`), so a bucket has one number with and without overlap. A collective says which it
    is by its `what` (comm.py), or by where its tensor lies: a view of a flat gradient buffer
    (plain dp's buckets), of a kept parameter shard (ZeRO's all-gathers)."""

    def __init__(self, clock, opt=None):
        self.clock, self.events, self.spans, self.open = clock, [], [], False
        self.buffers = []                        # (flat group, number of its first bucket, its buckets)
        for g in opt.groups if opt is not None else []:
            if g.dp is opt.dp:                   # (--ep: the experts' groups reduce over another group)
                first = self.buffers[-1][1] + len(self.buffers[-1][2]) if self.buffers else 0
                self.buffers.append((g, first, g.dp.buckets(g.padded)))

    def now(self, synchronize: bool = True) -> float:
        """Seconds since the step's start (on CUDA after waiting for the device, unless told not to)."""
        t = self.clock._now() if synchronize else time.perf_counter()
        return t - self.clock.t0

    def issued(self, op: str, x: torch.Tensor, payload: int, what=None, work=None):
        """`op` ('dp.all_reduce', ...) of x, `payload` bytes in the comm ledger, is being issued (blocking:
        work None) or was (async): its Reduction (a list of works: [its Reduction]), or outside the step `work`."""
        if not self.open:
            return work
        event = Reduction(self, op, payload, self.name(op, x, what), work)
        self.events.append(event)
        return [event] if isinstance(work, list) else event

    def timed(self, fn, *args):
        """--cp: fn(q, k, v, ...) (context_parallel.attention) with its forward and its backward timed on this
        rank, in a step: (kind 'F' or 'B', start, end) in `spans`, seconds since the step began. The backward
        begins when the output's gradient reaches an identity on it, and ends when q's, k's and v's have all
        reached one on them (_Note): after the cp collectives of the backward. Recomputed forwards count as
        forwards (activation checkpointing). It changes no value: identities, and the clock."""
        if not self.open:
            return fn(*args)
        began = []                                    # the backward's start, once the output's gradient arrives

        def ended():
            self.spans.append(("B", began[0], self.now()))
        q, k, v = _Note.apply(ended, *args[:3])
        start = self.now()
        out = fn(q, k, v, *args[3:])
        self.spans.append(("F", start, self.now()))
        return _Note.apply(lambda: began.append(self.now()), out)[0]

    def name(self, op: str, x: torch.Tensor, what) -> str:
        """'loss', 'grad norm' (as the caller says), 'bucket k' (a gradient bucket), 'params k' (ZeRO:
        the all-gather of the new weights in bucket k's columns); '?' for a number that is not known."""
        if isinstance(what, str):
            return what
        if not self.buffers:                     # the cp group's trace: named only by what its caller says
            return "?"
        kind = "params" if op.endswith("all_gather") else "bucket"
        for g, first, buckets in self.buffers:
            if isinstance(what, tuple) and what[0] is g.grad:          # (flat gradient buffer, k)
                return f"bucket {first + what[1]}"
            if what is None and kind == "bucket" and _same_storage(x, g.grad):
                at = x.storage_offset() - g.grad.storage_offset()     # plain dp: a view of the buffer
            elif what is None and kind == "params":
                shard = getattr(g.dp_state, "param_shard", None)       # ZeRO-3's kept shard, else the master
                shard = shard if shard is not None else g.master
                if not _same_storage(x, shard):
                    continue
                at = x.storage_offset() - shard.storage_offset()       # its columns [at, ...) of every row
            else:
                continue
            for k, bucket in enumerate(buckets):
                if bucket[0][0] == at:
                    return f"{kind} {first + k}"
        return f"{kind} ?"

    def buckets_shown(self, labels) -> list[str]:
        """What each bucket among `labels` ('bucket k', 'params k') holds, one line each."""
        lines = []
        for g, first, buckets in self.buffers:
            for k, ranges in enumerate(buckets):
                if f"bucket {first + k}" not in labels and f"params {first + k}" not in labels:
                    continue
                names = [n for n, off, p in zip(g.names, g.offsets, g.params)
                         if any(max(lo, off) < min(hi, off + p.numel()) for lo, hi in ranges)]
                where = (f"[{ranges[0][0]:,}, {ranges[0][1]:,})" if len(ranges) == 1 else
                         f"columns [{ranges[0][0]:,}, {ranges[0][1]:,}) of its {len(ranges)} dp rows")
                held = (names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} parameters)"
                        if names else "padding only")
                lines.append(f"  bucket {first + k}: buffer {self.buffers.index((g, first, buckets))} "
                             f"{where}: {held}")
        return lines


def where(t: float, ops) -> str:
    """The op of `ops` (kind, micro-batch, start, end, chunk) running at time t, or where t falls."""
    for kind, i, b, e, c in ops:
        if b <= t <= e:
            return "in " + op_name((kind, i, c))
    return "after the backward" if not ops or t > ops[-1][3] else "between ops"


def _blocked(events, lo: float, hi: float) -> float:
    """Seconds the host spent blocked on `events` between lo and hi."""
    return sum(max(0.0, min(e, hi) - max(b, lo)) for ev in events for b, e in ev.blocked)


def _kind(label: str) -> str:
    """What the summary calls a row's kind: 'bucket 3' -> 'on gradient buckets', 'loss' -> "in the loss's all-reduce"."""
    return {"bucket": "on gradient buckets", "params": "on parameter all-gathers", "loss": "in the loss's all-reduce",
            "grad": "in the grad norm's all-reduce"}.get(label.split(" ")[0], "in other collectives")


def reduction_report(trace, ops, rank: int, width: int = 72, others=(), group: str = "dp") -> list[str]:
    """The dp collectives of the last step against this rank's ops (`ops`), as text lines. `others`:
    the mesh's other groups with collectives in a step ('tp', 'pp'), which the trace does not see; `group`:
    the gradients' group ('dp', or with --cp 'dp x cp')."""
    groups = "groups'" if len(others) > 1 else "group's"
    not_shown = f", and the {', '.join(others)} {groups} collectives, not shown" if others else ""
    events = trace.events
    if not events:
        return []
    end_b = max((e for kind, _, _, e, _ in ops if kind in "BW"), default=0.0)   # the backward's end
    buckets = [ev for ev in events if ev.label.startswith("bucket")]
    during = [ev for ev in buckets if ev.issued <= end_b]
    done_by_end = [ev for ev in during if ev.done is not None and ev.done <= end_b]
    lines = ["", f"collectives on rank {rank}'s {group} group, last step, in the order issued (ms since the step "
                 f"began; its backward ended at {end_b * 1e3:.1f} ms):",
             "  what        collective           bytes   issued                        known complete   "
             "host blocked on it"]
    for ev in events:
        done = f"{ev.done * 1e3:7.1f} {ev.how:8s}" if ev.done is not None else "     never seen"
        blocked = ", ".join(f"{b * 1e3:.1f}-{e * 1e3:.1f}" for b, e in ev.blocked) or "-"
        lines.append(f"  {ev.label:10s}  {ev.op:17s} {ev.nbytes:>9,}  {ev.issued * 1e3:7.1f}  "
                     f"{where(ev.issued, ops):20s}  {done}  {blocked}")
    shown = {ev.label for ev in events}
    if any(label.split(" ")[0] in ("bucket", "params") for label in shown):
        lines += ["buckets, numbered in the order of the flat gradient buffers, the same with and without overlap"
                  + ("; params k: the new weights of bucket k's elements, all-gathered" if
                     any(label.startswith("params") for label in shown) else "") + ":"]
        lines += trace.buckets_shown(shown)
    span = max([end_b] + [ev.done or 0.0 for ev in events] + [e for ev in events for _, e in ev.blocked])
    lines += ["", f"drawn to scale ({span * 1e3:.1f} ms; ~ issued, not known complete; w host blocked on it; "
                  f"^ the backward ends; bN bucket N, pN params N):"]
    lines += _draw([ops], span, width)
    for ev in events:
        row = [" "] * width
        lo, hi = int(ev.issued / span * width), int((ev.done if ev.done is not None else span) / span * width)
        for x in range(lo, min(max(hi, lo + 1), width)):
            row[x] = "~"
        for b, e in ev.blocked:
            for x in range(int(b / span * width), min(max(int(e / span * width), int(b / span * width) + 1), width)):
                row[x] = "w"
        short = ev.label.replace("bucket ", "b").replace("params ", "p").replace("grad norm", "norm")
        lines.append(f"{short:>7s} |" + "".join(row) + "|")
    lines.append(" " * (len("stage 0 |") + min(int(end_b / span * width), width - 1)) + "^")
    if buckets:
        last = max(ev.done if ev.done is not None else math.inf for ev in buckets)
        after = max(0.0, last - end_b)
        # what the host did from the backward's end to the last bucket seen complete, kind by kind
        parts = {}
        for ev in events:
            parts[_kind(ev.label)] = parts.get(_kind(ev.label), 0.0) + _blocked([ev], end_b, last)
        split = "".join(f"{t * 1e3:.1f} ms blocked {k}, " for k, t in parts.items())
        lines.append(f"gradient buckets: {len(buckets)}, {sum(ev.nbytes for ev in buckets):,} bytes; "
                     f"{len(during)} issued during the backward, {len(buckets) - len(during)} after it; "
                     f"{len(done_by_end)} known complete when it ended; " + (
                         f"the last seen complete {after * 1e3:.1f} ms after it ended (or sooner: seen when "
                         f"polled or waited for): {split}{max(0.0, after - sum(parts.values())) * 1e3:.1f} ms outside "
                         f"them (the host's own work{not_shown})" if math.isfinite(after) else "not all seen complete"))
    by_kind = {}
    for ev in events:
        by_kind.setdefault(_kind(ev.label), []).append(ev)
    lines.append(f"host blocked on the {group} group's collectives, by the backward's end / after it: " + "; ".join(
        f"{k[3:]} {_blocked(evs, 0.0, end_b) * 1e3:.1f} / "
        f"{_blocked(evs, end_b, math.inf) * 1e3:.1f} ms" for k, evs in by_kind.items()))
    return lines


# ---------------------------------------------------------------------------
# Context parallelism: the cp group's collectives and the time in attention, on each cp rank
# ---------------------------------------------------------------------------

def attention_times(trace) -> list[float]:
    """[calls, wall, blocked] of this rank's attention forwards, then the same of its backwards (seconds):
    wall time in context_parallel.attention, and of it the host blocked on the cp collectives."""
    out = []
    for kind in "FB":
        spans = [(b, e) for k, b, e in trace.spans if k == kind]
        out += [len(spans), sum(e - b for b, e in spans), sum(_blocked(trace.events, b, e) for b, e in spans)]
    return out


def cp_rows(trace, ops, cp_rank: int, rank: int) -> list[str]:
    """This rank's collectives on its cp group in the last step, one row each in the order issued, and
    per collective its calls and bytes, forward and backward (what the rows' names say)."""
    lines = [f"cp rank {cp_rank} (rank {rank}): its collectives on the cp group, last step, in the order issued "
             f"(ms since its step began):",
             "  what             collective         bytes   issued                        known complete   "
             "host blocked on it"]
    totals = {}
    for ev in trace.events:
        done = f"{ev.done * 1e3:7.1f} {ev.how:8s}" if ev.done is not None else "     never seen"
        blocked = ", ".join(f"{b * 1e3:.1f}-{e * 1e3:.1f}" for b, e in ev.blocked) or "-"
        lines.append(f"  {ev.label:15s}  {ev.op:16s} {ev.nbytes:>9,}  {ev.issued * 1e3:7.1f}  "
                     f"{where(ev.issued, ops):20s}  {done}  {blocked}")
        t = totals.setdefault(ev.op, [0, 0, 0, 0])
        t[0], t[1] = t[0] + 1, t[1] + ev.nbytes
        t[2 if ev.label.startswith("fwd") else 3] += 1
    lines += [f"cp rank {cp_rank}: {op} {c} calls, {b:,} bytes ({f} in attention forwards, {k} in its backwards)"
              for op, (c, b, f, k) in totals.items()]
    return lines


def _gather_text(text: str, group, dev) -> list[str]:
    """Every rank's `text`, in group order (collective over `group`)."""
    mine = torch.tensor(list(text.encode()), dtype=torch.uint8)
    sizes = comm.all_gather(torch.tensor([mine.numel()], device=dev), group).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:mine.numel()] = mine
    every = comm.all_gather(padded.to(dev), group).cpu().view(group.size, -1)
    return [bytes(row[:n].tolist()).decode() for row, n in zip(every, sizes)]


def cp_report(trace, ops, mesh, dev) -> list[str]:
    """--cp: each cp rank's collectives on the cp group in the last step and its time in attention, as text
    lines for rank 0 of the cp group (collective over the cp group: each rank writes its own rows)."""
    group = dataclasses.replace(mesh.group("cp"), ledger=None, trace=None)   # the report's gathers: not the step's
    sections = _gather_text("\n".join(cp_rows(trace, ops, group.rank, mesh.rank)), group, dev)
    times = comm.all_gather(torch.tensor([attention_times(trace)], dtype=torch.float64, device=dev), group).cpu()
    if group.rank != 0:
        return []
    lines = []
    for text in sections:
        lines += [""] + text.splitlines()
    lines += ["", "attention on each cp rank, last step (ms: wall time in context_parallel.attention on that rank, "
                  "recomputed forwards included; of it, the host blocked on the cp collectives; the rest, its own work):",
              "  cp rank   forward: calls     wall  blocked      own   backward: calls     wall  blocked      own"]
    own = {"forward": [], "backward": []}
    for r, (fc, fw, fb, bc, bw, bb) in enumerate(times.tolist()):
        lines.append(f"  {r:7d}   {int(fc):14d} {fw * 1e3:8.1f} {fb * 1e3:8.1f} {(fw - fb) * 1e3:8.1f}   "
                     f"{int(bc):15d} {bw * 1e3:8.1f} {bb * 1e3:8.1f} {(bw - bb) * 1e3:8.1f}")
        own["forward"].append(fw - fb)
        own["backward"].append(bw - bb)
    lines.append("own work in attention, max/min - 1 across the cp ranks: " + ", ".join(
        f"{k} {(max(v) / min(v) - 1) * 100:.0f}%" if min(v) > 0 else f"{k} -" for k, v in own.items())
        + " (the zigzag split gives every rank the same causal work; a measured spread is this machine's)")
    return lines


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
    stage is free and its input exists (schedules.depends_on). Returns (rows, makespan)."""
    orders = [schedules.stage_ops(schedule, pp, m, s, v) for s in range(pp)]
    rows: list[list[tuple[str, int, float, float, int]]] = [[] for _ in range(pp)]
    done: dict = {}                          # (kind, stage, mb, chunk) -> end time
    while any(len(rows[s]) < len(orders[s]) for s in range(pp)):
        for s in range(pp):
            if len(rows[s]) == len(orders[s]):
                continue
            kind, i, c = op = orders[s][len(rows[s])]
            dep = schedules.depends_on(op, s, pp, v)
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


def _draw(rows, total: float, width: int = 72) -> list[str]:
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


def timeline_report(runner, mesh, tcfg, png_path: str = "") -> str:
    """The last step's schedule as text: the tick timetable every rank follows,
    the ideal timeline and the measured one drawn to scale, the bubble three
    ways and the activations in flight on each stage. Collective over the pp
    group (every stage calls it); the text is for rank 0, which also draws
    `png_path` when matplotlib is installed."""
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
    lines += _draw(ideal, ideal_span)
    lines += ["", f"measured, last step drawn to scale ({total * 1e3:.1f} ms; F forward, B backward, "
              + ("W weight gradients, " if split else "") + ". idle"
              + ("; f, b on odd chunks" if v > 1 else "") + "):"]
    lines += _draw(rows, total)
    want = [in_flight_formula(schedule, pp, m, s, v)[0] for s in range(pp)]
    ideal_held = [in_flight(schedules.stage_ops(schedule, pp, m, s, v)) for s in range(pp)]
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
    if runner.clock.trace is not None and mesh.rank == 0:
        lines += reduction_report(runner.clock.trace, runner.clock.records, mesh.rank,
                                  others=[k for k, n in (("tp", mesh.tp), ("pp", pp)) if n > 1],
                                  group="dp" if tcfg.cp == 1 else "dp x cp")
    if runner.clock.cp_trace is not None:   # every rank: a gather over its cp group
        cp_lines = cp_report(runner.clock.cp_trace, runner.clock.records, mesh, runner.device.torch_device)
        lines += cp_lines if mesh.rank == 0 else []
    if runner.clock.traces() and mesh.rank == 0:
        if runner.device.kind == "cuda":
            lines.append("note: on CUDA the clock waits for the device at every op boundary, collectives in flight "
                         "included")
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
