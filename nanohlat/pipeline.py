"""Pipeline parallelism: stages of layers, micro-batches, the AFAB and 1F1B schedules.

Papers: Huang et al. 2019, "GPipe" (arXiv 1811.06965) for all-forward-all-
backward (AFAB); Narayanan et al. 2019/2021, "PipeDream" / "Efficient
Large-Scale Language Model Training on GPU Clusters" (arXiv 2104.04473) for
one-forward-one-backward (1F1B, "PipeDream-flush").

What is split: the layers. Stage s of pp holds layers [s*L/pp, (s+1)*L/pp);
the first also holds the embedding, the last the final norm, head and loss.
What moves: the residual stream (mb, T, C) forward across each stage boundary
and its gradient, of the same shape, backward: 2 * mb*T*C*s bytes per
micro-batch per boundary (T/tp with sequence parallel).

How it moves. Each stage boundary is a 2-rank group and every transfer is a
comm.exchange: both neighbours contribute one tensor and keep the other's.
The schedule is laid out in *ticks*; in a tick every stage runs at most one
forward (F) or backward (B) of one micro-batch, then the boundaries
exchange what was produced: the left stage's new activation and the right
stage's new gradient travel in the same exchange (zeros stand in for a side
with nothing to send: the comm ledger counts them as padding). Every rank
computes the same timetable, so both sides of a boundary always agree on
which ticks have an exchange.

Why it cannot deadlock: after each tick, stage s exchanges first with stage
s-1 (its left boundary), then with stage s+1 (its right one). Stage 0 has no
left boundary, so it goes straight to boundary 0|1, which is stage 1's
*first* exchange: both arrive, it completes. Stage 1 then moves on to 1|2,
again the first exchange of stage 2, and so on: by induction the exchanges
of a tick complete in the order 0|1, 1|2, ..., (p-2)|(p-1), and no stage
ever waits for a neighbour that is itself waiting on something else.
(Both sides skip a boundary in a tick where the shared timetable says
nothing crosses it.)

Schedules (p stages, m micro-batches; per stage, in order):
  AFAB: F0 F1 ... F(m-1)  B0 B1 ... B(m-1)             holds m activations
  1F1B: warm-up forwards (fewer, the later the stage),   holds <= p activations
        then alternate F and B (steady state), then the remaining Bs (cool-down)
Both have the same bubble, (p-1)/(m+p-1) of the time, if each stage starts an
op as soon as its input exists; 1F1B's gain is memory (tools/timeline.py
times a step through the runner's clock and gives the bubble three ways:
--timeline). With pp=1 the same code is plain gradient accumulation.

An op is (kind, micro-batch, chunk), the chunk of the model it runs on: 0
here, where a stage holds one contiguous run of layers. `timetable` lays out
any orders of such ops, and PipelineRunner's methods are the places a
schedule that cuts a stage into chunks, or adds kinds of op, changes.
"""

from __future__ import annotations

import torch

from . import comm


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The layers stage `stage` holds: one contiguous run, n_layers / pp of them."""
    per = n_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_order(schedule: str, pp: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The ops of one stage, in order: [('F', 0), ('F', 1), ('B', 0), ...]."""
    if schedule == "afab":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # exercise 5a: begin
    warmup = min(pp - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
        b += 1
    return ops
    # exercise 5a: end


def depends_on(op: tuple[str, int, int], stage: int, pp: int, v: int = 1) -> tuple | None:
    """The op (kind, stage, micro-batch, chunk) that must finish before `op` of
    `stage` starts, or None: F(s, i) needs F(s-1, i), B(s, i) needs B(s+1, i),
    and the last stage's B its own F. (With v chunks a stage, the model is in
    p*v pieces, k = chunk*pp + stage, and the same rule holds for k.)"""
    kind, i, c = op
    k = c * pp + stage
    if kind == "F":
        return None if k == 0 else ("F", (k - 1) % pp, i, (k - 1) // pp)
    if k == pp * v - 1:
        return ("F", stage, i, c)
    return ("B", (k + 1) % pp, i, (k + 1) // pp)


def stage_ops(schedule: str, pp: int, m: int, stage: int) -> list[tuple[str, int, int]]:
    """stage_order's ops as (kind, micro-batch, chunk 0)."""
    return [(kind, i, 0) for kind, i in stage_order(schedule, pp, m, stage)]


def timetable(orders: list[list[tuple[str, int, int]]], pp: int, v: int = 1,
              depends=depends_on) -> list[list[tuple[str, int, int] | None]]:
    """ticks[t][s] = the op (kind, micro-batch, chunk) stage s runs in tick t
    (None = idle, the bubble), orders[s] being stage s's ops in order.

    An op runs as soon as its input arrived in an earlier tick (`depends`).
    A tick in which no stage can run has nothing to wait for: the orders
    deadlock, which is a bug in them, and raises."""
    nxt = [0] * pp
    done: dict = {}              # (kind, stage, mb, chunk) -> tick it finished in
    ticks = []
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        t = len(ticks)
        row = []
        for s in range(pp):
            op = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            if op is not None:
                dep = depends(op, s, pp, v)
                if dep is not None and done.get(dep, t) >= t:
                    op = None
            row.append(op)
        if not any(row):
            raise RuntimeError(f"the schedule deadlocks at tick {t} (pp {pp}, v {v}): {orders}")
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], s, op[1], op[2])] = t
                nxt[s] += 1
        ticks.append(row)
    return ticks


class PipelineRunner:
    """Runs one optimizer step's forward/backward over micro-batches on this stage (--schedule afab, 1f1b).
    `timetable`, `_op`, `_exchange`, `_sender`/`_receiver` and `_held` are meant to be overridden by a
    runner of another schedule (a seam: docs/design.md 1)."""

    def __init__(self, model, mesh, tcfg, act_shape, act_dtype, device, clock=None):
        self.model, self.mesh, self.device = model, mesh, device
        self.pp, self.stage = mesh.pp, mesh.pp_rank
        self.m = tcfg.microbatches
        self.chunks = [None]    # the layers of each model chunk this stage holds: one, all of them (None)
        self.ticks = self.timetable(tcfg)
        self.act_shape, self.act_dtype = act_shape, act_dtype   # (mb, T or T/tp, C)
        self.peak_in_flight = 0      # most (micro-batch, chunk) activations held, last step
        self.clock = clock     # None, or told the start and end of each F and B (tools/timeline.py:StepClock)

    def timetable(self, tcfg) -> list:
        """The step's ticks: every stage's order of --schedule, laid out (`timetable`)."""
        return timetable([stage_ops(tcfg.schedule, self.pp, self.m, s) for s in range(self.pp)], self.pp)

    def _exchange_plan(self, t: int, boundary: int) -> tuple[int | None, int | None]:
        """(micro-batch whose activation crosses boundary b->b+1 after tick t,
        micro-batch whose gradient crosses b+1->b), None where nothing moves."""
        # exercise 5b: begin
        left, right = self.ticks[t][boundary], self.ticks[t][boundary + 1]
        act = left[1] if left is not None and left[0] == "F" else None
        grad = right[1] if right is not None and right[0] == "B" else None
        return act, grad
        # exercise 5b: end

    def run(self, tokens: list, targets: list, loss_scale: float) -> torch.Tensor:
        """tokens/targets: this dp rank's m micro-batches, one (mb, T) device
        tensor each (used on the first / last stage). The gradients go into
        FlatAdamW's flat fp32 buffers (its hooks, optim.py); returns the sum of
        this stage's scaled micro-batch losses (off the last stage zero).

        Each tick: this stage's op of the timetable (`_op`: `_forward` or
        `_backward`), then the tick's exchanges (`_exchange`), then, on XLA, a
        graph cut (`_cut_graph`) after every tick (pp > 1) or every backward
        (pp = 1). A graph covers one op of one micro-batch, whose inputs are
        tensors of their own (never `tokens[i]` of one big tensor, which would
        bake i into the graph), so the graphs compiled do not grow in number or
        size with m: a tick's graph is set by its op's kind and by what crosses
        (tests/core/test_pipeline_schedule.py)."""
        self.inputs, self.grads_in = {}, {}   # received activations / gradients, by (micro-batch, chunk)
        self.in_flight = {}                   # (mb, chunk) -> (input, output), for its B
        self.peak_in_flight = 0
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        # before micro-batch 0: what the step queued before (zero_grad's reset) is a graph of its own,
        # and every micro-batch runs the same graph (no gradient exists before one: the hooks free it)
        self._cut_graph()
        if self.clock:
            self.clock.start()
        for t, row in enumerate(self.ticks):
            op = row[self.stage]
            act = grad = None                 # what this stage produced in tick t, for its neighbours
            if op is not None:
                started = self.clock.op_start() if self.clock else 0.0
                act, grad = self._op(*op, tokens, targets, loss_scale)
                if self.clock:
                    self.clock.op_end(op[0], op[1], started, op[2])
            self._exchange(t, act, grad)
            if self.pp > 1 or (op is not None and op[0] != "F"):
                self._cut_graph()             # one graph per tick (pp = 1: per micro-batch)
        assert not self.in_flight and not self.inputs and not self.grads_in
        if self.clock:
            self.clock.stop()
        return self.loss_sum

    def _op(self, kind: str, i: int, c: int, tokens, targets, loss_scale: float) -> tuple:
        """Run op (kind, i, c) of the timetable: (activation, gradient) it produced for the neighbours."""
        if kind == "F":
            return self._forward(i, c, tokens, targets, loss_scale), None
        return None, self._backward(i, c)

    def _first(self, c: int) -> bool:   # does chunk c start the model (embedding, tokens in)?
        return self.mesh.is_first_stage and c == 0

    def _last(self, c: int) -> bool:    # does chunk c end the model (norm, head, loss)?
        return self.mesh.is_last_stage and c == len(self.chunks) - 1

    def _held(self) -> int:
        """(micro-batch, chunk) activations this stage holds now: forwarded, their backward still to come."""
        return len(self.in_flight)

    def _forward(self, i: int, c: int, tokens: list, targets: list, loss_scale: float) -> torch.Tensor | None:
        """F of micro-batch i through chunk c: its input is its tokens (first
        chunk of the model) or the activation received for it. Returns the
        activation for the next chunk; the model's last chunk adds its scaled
        loss to loss_sum instead."""
        layers = self.chunks[c]
        x = tokens[i] if self._first(c) else self.inputs.pop((i, c)).clone().requires_grad_()
        if self._last(c):
            out = self.model(x, targets[i], layers=layers).sum() * loss_scale
            self.loss_sum = self.loss_sum + out.detach()
        else:
            out = self.model(x, layers=layers)
        self.in_flight[(i, c)] = (x, out)
        self.peak_in_flight = max(self.peak_in_flight, self._held())
        return None if self._last(c) else out.detach()

    def _backward(self, i: int, c: int) -> torch.Tensor | None:
        """B of micro-batch i through chunk c, from the gradient received for
        its output (the model's last chunk starts from its loss). Returns the
        gradient of its input for the previous chunk (None for the first)."""
        x, out = self.in_flight.pop((i, c))   # freed after this backward
        out.backward() if self._last(c) else out.backward(self.grads_in.pop((i, c)))
        return None if self._first(c) else x.grad

    def _exchange(self, t: int, act: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        """The communication phase of tick t: the left boundary first, then the right one
        (why this cannot deadlock: the module docstring). `act` and `grad`: what this stage
        produced in tick t, if anything (the plan says the same: it reads the same timetable);
        what arrives is kept in inputs / grads_in, under the micro-batch and the chunk it is
        for, for later ticks' ops."""
        mesh, s, row = self.mesh, self.stage, self.ticks[t]
        if s > 0:                                            # boundary s-1 | s
            act_in, grad_out = self._exchange_plan(t, s - 1)
            if act_in is not None or grad_out is not None:
                theirs = comm.exchange(self._or_zeros(grad), mesh.group("prev"),
                                       sends=grad_out is not None, receives=act_in is not None)
                if act_in is not None:
                    self.inputs[(act_in, row[s - 1][2])] = theirs       # same chunk as the sender's
        if s < self.pp - 1:                                  # boundary s | s+1
            act_out, grad_in = self._exchange_plan(t, s)
            if act_out is not None or grad_in is not None:
                theirs = comm.exchange(self._or_zeros(act), mesh.group("next"),
                                       sends=act_out is not None, receives=grad_in is not None)
                if grad_in is not None:
                    self.grads_in[(grad_in, row[s + 1][2])] = theirs

    def _cut_graph(self) -> None:
        """XLA: end the graph recorded so far here, compile it (once) and run
        it; nothing elsewhere (device.py:Device.sync). These cuts decide which
        graphs XLA compiles: docs/design.md section 3, rule 1."""
        self.device.sync()

    @torch.no_grad()
    def forward_only(self, tokens, targets, loss_scale: float) -> torch.Tensor:
        """Evaluation: forwards only, micro-batch by micro-batch down the chain of chunks.
        Each chunk receives from the one before (`_sender`), computes, sends to the next
        (`_receiver`): each exchange pairs a stage that just computed with one waiting for
        it, so the chain cannot deadlock. Returns the scaled loss sum (zero off the last stage)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for i in range(self.m):
            for c, layers in enumerate(self.chunks):
                x = tokens[i] if self._first(c) else comm.exchange(self._or_zeros(None), self._sender(),
                                                                   sends=False)
                if self._last(c):
                    total = total + self.model(x, targets[i], layers=layers).sum() * loss_scale
                else:
                    y = self.model(x, layers=layers)
                    comm.exchange(self._or_zeros(y), self._receiver(), receives=False)
                if self.pp > 1:
                    self._cut_graph()
        return total

    def _sender(self):     # the pair with the stage whose activation this one's chunks take
        return self.mesh.group("prev")

    def _receiver(self):   # the pair with the stage that takes this one's activation
        return self.mesh.group("next")

    def _or_zeros(self, x):
        if x is None:
            return torch.zeros(self.act_shape, dtype=self.act_dtype, device=self.device.torch_device)
        return x.to(self.act_dtype)
