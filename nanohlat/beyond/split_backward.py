"""ZB-H1's split backward (schedules.py): the input gradients in B, the weights' in W.

A linear's backward computes dx = g W, which the layer before waits for, and dW = g^T x,
which nothing needs before the step. B computes dx, stashing (W, x, g); W computes each dW
with autograd's mm (the same bits) and hands it to autograd, whose AccumulateGrad runs the
hooks (optim.py) as an unsplit backward does (in B they run with no gradient and add nothing).
The norm gains and the embedding keep theirs in B. `apply` makes the model's tensor-parallel
linears split ones (subclasses of tensor_parallel.py's, the same parameters), which defer only
inside a `with` of the SplitBackward that the pipeline runner running the ticks owns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanohlat import tensor_parallel as tpl


class SplitBackward:
    """What the Bs of a zb-h1 step leave for their Ws (`stash`). Inside `with` the model's split linears
    hold it (`split`) and defer to it; after the block, however it ends, None again (whole), stash empty."""

    def __init__(self, model=None):
        self.layers = [m for m in model.modules() if isinstance(m, SPLIT)] if model is not None else []
        self.stash = []   # (weights, x, gather, grads) of each linear: dW = g^T x, gather(x) first unless None

    def __enter__(self) -> SplitBackward:
        for m in self.layers:
            m.split = self
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.split = None
        self.stash = []


def linear(x: torch.Tensor, w: torch.Tensor, split: SplitBackward | None = None) -> torch.Tensor:
    """x W^T: F.linear, or in a zb-h1 step (`split`) the same product with its dW left for W."""
    return _SplitLinear.apply(x, w, split) if split is not None and torch.is_grad_enabled() else F.linear(x, w)


class _SplitLinear(torch.autograd.Function):
    """F.linear whose backward returns only dx (F.linear's mm)."""

    @staticmethod
    def forward(ctx, x, w, split):
        ctx.save_for_backward(x, w)
        ctx.split = split
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.split.stash.append(((w,), x, None, (g,)))
        return g.reshape(-1, g.shape[-1]).mm(w).view_as(x), None, None


def weight_grads(stash: list) -> None:
    """The W op: each dW = g^T x one B stashed, accumulated as a backward would."""
    weights, dws = [], []
    with torch.no_grad():                      # (as in a backward: nothing here is differentiated)
        for ws, x, gather, grads in stash:     # _GatherLinears kept the T/tp shard: `gather` gathers it
            weights += ws
            dws += tpl.weight_grads_of(x if gather is None else gather(x), grads)
    torch.autograd.backward(weights, dws)      # AccumulateGrad and its hooks, once per parameter


class SplitColumnParallelLinear(tpl.ColumnParallelLinear):
    """A column-parallel linear whose weight gradients wait for W in a zb-h1 step (`split` set)."""

    split = None

    def linear(self, x, w):
        return linear(x, w, self.split)

    def weight_grads(self, weights, x, gather, grads) -> list:
        """Sequence parallel, gathered again: in a zb-h1 step the gather and each dW wait for W."""
        if self.split is None:
            return super().weight_grads(weights, x, gather, grads)
        self.split.stash.append((weights, x, gather, grads))
        return [None] * len(weights)


class SplitRowParallelLinear(tpl.RowParallelLinear):
    """A row-parallel linear whose weight gradient waits for W in a zb-h1 step (`split` set)."""

    split = None

    def linear(self, x, w):
        return linear(x, w, self.split)


SPLIT = (SplitColumnParallelLinear, SplitRowParallelLinear)


def apply(model) -> None:
    """Every tensor-parallel linear of `model` becomes its split kind: the same module and parameters,
    whose backward defers dW while a SplitBackward is entered."""
    for m in model.modules():
        if type(m) is tpl.ColumnParallelLinear:
            m.__class__ = SplitColumnParallelLinear
        elif type(m) is tpl.RowParallelLinear:
            m.__class__ = SplitRowParallelLinear
