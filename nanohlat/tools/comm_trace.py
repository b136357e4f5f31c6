"""The collectives of a step on the clock (`train.py --timeline`, with dp > 1 or --cp > 1).

timeline.py times each forward and backward of the last step on this stage
(`StepClock`); this file times the collectives of that step against them. A
process group handed a `CommTrace` (run/build.py) is told by comm.py when each
of its collectives is issued and when it ends, with what it is; the clock
polls the ones in flight at every op boundary. It reads the clock and changes
no result and no byte of the comm ledger.

With dp > 1 the gradients' group gets one, and the report times every
collective of the step on the dp group against this rank's ops
(`reduction_report`): each gradient bucket's, the loss's all-reduce, and under
ZeRO the grad norm's all-reduce and the parameters' all-gathers, each named by
what it is (buckets by their place in the flat gradient buffers, so a bucket
has the same number with and without overlap): when it was issued (during
which forward or backward, or after the backward: the loss, then the optimizer
step), when it was known to be complete, and how long the host was blocked on
it. Known complete means: a blocking call returned, an async work's wait()
returned, or its is_completed() said so when polled at an op boundary. gloo
tells nothing in between, so "complete by" is an upper bound on when it
finished.

With --cp > 1 the cp group gets one too, and the report lists, for each rank
of rank 0's cp group, that rank's collectives on the cp group in the step
(`cp_report`), named by the step of the algorithm they are (the ring's 'fwd
K/V s/n-1', 'bwd K/V s/n-1' and 'bwd dK/dV s/n' shifts, allgather's 'fwd
[K;V]' gather and 'bwd d[K;V]' reduce-scatter, ulysses' four all-to-alls),
and the wall time that rank spent in context_parallel.attention, forward and
backward apart: how much of it the host was blocked on those collectives, and
the rest, its own work, which is what the zigzag split balances
(`CommTrace.timed`; on CUDA each of its readings waits for the device too).
With dp x cp > 1 the gradients' and the loss's collectives are those of the
dp x cp group.

On CUDA the clock waits for the device around every op, and that wait
includes collectives in flight, so there a bucket started in a backward is
complete by that op's end. These lines follow the pipeline's in timeline.txt
(`trace_report`; run/session.py joins the two).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from nanohlat import comm
from nanohlat.tools.timeline import draw_rows, op_name


# ---------------------------------------------------------------------------
# The trace: each collective of the step, named and timed
# ---------------------------------------------------------------------------

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
                shard = g.dp_state.param_shard                         # ZeRO-3's kept shard, else the master
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


# ---------------------------------------------------------------------------
# A trace read against this rank's ops; the gradients' group's report
# ---------------------------------------------------------------------------

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
    lines += draw_rows([ops], span, width)
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
        t = totals.setdefault(ev.op, [0, 0, 0, 0, 0])
        t[0], t[1] = t[0] + 1, t[1] + ev.nbytes
        t[2 if ev.label.startswith("fwd") else 3 if ev.label.startswith("bwd") else 4] += 1
    # (outside attention: a mixture of experts' "router sums" over the cp ranks, moe.route)
    lines += [f"cp rank {cp_rank}: {op} {c} calls, {b:,} bytes ({f} in attention forwards, {k} in its backwards"
              f"{f', {o} outside attention' if o else ''})" for op, (c, b, f, k, o) in totals.items()]
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
    from nanohlat.beyond import context_parallel   # (only with --cp: a run without it never loads beyond/)
    group = dataclasses.replace(mesh.group("cp"), ledger=None, trace=None)   # the report's gathers: not the step's
    sections = _gather_text("\n".join(cp_rows(trace, ops, group.rank, mesh.rank)), group, dev)
    times = comm.all_gather(torch.tensor([attention_times(trace)], dtype=torch.float64, device=dev), group).cpu()
    if group.rank != 0:
        return []
    lines = []
    for text in sections:
        lines += [""] + text.splitlines()
    lines += ["", f"attention's pairs: {context_parallel.kernel(torch.device(dev).type)}",
              "attention on each cp rank, last step (ms: wall time in context_parallel.attention on that rank, "
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
# The report
# ---------------------------------------------------------------------------

def trace_report(clock, mesh, device) -> list[str]:
    """What the clock's traces saw in the last step, as the text lines that follow the pipeline's
    (timeline.py:timeline_report): the gradients' group's collectives on rank 0, and with --cp each cp
    rank's cp collectives and time in attention. Collective over the cp group with --cp (every rank calls
    it); the lines are for rank 0."""
    lines = []
    if clock.trace is not None and mesh.rank == 0:
        lines += reduction_report(clock.trace, clock.records, mesh.rank,
                                  others=[k for k, n in (("tp", mesh.tp), ("pp", mesh.pp)) if n > 1],
                                  group=mesh.grad_group.name.replace("_", " x "))
    if clock.cp_trace is not None:   # every rank: a gather over its cp group
        cp_lines = cp_report(clock.cp_trace, clock.records, mesh, device.torch_device)
        lines += cp_lines if mesh.rank == 0 else []
    if clock.traces() and mesh.rank == 0:
        if device.kind == "cuda":
            lines.append("note: on CUDA the clock waits for the device at every op boundary, collectives in flight "
                         "included")
    return lines
