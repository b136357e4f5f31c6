"""Tensor parallelism (Megatron-LM) and sequence parallelism (Megatron SP).

Papers: Shoeybi et al. 2019, "Megatron-LM" (arXiv 1909.08053); Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198), the sequence-parallel variant HLAT trained with.

What is split. A linear layer y = x W^T with W of shape (out, in):

    column-parallel: W split by rows (outputs)     row-parallel: W split by columns (inputs)
        W = [W_0; W_1]   y_r = x W_r^T                  W = [W_0 | W_1]   y = sum_r x_r W_r^T
        each rank: all of x, 1/tp of y                  each rank: 1/tp of x, a partial sum of y

An attention block is column (wq, wk, wv: each rank owns n_heads/tp heads)
followed by row (wo); an MLP is column (gate, up) followed by row (down).
Nothing moves between them: the heads / the ffn slice stay local.

What moves, per block, for activations of shape (B, T, C) in dtype of s bytes:

    without sequence parallel              with sequence parallel
    enter: identity  | bwd all-reduce      enter: all-gather T    | bwd reduce-scatter
    leave: all-reduce| bwd identity        leave: reduce-scatter T| bwd all-gather

Both move the same bytes (an all-reduce is a reduce-scatter + all-gather; SP's
--sp-regather adds one all-gather per enter in backward: below), but with
sequence parallel the norms and residual adds hold only T/tp of the sequence,
cutting their activation memory by tp. Those four
functions are the "conjugate" pairs below; each one's backward is the other's
forward.

The same four in Megatron-LM (megatron/core/tensor_parallel/mappings.py), to
search across codebases. Megatron's activations are (T, B, C), so its
sequence dimension is the first; ours is the second (SEQ_DIM):

    here         used by      Megatron-LM's code                           the papers' name
    _Copy        enter        copy_to_tensor_model_parallel_region         f (Megatron-LM)
    _Reduce      leave        reduce_from_tensor_model_parallel_region     g (Megatron-LM)
    _GatherSeq   enter, SP    gather_from_sequence_parallel_region         g (SP paper)
    _ScatterSeq  leave, SP    reduce_scatter_to_sequence_parallel_region   g-bar (SP paper)

Each parameter carries its slice as `p.shard` (shard_spec.py).

More tp ranks than kv heads (tp > n_kv_heads, as HLAT-70B's tp 32 with 8 kv
heads) makes several ranks hold copies of one kv head, whose gradients the
optimizer adds up once per step (the section at the end of this file); with
tp <= n_kv_heads there are no copies, so skip it on a first reading.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .shard_spec import _param

SEQ_DIM = 1  # activations are (B, T, C) everywhere


# ---------------------------------------------------------------------------
# The region boundaries: four conjugate functions; enter / leave pick a pair (tables above)
# ---------------------------------------------------------------------------

class _Copy(torch.autograd.Function):
    """Enter a tp region: forward identity, backward all-reduce (the
    Megatron-LM paper's f; in its code `copy_to_tensor_model_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise 4a: begin
        ctx.group = group
        return x
        # exercise 4a: end

    @staticmethod
    def backward(ctx, g):
        # exercise 4a: begin
        return comm.all_reduce(g, ctx.group), None
        # exercise 4a: end


class _Reduce(torch.autograd.Function):
    """Leave a tp region: forward all-reduce, backward identity (the
    Megatron-LM paper's g; in its code `reduce_from_tensor_model_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise 4a: begin
        return comm.all_reduce(x, group)
        # exercise 4a: end

    @staticmethod
    def backward(ctx, g):
        # exercise 4a: begin
        return g, None
        # exercise 4a: end


class _GatherSeq(torch.autograd.Function):
    """Enter with sequence parallel: forward all-gather along T, backward
    reduce-scatter (the SP paper's g; in Megatron-LM's code
    `gather_from_sequence_parallel_region`, whose backward reduce-scatters by default)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise 4a: begin
        ctx.group = group
        return comm.all_gather(x, group, dim=SEQ_DIM)
        # exercise 4a: end

    @staticmethod
    def backward(ctx, g):
        # exercise 4a: begin
        return comm.reduce_scatter(g, ctx.group, dim=SEQ_DIM), None
        # exercise 4a: end


class _ScatterSeq(torch.autograd.Function):
    """Leave with sequence parallel: forward reduce-scatter along T, backward
    all-gather (the SP paper's g-bar; in Megatron-LM's code
    `reduce_scatter_to_sequence_parallel_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        # exercise 4a: begin
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=SEQ_DIM)
        # exercise 4a: end

    @staticmethod
    def backward(ctx, g):
        # exercise 4a: begin
        return comm.all_gather(g, ctx.group, dim=SEQ_DIM), None
        # exercise 4a: end


def enter(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Before column-parallel layers: (B, T/tp, C) or (B, T, C) -> (B, T, C) on every rank (table above)."""
    if group.size == 1:
        return x
    return _GatherSeq.apply(x, group) if sequence_parallel else _Copy.apply(x, group)


def leave(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """After a row-parallel layer: partial sums (B, T, C) -> (B, T/tp, C) or (B, T, C) (table above)."""
    if group.size == 1:
        return x
    return _ScatterSeq.apply(x, group) if sequence_parallel else _Reduce.apply(x, group)


def reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """A differentiable sum over tp ranks whose backward is identity (used by the loss)."""
    return x if group.size == 1 else _Reduce.apply(x, group)


def enter_linears(x: torch.Tensor, group, sequence_parallel: bool, linears, regather: bool = True) -> tuple:
    """`enter`, then each column-parallel linear of `linears` on the full sequence
    (wq, wk, wv; gate, up; the head): their outputs, (B, T, out/tp) each. With
    sequence parallel and `regather` (--sp-regather, the default) both steps are
    one function, `_GatherLinears` (the section below): the same bits, less kept."""
    if sequence_parallel and regather and group.size > 1:
        return _GatherLinears.apply(x, group, linears[0], *(lin.weight for lin in linears))
    x = enter(x, group, sequence_parallel)
    return tuple(lin(x) for lin in linears)


# ---------------------------------------------------------------------------
# Sequence parallel, gathering again in backward. F.linear keeps its input for the
# weight gradient (dW = g^T x), so after `enter` each matmul group keeps the
# all-gathered (B, T, C): tp times the T/tp tokens the rank holds, the largest
# activation of a sequence-parallel block (hlat-70b's plan, one micro-batch: 2 x 67 MB
# of a layer's 182 MB; 52 MB keeping the shards). Megatron-LM keeps the T/tp shard
# instead and gathers it once more in backward (LinearWithGradAccumulationAndAsyncCommunication
# with sequence_parallel=True): one more all-gather per matmul group per micro-batch,
# for tp times less kept.
# ---------------------------------------------------------------------------

def weight_grads_of(x: torch.Tensor, grads) -> list[torch.Tensor]:
    """dW = g^T x for each linear fed x, as F.linear's backward: an mm of the (B*T, .) tensors."""
    x2 = x.reshape(-1, x.shape[-1])                          # (B*T, in)
    return [g.reshape(-1, g.shape[-1]).t().mm(x2) for g in grads]


class _GatherLinears(torch.autograd.Function):
    """y_i = all_gather_T(x) W_i^T for each weight W_i, keeping x (B, T/tp, C), not
    the gathered (B, T, C). Backward gathers x again for dW_i = g_i^T x (the first linear's
    `weight_grads`), sums dx = sum_i g_i W_i, and reduce-scatters dx along T as `_GatherSeq` does.

    The backward does exactly F.linear's backward ops (an mm of the flattened (B*T, .)
    tensors each way), and adds the dx terms last linear first, the order autograd's
    engine adds them when `enter` and the linears are separate nodes: so losses and
    gradients are bitwise those of --no-sp-regather (tests/core/test_tensor_parallel.py)."""

    @staticmethod
    def forward(ctx, x, group, first, *weights):
        ctx.group, ctx.first = group, first                  # first: the first of the linears
        ctx.save_for_backward(x, *weights)                   # the shard, not the gathered sequence
        full = comm.all_gather(x, group, dim=SEQ_DIM)        # (B, T, C), freed when forward returns
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        gather = functools.partial(comm.all_gather, group=ctx.group, dim=SEQ_DIM)   # x -> forward's (B, T, C)
        dws = ctx.first.weight_grads(weights, x, gather, grads)
        dx = None
        for g, w in zip(reversed(grads), reversed(weights)):
            d = g.reshape(-1, g.shape[-1]).mm(w).view(*g.shape[:-1], -1)   # this linear's part of dx = g W
            dx = d if dx is None else dx + d
        return (comm.reduce_scatter(dx, ctx.group, dim=SEQ_DIM), None, None, *dws)


# ---------------------------------------------------------------------------
# The parallel layers and the vocab-parallel loss
# ---------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T with W split by output rows. Input: the full x, already
    inside the tp region (call `enter` once before a group of these, e.g. once
    for wq, wk and wv). Output: this rank's 1/tp of the features.

    `replicas`: the kv group when tp exceeds the kv heads (the section at the end
    of this file): W is cut into tp / replicas.size parts, one per kv group."""

    # x W^T; a subclass may compute the same product its own way (a seam: docs/design.md 1)
    linear = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, group, replicas=None):
        super().__init__()
        r = replicas.size if replicas is not None else 1
        self.weight = _param((out_features, in_features), 0, group.size // r, group.rank // r)

    def forward(self, x):
        # exercise 4b: begin
        return self.linear(x, self.weight)                   # (B, T, out/tp), or out*replicas/tp (kv)
        # exercise 4b: end

    def weight_grads(self, weights, x, gather, grads) -> list:
        """`_GatherLinears`' weight gradients for the linears it ran, this one first: dW_i = g_i^T x with x
        all-gathered again (`gather`), now, each an mm of the flattened tensors as F.linear's backward."""
        return weight_grads_of(gather(x), grads)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T with W split by input columns, then `leave`: the
    all-reduce (or, with sequence parallel, reduce-scatter along T) that adds
    the ranks' partial sums."""

    def __init__(self, in_features: int, out_features: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _param((out_features, in_features), 1, group.size, group.rank)

    linear = staticmethod(F.linear)   # x W^T (as ColumnParallelLinear's)

    def forward(self, x):  # x: (B, T, in/tp)
        # exercise 4b: begin
        return leave(self.linear(x, self.weight), self.group, self.sequence_parallel)
        # exercise 4b: end


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over tp: rank r holds tokens [r*V/tp, (r+1)*V/tp).

    Each rank looks up the tokens it owns and writes zeros for the rest; the
    leave all-reduce (or reduce-scatter along T with sequence parallel) adds the
    ranks' rows so every token gets exactly its one embedding.
    """

    def __init__(self, padded_vocab: int, dim: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _param((padded_vocab, dim), 0, group.size, group.rank)
        self.per_rank = padded_vocab // group.size
        self.start = group.rank * self.per_rank

    def forward(self, tokens):  # (B, T) int64
        local = tokens - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)        # (B, T, C), zeros where not mine
        return leave(out, self.group, self.sequence_parallel)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy from vocab-sharded logits, never gathering them.

    logits: (B, T, V/tp) this rank's slice of the vocabulary; targets: (B, T).
    Returns (B, T) losses, identical on every tp rank, moving three (B, T)
    tensors between the ranks instead of the (B, T, V) logits (tutorial chapter 4
    derives which three). Padded vocabulary entries (ids >= vocab_size,
    docs/design.md 5.3) never take probability mass. Backward needs no custom
    code: each rank differentiates its own slice.
    """
    logits = logits.float()
    if group.size == 1:
        # One rank holds the whole vocabulary: the same loss is PyTorch's fused
        # log-softmax + nll, fewer passes over the (B, T, V) logits than the
        # steps below. Dropping the padded columns is the -inf mask: they get no
        # probability and no gradient.
        logits = logits[..., :vocab_size]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    # exercise 4c: begin
    #   m   = max over all ranks of the local maxima     (all-gather of (B, T))
    #   S   = sum_r sum_v exp(logit - m)                  (all-reduce of (B, T))
    #   z_t = the target's logit, from the rank owning it (all-reduce of (B, T))
    #   loss = log S + m - z_t; the padded entries at -inf; the all-reduces' backward is identity,
    #   so each rank's gradient is its slice's softmax - onehot
    per_rank = logits.shape[-1]
    start = group.rank * per_rank
    ids = torch.arange(start, start + per_rank, device=logits.device)
    logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    # the max only keeps exp() in range; any constant works, so no gradient
    local_max = logits.detach().amax(dim=-1)                              # (B, T)
    m = comm.all_gather(local_max.unsqueeze(0), group, dim=0).amax(dim=0)
    sum_exp = reduce_sum(torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1), group)   # (B, T)
    local_t = targets - start
    mine = (local_t >= 0) & (local_t < per_rank)
    picked = logits.gather(-1, torch.where(mine, local_t, 0).unsqueeze(-1)).squeeze(-1)
    z_t = reduce_sum(torch.where(mine, picked, torch.zeros_like(picked)), group)
    return torch.log(sum_exp) + m - z_t
    # exercise 4c: end


# ---------------------------------------------------------------------------
# Kv-head replication: only when tp > n_kv_heads (module docstring; else nothing here
# acts). A rank's query heads then all use one kv head, so the rank holds a copy of
# that kv head's rows of wk and wv: ranks 4k..4k+3 hold kv head k, a "kv group" of 4
# replicas (mesh.py's kv section; ColumnParallelLinear's `replicas`, ShardSpec's
# parts < tp). Each replica's gradient covers only its own query heads; the kv head's
# gradient is their sum, which no code in this file adds: each replica accumulates its
# micro-batches in its own fp32 flat buffer (wk and wv of every layer: one flat group),
# and once per step, before the dp reduction (or after it, on the shard, where dp was summed in the backward),
# optim.py:FlatAdamW.reduce_gradients all-reduces it over the kv group, as the
# sequence-parallel norm gains' over tp. The replicas then take the same step and stay
# bitwise equal. Cost per step: one all-reduce of 2 x layers x (head_dim, d_model) fp32
# elements, however many micro-batches the step has.
# ---------------------------------------------------------------------------
