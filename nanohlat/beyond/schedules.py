"""Pipeline schedules beyond AFAB and 1F1B: interleaved 1F1B and zero-bubble ZB-H1 (tutorial chapter 5).

Papers: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters" (arXiv 2104.04473), the interleaved schedule; Qi et al. 2024, "Zero Bubble
Pipeline Parallelism" (arXiv 2401.10241), ZB-H1.

Interleaved (--schedule interleaved --virtual-stages v): the layers are cut into p*v
chunks and stage s holds chunks s, s+p, ... (chunk_layers); a micro-batch visits every
stage v times, so filling and draining the pipeline takes chunk-sized ops: bubble
(p-1)/(v*m+p-1), for v times the exchanges (interleaved_order). A micro-batch leaves
the last stage's chunk c for the first stage's chunk c+1: the wrap boundary (p-1)|0,
which stage 0 and stage p-1 take last in a tick: each reaches it after its chain
exchange (pipeline.py's docstring) completed, so neither waits on a rank that waits
on it. (pp = 2: the same pair of ranks, two exchanges in the same order on both.)

ZB-H1 (--schedule zb-h1) splits each backward into B (the input's gradient, which the
previous stage waits for) and W (the weights', which nobody waits for:
split_backward.py), and fills ticks a stage would idle in with W ops. F = B = W = 1
unit: bubble (p-1)/(3m+p-1), at 1F1B's peak of p in flight. W ops need no exchange
at all: W(i) needs only its own stage's B(i) of an earlier tick; to its neighbours a
W tick is one in which it sends nothing, the chain of exchanges is unchanged, and
nothing on another stage ever waits on a W.

Each is a PipelineRunner (pipeline.py) with its own timetable: `runner` picks the class.
"""

from __future__ import annotations

from nanohlat import comm, pipeline
from nanohlat.beyond import split_backward
from nanohlat.pipeline import PipelineRunner, stage_order

SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1")   # --schedule


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
    """pipeline.depends_on, and W(i): its own stage's B(i), so nothing on another stage waits on a W."""
    kind, i, c = op
    return ("B", stage, i, c) if kind == "W" else pipeline.depends_on(op, stage, pp, v)


def timetable(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int] | None]]:
    """The ticks of any schedule (pipeline.timetable of every stage's `stage_ops`)."""
    return pipeline.timetable([stage_ops(schedule, pp, m, s, v) for s in range(pp)], pp, v, depends_on)


def runner(schedule: str) -> type:
    """The PipelineRunner class that runs `schedule`."""
    return {"interleaved": InterleavedRunner, "zb-h1": ZeroBubbleRunner}.get(schedule, PipelineRunner)


class InterleavedRunner(PipelineRunner):
    """The interleaved schedule: v chunks on this stage, the wrap boundary last stage -> first stage."""

    def __init__(self, model, mesh, tcfg, act_shape, act_dtype, device, clock=None):
        self.v = tcfg.virtual_stages
        super().__init__(model, mesh, tcfg, act_shape, act_dtype, device, clock)
        self.chunks = [chunk_layers(model.cfg.n_layers, self.pp, self.stage, c, self.v) for c in range(self.v)]

    def timetable(self, tcfg) -> list:
        return timetable("interleaved", self.pp, self.m, self.v)

    def _wrap(self):   # the pair last stage <-> first stage (pp 2: the one pair of neighbours)
        if self.pp == 2:
            return self.mesh.group("next" if self.mesh.is_first_stage else "prev")
        return self.mesh.group("wrap")

    def _sender(self):     # chunk c > 0 of the first stage takes chunk c-1's activation from the last
        return self._wrap() if self.mesh.is_first_stage else super()._sender()

    def _receiver(self):
        return self._wrap() if self.mesh.is_last_stage else super()._receiver()

    def _exchange(self, t: int, act, grad) -> None:
        """The chain's two boundaries (pipeline.py), then the wrap boundary."""
        super()._exchange(t, act, grad)
        mesh, row = self.mesh, self.ticks[t]
        if mesh.is_first_stage or mesh.is_last_stage:   # wrap: last stage | first stage
            act_wrap, grad_wrap = self._wrap_plan(t)
            if act_wrap is not None or grad_wrap is not None:
                mine, sends, receives = ((act, act_wrap, grad_wrap) if mesh.is_last_stage
                                         else (grad, grad_wrap, act_wrap))
                theirs = comm.exchange(self._or_zeros(mine), self._wrap(),
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


class ZeroBubbleRunner(PipelineRunner):
    """ZB-H1: 1F1B's F and B, B only the input gradient, W ops for the weights' (split_backward.py)."""

    def __init__(self, model, mesh, tcfg, act_shape, act_dtype, device, clock=None):
        super().__init__(model, mesh, tcfg, act_shape, act_dtype, device, clock)
        self.split = split_backward.SplitBackward(model)   # what the Bs leave their Ws
        self.deferred = {}                                  # (mb, chunk) -> what its W needs, B to W

    def timetable(self, tcfg) -> list:
        return timetable("zb-h1", self.pp, self.m)

    def run(self, tokens: list, targets: list, loss_scale: float):
        self.deferred = {}
        with self.split:                   # the linears defer their dW to it, in these ticks only
            loss = super().run(tokens, targets, loss_scale)
        assert not self.deferred
        return loss

    def _op(self, kind: str, i: int, c: int, tokens, targets, loss_scale: float) -> tuple:
        if kind != "W":
            return super()._op(kind, i, c, tokens, targets, loss_scale)
        split_backward.weight_grads(self.deferred.pop((i, c)))   # the weight gradients B left for later
        return None, None

    def _backward(self, i: int, c: int):
        grad = super()._backward(i, c)
        self.deferred[(i, c)], self.split.stash = self.split.stash, []
        return grad

    def _held(self) -> int:
        return len(self.in_flight) + len(self.deferred)


def wrap_groups(mesh) -> list[list[int]]:
    """The mesh's kind 'pair_wrap' with the interleaved schedule (build.py gives it): with an odd pp >= 3,
    the last stage <-> first stage pairs, which mesh.py's odd pairs lack (an even pp has them there):
    the two ends of each of the mesh's pp groups (with --cp, each cp rank's)."""
    return [[g[0], g[-1]] for g in mesh._all("pp")] if mesh.pp > 2 and mesh.pp % 2 else []
