"""The rotary embedding with its backward written by hand: model.apply_rotary's bits, fewer passes.

model.apply_rotary is the lesson: x * cos + rotate_half(x) * sin, where
rotate_half(x) = [-x2, x1] for the halves x1, x2 of each head's D. Run
eagerly, autograd records each of its ops: a neg and a cat build the
rotated copy (a whole (B, H, T, D) tensor written only to be multiplied),
and the backward runs each op's backward, then adds the two paths'
gradients. `Rotary` computes the same products and the same sums, in the
same order, so its output and its gradient are apply_rotary's bit for bit
(tests/tools/test_fused.py), but without the rotated copy:

    forward   y1 = x1 c1 - x2 s1        y2 = x2 c2 + x1 s2
    backward  dx1 = g1 c1 + g2 s2       dx2 = g2 c2 - g1 s1

(c1, c2 and s1, s2 the halves of cos and sin; a - b is a + (-b) in IEEE
arithmetic, so the sign moved from the product to the sum changes no bit).
It keeps for backward what apply_rotary keeps: cos and sin, no activation
(so the memory plan does not change). On the default preset (8 x 256
tokens, 4 heads of 64) one call's forward and backward take about 1.5 ms
against 2.8 ms, one thread, and the step with apply_rotary 1.9% longer
(median of 40 paired steps); at the moe preset's 8 x 32 tokens of 8
dimensions the two are level (0.6% apart, inside the rounds' spread):
there the time is per op, not per byte.

What a graph compiler does to the lesson's ops (torch.compile's Inductor,
XLA) it does to this by itself: `apply` gives it to an eager run only, on
the CPU or a GPU; build.py calls it.
"""

from __future__ import annotations

import torch


class Rotary(torch.autograd.Function):
    """apply_rotary(x, cos, sin) with a hand-written backward (module docstring).
    x: (..., T, D); cos, sin: (T, D) or (B, 1, T, D), in x's dtype."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        h = x.shape[-1] // 2
        y = x * cos
        y[..., :h].sub_(x[..., h:] * sin[..., :h])          # y1 = x1 c1 - x2 s1
        y[..., h:].add_(x[..., :h] * sin[..., h:])          # y2 = x2 c2 + x1 s2
        return y

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        dx = g * cos
        dx[..., :h].add_(g[..., h:] * sin[..., h:])         # dx1 = g1 c1 + g2 s2
        dx[..., h:].sub_(g[..., :h] * sin[..., :h])         # dx2 = g2 c2 - g1 s1
        return dx, None, None


def rotate(x, cos, sin):
    """model.apply_rotary's interface (its tables cast to x's dtype as it casts them)."""
    return Rotary.apply(x, cos.to(x.dtype), sin.to(x.dtype))


def apply(model) -> None:
    """Every attention layer of the stage rotates q and k by `rotate` (model.Attention.rotate)."""
    for block in model.layers.values():
        block.attn.rotate = rotate
