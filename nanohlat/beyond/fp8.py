"""FP8 training (--fp8 RECIPE): the decoder's linears compute their three matmuls in eight bits.

A linear y = x W^T runs three matmuls a step, each with two operands cast to FP8 (fp8_scaling.py: the
formats, the saturating cast, each recipe's scales) and an fp32 accumulation:

    forward         y  = x  W^T      reduces over the inputs      x: E4M3    W: E4M3
    input gradient  dx = dY W        reduces over the outputs     dY: E5M2   W: E4M3
    weight gradient dW = dY^T x      reduces over the tokens      dY: E5M2   x: E4M3

(dY in E4M3 with --fp8-grad-format e4m3). Each operand is cast from the high-precision tensor the step
keeps (x, W, dY: bf16 under --precision bf16-mixed), with its blocks laid along the matmul it feeds:
the same x is cast along its inputs for the forward and along its tokens for dW where the recipe's
blocks have a direction (rowwise, blockwise, mx; torchao's Float8Linear casts again in the backward
the same way). Each product leaves in the step's dtype. What stays in high precision: the embedding,
the output head, the norms, the router, attention's scores and softmax (DeepSeek-V3 section 3.3),
and the optimizer's master weights, whatever --precision says they are.

Where a tensor is cut over ranks, its blocks are one process's (fp8_scaling.py's section on blocks):

  * tp: a column-parallel weight is cut along its outputs, and so is its output's gradient dY; a
    row-parallel weight and its input x along their inputs. A tensor-wise scale (tensorwise) or a
    block across the cut (rowwise along a cut reduction, a 128-block longer than a tp rank's piece)
    takes its amax over tp. Sequence parallelism's activations meet the linears gathered (the enter
    all-gather comes first, in the step's dtype): their scales are the whole tensor's already.
  * cp: every activation and gradient holds T/cp tokens of each sequence (zigzag chunks): a block
    along the tokens that crosses a chunk (tensor-wise, rowwise's dW, a tile longer than a chunk)
    takes its amax over cp.
  * ZeRO-3 gathers a layer's weights before it runs (zero3.py): the linears see whole weights.
  * dp, pp: each rank's micro-batch is one of one process's micro-batches; nothing is cut.
  * experts (fp8_experts.py): each expert's rows from each micro-batch are a tensor of their own.

So every layout computes one process's FP8 step, up to the order of fp32 sums (tests/beyond/
test_fp8_layouts.py). `apply` gives a model FP8 linears in place of its tensor-parallel ones (a
block's linears are ordinary attributes: model.py; docs/design.md 1), around the same parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nanohlat import comm, tensor_parallel as tpl
from nanohlat.beyond.fp8_scaling import (FORMATS, LARGEST, RECIPES, Axis, block_sizes, cast, delayed_scale, mm,
                                         operand_format)

ROLES = ("x", "w", "dy")
RULES = {"rowwise": "pow2", "mx": "mx"}   # how a block's amax becomes its scale (else largest / amax)
STAT_FIELDS = 5   # per operand in a step: amax, 1 / (smallest scale), elements, saturated, flushed


class Fp8Run:
    """What every FP8 linear of a rank shares: the recipe, the formats, where this rank's tokens sit in
    the micro-batch (--cp), the amax history's length and margin (delayed) and the statistics."""

    def __init__(self, recipe: str, grad_format: str = "e5m2", cp_group=None, token_positions=None,
                 history: int = 16, margin: int = 0):
        if recipe not in RECIPES:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        self.recipe, self.grad_format = recipe, FORMATS[grad_format]
        self.cp_group, self.token_positions = cp_group, token_positions
        self.history, self.margin = history, margin
        self.collecting = False   # --fp8-stats: the operands' statistics are counted in this step
        self.layers: list = []    # every FP8 module of this rank (apply), in the model's order

    def format(self, role: str) -> torch.dtype:
        return operand_format(role, self.grad_format)

    def tokens(self, batch_shape) -> Axis:
        """The token axis of a (B, T) micro-batch flattened, as one process has it: with --cp this rank's
        T are T/cp of each sequence, in 2 chunks of T/(2 cp) (context_parallel.zigzag_positions)."""
        B, T = (int(d) for d in batch_shape)
        cp = self.cp_group
        if cp is None or cp.size == 1:
            return Axis(B * T)
        whole = T * cp.size
        where = self.token_positions(T).to(torch.long)
        index = (torch.arange(B).view(-1, 1) * whole + where.view(1, -1)).reshape(-1)
        return Axis(B * T, B * whole, index=index, piece=whole // (2 * cp.size), groups=(cp,))


def _state(module: nn.Module, run: Fp8Run, shape: tuple) -> None:
    """Give an FP8 module its delayed-scaling state (persistent buffers: checkpoints keep them, so a
    resume casts with the scales it would have had): per operand `fp8_scale` (`shape`) and
    `fp8_history` (`shape` x length, newest first), and the step's amax so far (not saved)."""
    module.register_buffer("fp8_scale", torch.ones(shape) if run.recipe == "delayed" else None)
    module.register_buffer("fp8_history", torch.zeros(*shape, run.history) if run.recipe == "delayed" else None)
    module.step_amax = torch.zeros(shape)
    module.stats = torch.zeros(*shape, STAT_FIELDS)


def _keep_fp32(module: nn.Module, fn, recurse, apply_parent):
    """module.to(device, dtype) moves the FP8 state but keeps it fp32 (a bf16 scale would round)."""
    kept = {k: module._buffers.pop(k) for k in ("fp8_scale", "fp8_history")}
    out = apply_parent(fn, recurse)
    for k, b in kept.items():
        module._buffers[k] = None if b is None else b.to(fn(b).device, torch.float32)
    module.step_amax = module.step_amax.to(fn(module.step_amax).device, torch.float32)
    module.stats = module.stats.to(module.step_amax.device)
    return out


class Operands:
    """The casts of one linear's operands: its run, the axes of its weight (`out_axis`, `in_axis`) and
    where its delayed state and statistics live (`owner`, at `slot`: an index into their first dims)."""

    def __init__(self, run: Fp8Run, owner: nn.Module, out_axis: Axis, in_axis: Axis, slot=()):
        self.run, self.owner, self.out_axis, self.in_axis, self.slot = run, owner, out_axis, in_axis, slot

    def cast(self, role: str, t: torch.Tensor, rows: Axis, cols: Axis, along: int, memo: dict, record: bool):
        """`t` (2-D) cast for a matmul reducing along its dim `along`, as the recipe lays blocks for `role`.
        A cast with the same blocks as one already made for this matmul group is that one (memo)."""
        run = self.run
        across, length = block_sizes(run.recipe, role)
        blocks = (length, across) if along == 0 else (across, length)
        key = (role, blocks)
        if key in memo:
            return memo[key]
        k, fmt = ROLES.index(role), run.format(role)
        scale = self.owner.fp8_scale[self.slot + (k,)] if run.recipe == "delayed" else None
        c = cast(t, rows, cols, blocks, RULES.get(run.recipe, "amax"), fmt, scale, count=record and run.collecting)
        if record:
            amax = c.amax.max() if c.amax.numel() else c.amax.new_zeros(())
            if run.recipe == "delayed":   # the step's amax of this operand, for the history (`end_step`)
                self.owner.step_amax[self.slot + (k,)] = torch.maximum(self.owner.step_amax[self.slot + (k,)], amax)
            if run.collecting:
                row = torch.stack([amax, c.scale.min().reciprocal(), torch.tensor(float(t.numel()), device=amax.device),
                                   c.saturated.float(), c.flushed.float()]).to(self.owner.stats.device)
                old = self.owner.stats[self.slot + (k,)]
                self.owner.stats[self.slot + (k,)] = torch.cat([torch.maximum(old[:2], row[:2]), old[2:] + row[2:]])
        memo[key] = c
        return c


class _Fp8Matmuls(torch.autograd.Function):
    """y = x W^T with each of its three matmuls in FP8 (module docstring). x (..., in), w (out, in)."""

    @staticmethod
    def forward(ctx, x, w, ops: Operands, tokens: Axis, record: bool):
        ctx.ops, ctx.tokens = ops, tokens
        ctx.save_for_backward(x, w)   # high precision, as F.linear keeps them: the backward casts again
        x2, memo = x.reshape(-1, x.shape[-1]), {}
        cx = ops.cast("x", x2, tokens, ops.in_axis, 1, memo, record)
        cw = ops.cast("w", w, ops.out_axis, ops.in_axis, 1, memo, record)
        return mm(cx, cw, transpose_b=True).to(x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ops, tokens = ctx.ops, ctx.tokens
        x2, g2, memo = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), {}
        dx = dw = None
        if ctx.needs_input_grad[0]:   # dx = dY W: reduces over the outputs
            cg = ops.cast("dy", g2, tokens, ops.out_axis, 1, memo, True)
            cw = ops.cast("w", w, ops.out_axis, ops.in_axis, 0, memo, True)
            dx = mm(cg, cw).to(x.dtype).view_as(x)
        if ctx.needs_input_grad[1]:   # dW = dY^T x: reduces over the tokens
            cg = ops.cast("dy", g2, tokens, ops.out_axis, 0, memo, True)
            cx = ops.cast("x", x2, tokens, ops.in_axis, 0, memo, True)
            dw = mm(cg, cx, transpose_a=True).to(w.dtype)
        return dx, dw, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ops: Operands, tokens: Axis) -> torch.Tensor:
    """x W^T in FP8 (_Fp8Matmuls); a forward without gradients (evaluation) records no amax or statistics."""
    return _Fp8Matmuls.apply(x, w, ops, tokens, torch.is_grad_enabled())


def linear_axes(weight: torch.Tensor, group) -> tuple[Axis, Axis]:
    """(outputs, inputs) of a tensor-parallel weight (out, in) as one process has them: the dimension
    its ShardSpec cuts into `parts` held by the tp group (the kv heads' replicas hold equal pieces)."""
    spec = weight.shard
    axes = []
    for dim in (0, 1):
        n = weight.shape[dim]
        if spec.dim == dim and spec.parts > 1:
            axes.append(Axis(n, n * spec.parts, start=spec.part * n, piece=n, groups=(group,)))
        else:
            axes.append(Axis(n))
    return axes[0], axes[1]


class Fp8ColumnParallelLinear(tpl.ColumnParallelLinear):
    """A column-parallel linear whose three matmuls are FP8 (around the same weight)."""

    def __init__(self, m: tpl.ColumnParallelLinear, run: Fp8Run, group, name: str):
        nn.Module.__init__(self)   # (not the parent's, which would make a new weight: m's is kept)
        self.weight, self.name = m.weight, name
        _state(self, run, (3,))
        self.ops = Operands(run, self, *linear_axes(self.weight, group))

    def linear(self, x, w):
        return fp8_linear(x, w, self.ops, self.ops.run.tokens(x.shape[:-1]))

    def weight_grads(self, weights, x, gather, grads) -> list:
        raise RuntimeError("an FP8 linear under sequence parallelism gathers its input before it runs "
                           "(--fp8 implies --no-sp-regather: recipe/command_line.py)")

    def _apply(self, fn, recurse=True):
        return _keep_fp32(self, fn, recurse, super()._apply)


class Fp8RowParallelLinear(tpl.RowParallelLinear):
    """A row-parallel linear whose three matmuls are FP8 (around the same weight), then `leave`."""

    def __init__(self, m: tpl.RowParallelLinear, run: Fp8Run, group, name: str):
        nn.Module.__init__(self)   # (as Fp8ColumnParallelLinear's)
        self.weight, self.name = m.weight, name
        self.group, self.sequence_parallel = m.group, m.sequence_parallel
        _state(self, run, (3,))
        self.ops = Operands(run, self, *linear_axes(self.weight, group))

    def linear(self, x, w):
        return fp8_linear(x, w, self.ops, self.ops.run.tokens(x.shape[:-1]))

    def _apply(self, fn, recurse=True):
        return _keep_fp32(self, fn, recurse, super()._apply)


FP8_LINEARS = (Fp8ColumnParallelLinear, Fp8RowParallelLinear)


def apply(model, run: Fp8Run) -> Fp8Run:
    """Every linear of `model`'s blocks (attention's wq, wk, wv, wo; the MLP's gate, up, down) gives way to
    its FP8 kind around the same parameter, in its place among its parent's modules (the parameters keep
    their names and order); a mixture's experts are fp8_experts.apply's. The embedding, the head, the
    norms and the router are left as they are. Returns `run`, whose `layers` lists them."""
    kinds = {tpl.ColumnParallelLinear: Fp8ColumnParallelLinear, tpl.RowParallelLinear: Fp8RowParallelLinear}
    for i, block in model.layers.items():
        for part in (block.attn, block.mlp):
            for name, m in list(part.named_children()):
                if type(m) in kinds:
                    prefix = "attn" if part is block.attn else "mlp"
                    setattr(part, name, kinds[type(m)](m, run, model.group, f"layers.{i}.{prefix}.{name}"))
    run.layers += [m for m in model.modules() if isinstance(m, FP8_LINEARS)]
    return run


# ---------------------------------------------------------------------------
# The end of a step: delayed scaling's history moves on (the optimizer's step hook, every rank)
# ---------------------------------------------------------------------------

def end_step(run: Fp8Run, groups, finite=None) -> None:
    """delayed: each operand's amax of the step (the max over its micro-batches and over every rank
    that saw other tokens or another piece of it: tp, dp x cp: `groups`; one all-gather of all of them)
    enters its history, newest first, and the next step's scale comes from the history (fp8_scaling.
    delayed_scale). A step that was not `finite` (skipped by the optimizer) changes nothing."""
    layers = [m for m in run.layers if m.fp8_history is not None]
    if not layers:
        return
    amax = torch.cat([m.step_amax.reshape(-1) for m in layers])
    for group in groups:
        amax = comm.all_gather(amax.unsqueeze(0), group, what="fp8 amax history").amax(0)
    largest = torch.tensor([LARGEST[run.format(r)] for r in ROLES], device=amax.device)
    keep = finite if finite is not None else torch.ones((), dtype=torch.bool, device=amax.device)
    at = 0
    for m in layers:
        n = m.step_amax.numel()
        new = amax[at:at + n].view_as(m.step_amax)
        at += n
        history = torch.cat([new.unsqueeze(-1), m.fp8_history[..., :-1]], dim=-1)
        scale = delayed_scale(history, m.fp8_scale, largest, run.margin)
        m.fp8_history.copy_(torch.where(keep, history, m.fp8_history))
        m.fp8_scale.copy_(torch.where(keep, scale, m.fp8_scale))
        m.step_amax.zero_()
