"""Pipeline parallelism: stages of layers, micro-batches, AFAB, 1F1B, interleaved, ZB-H1.

Papers: Huang et al. 2019, "GPipe" (arXiv 1811.06965) for all-forward-all-
backward (AFAB); Narayanan et al. 2019/2021, "PipeDream" / "Efficient
Large-Scale Language Model Training on GPU Clusters" (arXiv 2104.04473) for
one-forward-one-backward (1F1B, "PipeDream-flush") and its interleaved form;
Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241), ZB-H1.

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
nothing crosses it.) Interleaved adds the wrap boundary (p-1)|0, which
stage 0 and stage p-1 take last: each reaches it after its chain exchange
completed, so neither waits on a rank that waits on it. (pp = 2: the same
pair of ranks, two exchanges in the same order on both.) ZB-H1's W ops need
no exchange at all: W(i) needs only its own stage's B(i) of an earlier tick;
to its neighbours a W tick is one in which it sends nothing (zeros), the
chain above is unchanged, and nothing on another stage ever waits on a W.

Schedules (p stages, m micro-batches; per stage, in order):
  AFAB: F0 F1 ... F(m-1)  B0 B1 ... B(m-1)             holds m activations
  1F1B: warm-up forwards (fewer, the later the stage),   holds <= p activations
        then alternate F and B (steady state), then the remaining Bs (cool-down)
Both have the same bubble, (p-1)/(m+p-1) of the time, if each stage starts an
op as soon as its input exists; 1F1B's gain is memory (tools/timeline.py
times a step through the runner's clock and gives the bubble three ways:
--timeline). With pp=1 the same code is plain gradient accumulation.
Interleaved (--virtual-stages v): the layers are cut into p*v chunks and
stage s holds chunks s, s+p, ... (chunk_layers); a micro-batch visits every
stage v times, so filling and draining the pipeline takes chunk-sized ops:
bubble (p-1)/(v*m+p-1), for v times the exchanges (interleaved_order).
ZB-H1 (--schedule zb-h1) splits each backward into B (the input's gradient,
which the previous stage waits for) and W (the weights', which nobody waits
for: split_backward.py), and fills ticks a stage would idle in with W ops.
F = B = W = 1 unit: bubble (p-1)/(3m+p-1), at 1F1B's peak of p in flight.
"""

from __future__ import annotations

import torch

from . import comm
from . import split_backward


def chunk_layers(n_layers: int, pp: int, stage: int, chunk: int = 0, v: int = 1) -> range:
    """The layers of one model chunk. With v chunks per stage the model is cut
    into pp*v equal pieces, the virtual stages k = chunk*pp + stage: stage s
    holds pieces s, s+pp, s+2pp, ... (v = 1: one contiguous piece per stage)."""
    per = n_layers // (pp * v)
    k = chunk * pp + stage
    return range(k * per, (k + 1) * per)


def stage_layers(n_layers: int, pp: int, stage: int, v: int = 1) -> list[int]:
    """Every layer stage `stage` holds: its v chunks, in order."""
    return [i for c in range(v) for i in chunk_layers(n_layers, pp, stage, c, v)]


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


def interleaved_order(pp: int, m: int, v: int, stage: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Megatron-LM): the ops (kind, micro-batch, chunk) of one
    stage. Micro-batches go through the chunks in groups of pp (m a multiple
    of pp): forwards take 0..pp-1 through chunk 0, then through chunk 1, ...,
    then the next group; backwards the same, last chunk first. First some
    warm-up forwards (how many?), then 1F1B, then the remaining backwards."""
    # exercise 5c: begin
    total = v * m

    def unit(j: int, kind: str) -> tuple[str, int, int]:
        group, pos = divmod(j, pp * v)
        chunk = pos // pp
        return kind, group * pp + pos % pp, (chunk if kind == "F" else v - 1 - chunk)

    warmup = min(2 * (pp - 1 - stage) + (v - 1) * pp, total)
    ops = [unit(j, "F") for j in range(warmup)]
    f, b = warmup, 0
    while b < total:
        if f < total:
            ops.append(unit(f, "F"))
            f += 1
        ops.append(unit(b, "B"))
        b += 1
    return ops
    # exercise 5c: end


def zb_h1_order(pp: int, m: int, stage: int) -> list[tuple[str, int, int]]:
    """ZB-H1: 1F1B's F and B (B now only the input gradient), stage s running
    W(j) after B(j+s). 1F1B's stage s holds p-s micro-batches; holding each
    s B's longer (to its W), every stage holds p, 1F1B's peak; the s W's owed
    after the last B fill the ticks 1F1B's stage s would idle in while the
    backwards drain through the stages before it (m >= p: mesh.py)."""
    ops = []
    for kind, i in stage_order("1f1b", pp, m, stage):
        ops += [(kind, i, 0)] + ([("W", i - stage, 0)] if kind == "B" and i >= stage else [])
    return ops + [("W", j, 0) for j in range(max(m - stage, 0), m)]


def stage_ops(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Every schedule's order for one stage as (kind, micro-batch, chunk):
    stage_order's ops on chunk 0 for AFAB and 1F1B, interleaved_order's for
    interleaved (v chunks), zb_h1_order's (F, B and W) for zb-h1."""
    if schedule == "interleaved":
        return interleaved_order(pp, m, v, stage)
    if schedule == "zb-h1":
        return zb_h1_order(pp, m, stage)
    return [(kind, i, 0) for kind, i in stage_order(schedule, pp, m, stage)]


def depends_on(op: tuple[str, int, int], stage: int, pp: int, v: int = 1) -> tuple | None:
    """The op (kind, stage, micro-batch, chunk) that must finish before `op` of
    `stage` starts, or None. In virtual stages k = chunk*pp + stage: F(k, i)
    needs F(k-1, i) (on the last stage when k is a multiple of pp: the wrap),
    B(k, i) needs B(k+1, i), and the very last virtual stage its own F; W(i)
    (zb-h1) its own stage's B(i), so nothing on another stage waits on a W."""
    kind, i, c = op
    k = c * pp + stage
    if kind == "W":
        return ("B", stage, i, c)
    if kind == "F":
        return None if k == 0 else ("F", (k - 1) % pp, i, (k - 1) // pp)
    if k == pp * v - 1:
        return ("F", stage, i, c)
    return ("B", (k + 1) % pp, i, (k + 1) // pp)


def timetable(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int] | None]]:
    """ticks[t][s] = the op (kind, micro-batch, chunk) stage s runs in tick t
    (None = idle, the bubble).

    An op runs as soon as its input arrived in an earlier tick (depends_on).
    A tick in which no stage can run has nothing to wait for: the orders
    deadlock, which is a bug in them, and raises."""
    orders = [stage_ops(schedule, pp, m, s, v) for s in range(pp)]
    nxt = [0] * pp
    done: dict = {}              # (kind, stage, mb, chunk) -> tick it finished in
    ticks = []
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        t = len(ticks)
        row = []
        for s in range(pp):
            op = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            if op is not None:
                dep = depends_on(op, s, pp, v)
                if dep is not None and done.get(dep, t) >= t:
                    op = None
            row.append(op)
        if not any(row):
            raise RuntimeError(f"schedule {schedule} deadlocks at tick {t} (pp {pp}, m {m}, v {v})")
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], s, op[1], op[2])] = t
                nxt[s] += 1
        ticks.append(row)
    return ticks


class PipelineRunner:
    """Runs one optimizer step's forward/backward over micro-batches on this stage."""

    def __init__(self, model, mesh, tcfg, act_shape, act_dtype, device, clock=None):
        self.model, self.mesh, self.device = model, mesh, device
        self.pp, self.stage = mesh.pp, mesh.pp_rank
        self.m = tcfg.microbatches
        self.v = tcfg.virtual_stages              # model chunks on this stage (one: None, all its layers, no range for --compile)
        self.chunks = [chunk_layers(model.cfg.n_layers, self.pp, self.stage, c, self.v) for c in range(self.v)] if self.v > 1 else [None]
        self.ticks = timetable(tcfg.schedule, self.pp, self.m, self.v)
        self.split = tcfg.schedule == "zb-h1"    # backward split into B and W (split_backward.py)
        self.split_backward = split_backward.SplitBackward(model if self.split else None)   # what Bs leave W
        self.act_shape, self.act_dtype = act_shape, act_dtype   # (mb, T or T/tp, C)
        self.peak_in_flight = 0      # most (micro-batch, chunk) activations held, last step
        self.clock = clock     # None, or told the start and end of each F and B (tools/timeline.py:StepClock)

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
        this stage's scaled micro-batch losses (off the last stage zero, or a
        MoE model's router losses of this stage's layers: model.chunk_router).

        Each tick: this stage's op of the timetable (`_forward`, `_backward`,
        zb-h1's W), then the tick's exchanges (`_exchange`), then, on XLA, a
        graph cut (`_cut_graph`) after every tick (pp > 1) or every backward
        (pp = 1; zb-h1: B, W). A graph covers one op of one micro-batch, whose
        inputs are tensors of their own (never `tokens[i]` of one big tensor,
        which would bake i into the graph), so the graphs compiled do not grow
        in number or size with m: a tick's graph is set by its op's kind and
        chunk and by what crosses (tests/test_schedule.py)."""
        self.inputs, self.grads_in = {}, {}   # received activations / gradients, by (micro-batch, chunk)
        self.in_flight = {}                   # (mb, chunk) -> (input, output, MoE router losses or None), for B
        self.deferred = {}                    # zb-h1: (mb, chunk) -> what its W needs, B to W
        self.peak_in_flight = 0
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        # before micro-batch 0: what the step queued before (zero_grad's reset) is a graph of its own,
        # and every micro-batch runs the same graph (no gradient exists before one: the hooks free it)
        self._cut_graph()
        if self.clock:
            self.clock.start()
        with self.split_backward:             # zb-h1: the linears defer their dW to it, in these ticks only
            for t, row in enumerate(self.ticks):
                op = row[self.stage]
                act = grad = None                 # what this stage produced in tick t, for its neighbours
                if op is not None:
                    kind, i, c = op
                    started = self.clock.op_start() if self.clock else 0.0
                    if kind == "F":
                        act = self._forward(i, c, tokens, targets, loss_scale)
                    elif kind == "B":
                        grad = self._backward(i, c)
                    else:                         # W: the weight gradients B left for later
                        split_backward.weight_grads(self.deferred.pop((i, c)))
                    if self.clock:
                        self.clock.op_end(kind, i, started, c)
                self._exchange(t, act, grad)
                if self.pp > 1 or (op is not None and op[0] != "F"):
                    self._cut_graph()             # one graph per tick (pp = 1: per micro-batch, zb-h1: per B, W)
        assert not self.in_flight and not self.inputs and not self.grads_in and not self.deferred
        if self.clock:
            self.clock.stop()
        return self.loss_sum

    def _first(self, c: int) -> bool:   # does chunk c start the model (embedding, tokens in)?
        return self.mesh.is_first_stage and c == 0

    def _last(self, c: int) -> bool:    # does chunk c end the model (norm, head, loss)?
        return self.mesh.is_last_stage and c == self.v - 1

    def _forward(self, i: int, c: int, tokens: list, targets: list, loss_scale: float) -> torch.Tensor | None:
        """F of micro-batch i through chunk c: its input is its tokens (first
        chunk of the model) or the activation received for it. Returns the
        activation for the next chunk; the model's last chunk adds its scaled
        loss to loss_sum instead (a MoE chunk before it, its router losses)."""
        layers = self.chunks[c]
        x = tokens[i] if self._first(c) else self.inputs.pop((i, c)).clone().requires_grad_()
        router = None
        if self._last(c):
            out = self.model(x, targets[i], layers=layers).sum() * loss_scale
            self.loss_sum = self.loss_sum + out.detach()
        else:
            out = self.model(x, layers=layers)
            if self.model.chunk_router is not None:   # MoE: this chunk's router losses, weighted as at pp 1
                router = self.model.chunk_router * loss_scale
                self.loss_sum = self.loss_sum + router.detach()
        self.in_flight[(i, c)] = (x, out, router)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight) + len(self.deferred))
        return None if self._last(c) else out.detach()

    def _backward(self, i: int, c: int) -> torch.Tensor | None:
        """B of micro-batch i through chunk c, from the gradient received for
        its output (the model's last chunk starts from its loss). Returns the
        gradient of its input for the previous chunk (None for the first)."""
        x, out, router = self.in_flight.pop((i, c))   # freed after this backward
        if self._last(c):
            out.backward()
        elif router is None:
            out.backward(self.grads_in.pop((i, c)))
        else:   # MoE: the router losses' gradient joins the received one (zb-h1: in B's dx and W's dW alike)
            torch.autograd.backward([out, router], [self.grads_in.pop((i, c)), None])
        if self.split:                        # zb-h1: the linears' dW left for W
            self.deferred[(i, c)], self.split_backward.stash = self.split_backward.stash, []
        return None if self._first(c) else x.grad

    def _exchange(self, t: int, act: torch.Tensor | None, grad: torch.Tensor | None) -> None:
        """The communication phase of tick t: the left boundary first, then the right one,
        then (interleaved) the wrap-around boundary (why this cannot deadlock: the module
        docstring). `act` and `grad`: what this stage produced in tick t, if anything (the
        plan says the same: it reads the same timetable); what arrives is kept in inputs /
        grads_in, under the micro-batch and the chunk it is for, for later ticks' ops."""
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
        if self.v > 1 and (mesh.is_first_stage or mesh.is_last_stage):   # wrap: last stage | first stage
            act_wrap, grad_wrap = self._wrap_plan(t)
            if act_wrap is not None or grad_wrap is not None:
                mine, sends, receives = ((act, act_wrap, grad_wrap) if mesh.is_last_stage
                                         else (grad, grad_wrap, act_wrap))
                theirs = comm.exchange(self._or_zeros(mine), mesh.group("wrap"),
                                       sends=sends is not None, receives=receives is not None)
                if receives is not None and mesh.is_first_stage:
                    self.inputs[(act_wrap, row[-1][2] + 1)] = theirs    # chunk c of the last stage feeds c+1
                elif receives is not None:
                    self.grads_in[(grad_wrap, row[0][2] - 1)] = theirs

    def _wrap_plan(self, t: int) -> tuple[int | None, int | None]:
        """Interleaved only: (micro-batch whose activation crosses from the last
        stage's chunk c to the first stage's chunk c+1 after tick t, micro-batch
        whose gradient crosses back from chunk c+1 to chunk c), None where
        nothing moves."""
        last, first = self.ticks[t][-1], self.ticks[t][0]
        act = last[1] if last is not None and last[0] == "F" and last[2] < self.v - 1 else None
        grad = first[1] if first is not None and first[0] == "B" and first[2] > 0 else None
        return act, grad

    def _cut_graph(self) -> None:
        """XLA: end the graph recorded so far here, compile it (once) and run
        it; nothing elsewhere (device.py:Device.sync). These cuts decide which
        graphs XLA compiles: docs/design.md section 3, rule 1."""
        self.device.sync()

    @torch.no_grad()
    def forward_only(self, tokens, targets, loss_scale: float) -> torch.Tensor:
        """Evaluation: forwards only, micro-batch by micro-batch down the chain of chunks
        (virtual stages 0, 1, ..., pp*v - 1). Each chunk receives from the one before (the
        previous stage; for the first stage's chunk c > 0 the last stage's chunk c-1, across
        the wrap pair), computes, sends to the next: each exchange pairs a stage that just
        computed with one waiting for it, so the chain cannot deadlock. Returns the scaled
        loss sum (zero off the last stage)."""
        mesh = self.mesh
        total = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for i in range(self.m):
            for c in range(self.v):
                if self._first(c):
                    x = tokens[i]
                else:
                    src = mesh.group("prev") if not mesh.is_first_stage else mesh.group("wrap")
                    x = comm.exchange(self._or_zeros(None), src, sends=False)
                if self._last(c):
                    total = total + self.model(x, targets[i], layers=self.chunks[c]).sum() * loss_scale
                else:
                    dst = mesh.group("next") if not mesh.is_last_stage else mesh.group("wrap")
                    comm.exchange(self._or_zeros(self.model(x, layers=self.chunks[c])), dst, receives=False)
                if self.pp > 1:
                    self._cut_graph()
        return total

    def _or_zeros(self, x):
        if x is None:
            return torch.zeros(self.act_shape, dtype=self.act_dtype, device=self.device.torch_device)
        return x.to(self.act_dtype)
