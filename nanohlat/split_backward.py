"""ZB-H1's split backward (pipeline.py): the input gradients in B, the weights' in W.

A linear's backward computes dx = g W, which the layer before waits for, and dW = g^T x,
which nothing needs before the step. B computes dx, stashing (W, x, g); W computes each dW
with autograd's mm (the same bits) and hands it to autograd, whose AccumulateGrad runs the
hooks (optim.py) as an unsplit backward does (in B they run with no gradient and add nothing).
The norm gains and the embedding keep theirs in B. The linears that defer are tensor_parallel.py's,
and only inside a `with` of the SplitBackward that the pipeline runner running the ticks owns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weight_grads_of(x: torch.Tensor, grads) -> list[torch.Tensor]:
    """dW = g^T x for each linear fed x, as F.linear's backward: an mm of the (B*T, .) tensors."""
    x2 = x.reshape(-1, x.shape[-1])                          # (B*T, in)
    return [g.reshape(-1, g.shape[-1]).t().mm(x2) for g in grads]


class SplitBackward:
    """What the Bs of a zb-h1 step leave for their Ws (`stash`). Inside `with` the model's linears hold it
    (`split_backward`) and defer to it; after the block, however it ends, None again (whole), stash empty."""

    def __init__(self, model=None):
        self.layers = [m for m in model.modules() if hasattr(m, "split_backward")] if model is not None else []
        self.stash = []   # (weights, x, gather, grads) of each linear: dW = g^T x, gather(x) first unless None

    def __enter__(self) -> SplitBackward:
        for m in self.layers:
            m.split_backward = self
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.split_backward = None
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
            dws += weight_grads_of(x if gather is None else gather(x), grads)
    torch.autograd.backward(weights, dws)      # AccumulateGrad and its hooks, once per parameter
