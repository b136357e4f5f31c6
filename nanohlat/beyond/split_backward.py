"""ZB-H1's split backward (schedules.py): the input gradients in B, the weights' in W.

A linear's backward computes dx = g W, which the layer before waits for, and dW = g^T x,
which nothing needs before the step. B computes dx, stashing (W, x, g); W computes each dW
with autograd's mm (the same bits) and hands it to autograd, whose AccumulateGrad runs the
hooks (optim.py) as an unsplit backward does (in B they run with no gradient and add nothing).
The norm gains and the embedding keep theirs in B. `apply` gives the model split linears in place
of its tensor-parallel ones (subclasses of tensor_parallel.py's around the same parameters: a
block's linears are ordinary attributes, model.py), which defer only inside a `with` of the
SplitBackward that the pipeline runner running the ticks owns.
"""

from __future__ import annotations

import torch
import torch.nn as nn
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
    torch.autograd.backward(weights, dws)      # AccumulateGrad, into a hook or a view, once per parameter


class SplitColumnParallelLinear(tpl.ColumnParallelLinear):
    """A column-parallel linear whose weight gradients wait for W in a zb-h1 step (`split` set)."""

    def __init__(self, m: tpl.ColumnParallelLinear):
        nn.Module.__init__(self)   # (not the parent's, which would make a new weight: m's is kept)
        self.weight, self.split = m.weight, None

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

    def __init__(self, m: tpl.RowParallelLinear):
        nn.Module.__init__(self)   # (as SplitColumnParallelLinear's)
        self.weight, self.split = m.weight, None
        self.group, self.sequence_parallel = m.group, m.sequence_parallel

    def linear(self, x, w):
        return linear(x, w, self.split)


SPLIT = (SplitColumnParallelLinear, SplitRowParallelLinear)


def apply(model) -> None:
    """Every tensor-parallel linear of `model` gives way to its split kind around the same parameter (in
    its place among its parent's modules, so the parameters keep their names and order), whose backward
    defers dW while a SplitBackward is entered."""
    kinds = {tpl.ColumnParallelLinear: SplitColumnParallelLinear, tpl.RowParallelLinear: SplitRowParallelLinear}
    for parent in list(model.modules()):
        for name, m in list(parent.named_children()):
            if type(m) in kinds:
                setattr(parent, name, kinds[type(m)](m))
