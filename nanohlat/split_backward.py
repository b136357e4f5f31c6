"""ZB-H1's split backward (pipeline.py): the input gradients in B, the weights' in W.

A linear's backward computes dx = g W, which the layer before waits for, and
dW = g^T x, which nothing needs before the step. B computes dx, stashing (W, x, g);
W computes each dW with autograd's mm (the same bits) and hands it to autograd,
whose AccumulateGrad runs the hooks (optim.py) as an unsplit backward does (in B
they run with no gradient and add nothing). The norm gains and the embedding keep
their gradients in B. The linears that defer are tensor_parallel.py's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def weight_grads_of(x: torch.Tensor, grads) -> list[torch.Tensor]:
    """dW = g^T x for each linear fed x, as F.linear's backward: an mm of the (B*T, .) tensors."""
    x2 = x.reshape(-1, x.shape[-1])                          # (B*T, in)
    return [g.reshape(-1, g.shape[-1]).t().mm(x2) for g in grads]


WEIGHT_GRADS = types.SimpleNamespace(split=False, stash=[])  # pipeline.py sets split; stash: (weights, x, gather, grads)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T: F.linear, or in a zb-h1 step the same product with its dW left for W."""
    return _SplitLinear.apply(x, w) if WEIGHT_GRADS.split and torch.is_grad_enabled() else F.linear(x, w)


class _SplitLinear(torch.autograd.Function):
    """F.linear whose backward returns only dx (F.linear's mm)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        WEIGHT_GRADS.stash.append(((w,), x, None, (g,)))
        return g.reshape(-1, g.shape[-1]).mm(w).view_as(x), None


def weight_grads(stash: list) -> None:
    """The W op: each dW = g^T x one B stashed, accumulated as a backward would."""
    weights, dws = [], []
    with torch.no_grad():                      # (as in a backward: nothing here is differentiated)
        for ws, x, gather, grads in stash:     # _GatherLinears kept the T/tp shard: `gather` gathers it
            weights += ws
            dws += weight_grads_of(x if gather is None else gather(x), grads)
    torch.autograd.backward(weights, dws)      # AccumulateGrad and its hooks, once per parameter
