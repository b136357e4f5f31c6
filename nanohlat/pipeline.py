"""Pipeline parallelism: stages of layers, micro-batches, AFAB and 1F1B.

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
  1F1B: warm-up: min(p-s-1, m) forwards, then alternate  holds <= p activations
        F and B (steady state), then the remaining Bs (cool-down)
Both have the same bubble, (p-1)/(m+p-1) of the time, if each stage starts an
op as soon as its input exists; 1F1B's gain is memory (timeline.py times a
step and gives the bubble three ways: --timeline). With pp=1 the same code is
plain gradient accumulation.
"""

from __future__ import annotations

import torch

from . import comm
from nanohlat.tools import timeline


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
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


def timetable(schedule: str, pp: int, m: int) -> list[list[tuple[str, int] | None]]:
    """ticks[t][s] = the op stage s runs in tick t (None = idle, the bubble).

    An op runs as soon as its input arrived in an earlier tick: F(s, i) needs
    F(s-1, i); B(s, i) needs B(s+1, i) (the last stage needs its own F).
    """
    orders = [stage_order(schedule, pp, m, s) for s in range(pp)]
    nxt = [0] * pp
    done: dict = {}              # (kind, stage, mb) -> tick it finished in
    ticks = []
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        t = len(ticks)
        row = []
        for s in range(pp):
            op = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            if op is not None:
                kind, i = op
                dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                      (("B", s + 1, i) if s < pp - 1 else ("F", s, i))
                if dep is not None and done.get(dep, t) >= t:
                    op = None
            row.append(op)
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], s, op[1])] = t
                nxt[s] += 1
        ticks.append(row)
    return ticks


def render_ticks(ticks, pp: int) -> str:
    """The timetable as text, one row per stage: 'F3' forward of micro-batch 3, '..' idle."""
    rows = []
    for s in range(pp):
        cells = [(f"{row[s][0]}{row[s][1]}" if row[s] else "..").rjust(3) for row in ticks]
        rows.append(f"stage {s} |" + "".join(cells))
    return "\n".join(rows)


class PipelineRunner:
    """Runs one optimizer step's forward/backward over micro-batches on this stage."""

    def __init__(self, model, mesh, tcfg, act_shape, act_dtype, device):
        self.model, self.mesh, self.device = model, mesh, device
        self.pp, self.stage = mesh.pp, mesh.pp_rank
        self.m = tcfg.microbatches
        self.ticks = timetable(tcfg.schedule, self.pp, self.m)
        self.act_shape, self.act_dtype = act_shape, act_dtype   # (mb, T or T/tp, C)
        self.peak_in_flight = 0
        self.clock = timeline.StepClock(device, synchronize=tcfg.timeline)   # times each F and B

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
        this stage's scaled micro-batch losses (zero off the last stage).

        On XLA every tick (pp > 1) or every micro-batch (pp = 1) ends with a
        graph cut (device.sync): a graph then covers one op of one
        micro-batch, whose inputs are device data of the same shapes for every
        micro-batch (each is its own tensor, never `tokens[i]` of one big
        tensor, which would bake i into the graph). So the graphs compiled do
        not grow in number or size with m (neuronx-distributed marks a step
        per micro-batch too). The gradients accumulated so far stay on the
        device across a cut; the next graph adds to them."""
        mesh, s = self.mesh, self.stage
        inputs, grads_in = {}, {}          # received activations / gradients, by micro-batch
        in_flight = {}                     # mb -> (stage input, stage output) kept for backward
        to_send = {}                       # what this stage produced in the current tick
        total = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        # XLA: cut here, so that what the step queued before (zero_grad's reset of
        # the flat gradient buffers) is a graph of its own, not part of micro-batch
        # 0's; then every micro-batch runs the same graph (no gradient exists
        # before one: FlatAdamW's hooks move each into the fp32 buffer and free it)
        self.device.sync()
        self.peak_in_flight = 0
        self.clock.start()
        for t, row in enumerate(self.ticks):
            op = row[s]
            to_send.clear()
            if op is not None:
                kind, i = op
                start = self.clock.op_start()
                if kind == "F":
                    x = tokens[i] if mesh.is_first_stage else inputs.pop(i).clone().requires_grad_()
                    if mesh.is_last_stage:
                        out = self.model(x, targets[i]).sum() * loss_scale
                        total = total + out.detach()
                    else:
                        out = self.model(x)
                        to_send["act"] = out.detach()
                    in_flight[i] = (x, out)
                    self.peak_in_flight = max(self.peak_in_flight, len(in_flight))
                else:
                    x, out = in_flight.pop(i)   # freed after this backward
                    if mesh.is_last_stage:
                        out.backward()
                    else:
                        out.backward(grads_in.pop(i))
                    if not mesh.is_first_stage:
                        to_send["grad"] = x.grad
                self.clock.op_end(kind, i, start)
            # communication phase of tick t: left boundary first, then right (see docstring)
            if s > 0:
                act, grad = self._exchange_plan(t, s - 1)
                if act is not None or grad is not None:
                    mine = to_send.get("grad") if grad is not None else None
                    theirs = comm.exchange(self._or_zeros(mine), mesh.group("prev"), grad is not None, act is not None)
                    if act is not None:
                        inputs[act] = theirs
            if s < self.pp - 1:
                act, grad = self._exchange_plan(t, s)
                if act is not None or grad is not None:
                    mine = to_send.get("act") if act is not None else None
                    theirs = comm.exchange(self._or_zeros(mine), mesh.group("next"), act is not None, grad is not None)
                    if grad is not None:
                        grads_in[grad] = theirs
            if self.pp > 1 or (op is not None and op[0] == "B"):
                self.device.sync()   # on XLA: one graph per tick (pp = 1: per micro-batch), see run's docstring
        assert not in_flight and not inputs and not grads_in
        self.clock.stop()
        return total

    @torch.no_grad()
    def forward_only(self, tokens, targets, loss_scale: float) -> torch.Tensor:
        """Evaluation: forwards only, micro-batch by micro-batch down the chain.
        Stage s receives from s-1, computes, sends to s+1; each exchange pairs
        a stage that just computed with one waiting for its input, so the
        chain cannot deadlock. Returns the scaled loss sum (zero off the last stage)."""
        mesh = self.mesh
        total = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for i in range(self.m):
            x = tokens[i] if mesh.is_first_stage else \
                comm.exchange(self._or_zeros(None), mesh.group("prev"), sends=False)
            if mesh.is_last_stage:
                total = total + self.model(x, targets[i]).sum() * loss_scale
            else:
                comm.exchange(self._or_zeros(self.model(x)), mesh.group("next"), receives=False)
            if self.pp > 1:
                self.device.sync()
        return total

    def _or_zeros(self, x):
        if x is None:
            return torch.zeros(self.act_shape, dtype=self.act_dtype, device=self.device.torch_device)
        return x.to(self.act_dtype)
