"""A mixture's experts in FP8 (--fp8 with --moe-experts): each expert's three projections as fp8.py's linears.

An expert is three linears (gate, up: F x C; down: C x F) on the rows routed to it. What one FP8
tensor is, for an expert, follows from what one process computes: in one micro-batch, expert e's rows
are one activation (its slice of the dispatch, moe.dispatch_sorted), its weights three matrices of its
own. So an expert's operands are cast per expert, and its rows per micro-batch: under expert
parallelism (--ep) an expert's slice holds the rows of several ranks' micro-batches, one after the
other (moe.dispatch_expert_parallel's `parts`), and each is a tensor of its own, its blocks along the
tokens beginning anew (fp8_scaling.Axis.segments), exactly as in one process that ran those
micro-batches one by one. Nothing of it crosses a rank: an expert and the rows it computes are on
one rank. Only where each rank routes a share of a micro-batch's tokens (sequence parallelism,
--cp) is an expert's rows of one micro-batch cut over ranks: a tensor-wise scale (tensorwise, and
rowwise along the tokens) then takes its amax over them (the router's sums do the same,
moe.route's seq_group); blockwise and mx, whose tiles run along the tokens in an order no rank can
know, refuse that layout (recipe/layouts.py:check_fp8_recipe). The shared experts are one slice of
every row. The router stays in fp32 (moe.route), the dispatch in the step's dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanohlat.beyond import moe
from nanohlat.beyond.fp8 import Fp8Run, Operands, _keep_fp32, _state, fp8_linear
from nanohlat.beyond.fp8_scaling import Axis

PROJECTIONS = ("gate", "up", "down")


class Fp8Experts(nn.Module):
    """MoE.slices in FP8 (moe.swiglu_slices' arguments): each expert's SwiGLU on its slice, each of its
    projections an FP8 linear. Its delayed-scaling state and statistics have a row per expert of the
    whole model (this rank's E/ep at `first`), then one for the shared experts, by projection, operand."""

    def __init__(self, block: moe.MoE, run: Fp8Run, name: str):
        super().__init__()
        self.run, self.name = run, name
        ep = block.ep_group.size if block.ep_group is not None else 1
        rank = block.ep_group.rank if block.ep_group is not None else 0
        self.n_experts, self.first = block.n_experts, rank * (block.n_experts // ep)
        groups = block.seq_group if isinstance(block.seq_group, tuple) else (block.seq_group,)
        self.seq_groups = tuple(g for g in groups if g is not None and g.size > 1)
        _state(self, run, (block.n_experts + 1, len(PROJECTIONS), 3))

    def forward(self, xs, counts: list, gate, up, down, parts=None, shared: bool = False):
        """(N, C): row i its expert's SwiGLU of xs[i] (moe.swiglu_slices'), each matmul in FP8. `parts`:
        each slice's rows by source rank (--ep); `shared`: the shared experts, one slice of every row."""
        gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)   # (views: moe.py says why)
        out = []
        for e, rows in enumerate(xs.split(counts)):
            slot = self.n_experts if shared else self.first + e
            tokens = Axis(counts[e], segments=[counts[e]] if parts is None else parts[e], groups=self.seq_groups)
            g = self.matmul(rows, gates[e], slot, 0, tokens)
            u = self.matmul(rows, ups[e], slot, 1, tokens)
            out.append(self.matmul(F.silu(g) * u, downs[e], slot, 2, tokens))
        return torch.cat(out)

    def matmul(self, x, w, slot: int, projection: int, tokens: Axis):
        """x w^T in FP8 for expert `slot`'s `projection` (fp8._Fp8Matmuls): w (out, in) is whole here."""
        ops = Operands(self.run, self, Axis(w.shape[0]), Axis(w.shape[1]), slot=(slot, projection))
        return fp8_linear(x, w, ops, tokens)

    def _apply(self, fn, recurse=True):
        return _keep_fp32(self, fn, recurse, super()._apply)


def apply(model, run: Fp8Run) -> None:
    """Every MoE block of `model` computes its experts (routed and shared) in FP8 (MoE.slices)."""
    for i, block in model.layers.items():
        if isinstance(block.mlp, moe.MoE):
            block.mlp.slices = Fp8Experts(block.mlp, run, f"layers.{i}.mlp.experts")
            run.layers.append(block.mlp.slices)
