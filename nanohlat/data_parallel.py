"""Data parallelism: same weights on every dp rank, different slices of the batch.

Each dp rank runs forward/backward on batch_size/dp sequences (split further
into micro-batches, whose gradients simply accumulate in `p.grad`). The loss
of every micro-batch is divided by the token count of the *global* batch, so
summing the ranks' gradients gives exactly the gradient of the global mean
loss: one process and dp processes compute the same number (up to the order
of the additions, i.e. fp32 round-off).

The gradients are flattened into one fp32 buffer and summed over the dp group
once per step, after accumulation, in buckets of --bucket-mb. (A framework
overlaps each bucket's all-reduce with the rest of the backward pass; here
they run back to back so the communication stays easy to read and count.)

Bytes per step: one all-reduce of 4 * (parameters on this rank) bytes.
"""

from __future__ import annotations

import torch

from . import comm


def bucket_ranges(n: int, bucket_elems: int):
    """[0, n) cut into consecutive ranges of at most bucket_elems."""
    bucket_elems = max(1, bucket_elems)
    return [(a, min(a + bucket_elems, n)) for a in range(0, n, bucket_elems)]


def all_reduce_buckets(flat: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """Sum a flat gradient buffer over the dp group, in place, bucket by bucket."""
    if group.size == 1:
        return flat
    for a, b in bucket_ranges(flat.numel(), bucket_elems):
        flat[a:b] = comm.all_reduce(flat[a:b].contiguous(), group, inplace=True)
    return flat


def reduce_scatter_buckets(flat: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """ZeRO-1's gradient step: sum over dp and keep only this rank's shard.

    The padded buffer is viewed as (dp, S): row r is rank r's shard. Buckets
    cut the S columns, so each rank still owns one contiguous slice of the
    flat buffer (what checkpoints and the parameter all-gather rely on).
    """
    if group.size == 1:
        return flat
    rows = flat.view(group.size, -1)                       # (dp, S)
    shard = torch.empty(rows.shape[1], dtype=flat.dtype, device=flat.device)
    for a, b in bucket_ranges(rows.shape[1], bucket_elems // group.size):
        piece = rows[:, a:b].contiguous().view(-1)         # (dp * (b-a),)
        shard[a:b] = comm.reduce_scatter(piece, group)
    return shard


def all_gather_buckets(shard: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """ZeRO-1's parameter step: every rank's updated shard -> the full flat buffer."""
    if group.size == 1:
        return shard
    full = torch.empty(group.size, shard.numel(), dtype=shard.dtype, device=shard.device)
    for a, b in bucket_ranges(shard.numel(), bucket_elems // group.size):
        full[:, a:b] = comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a)
    return full.view(-1)
