"""ZeRO stage 1: shard the optimizer state over data-parallel ranks.

Paper: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (arXiv 1910.02054). HLAT-70B used it with FP32
master weights.

Without ZeRO every dp rank keeps, per parameter, an fp32 master copy and two
fp32 Adam moments (12 bytes) although all dp ranks hold identical copies.
ZeRO-1 partitions them: the parameters of one (pp, tp) coordinate are
flattened into one buffer, padded to a multiple of dp, and dp rank r owns the
r-th contiguous 1/dp of it:

    flat params  [ p0 | p1 | p2 ........................ | pad ]
                 [ rank 0's shard | rank 1's shard | ... | rank dp-1's ]

A step is then "partition, step the shard, all-gather":
    1. reduce-scatter the flat fp32 gradients over dp   (each rank: the summed grads of its shard)
    2. AdamW on the shard only                           (1/dp of the optimizer work and memory)
    3. all-gather the updated shards into the weights    (every rank: the full new weights)

Bytes per step: reduce-scatter of 4N plus all-gather of N * (parameter
bytes), for N parameters on the rank: the same as one all-reduce (which *is*
a reduce-scatter followed by an all-gather), so ZeRO-1 saves memory for free.

Everything ZeRO-1 does lives here: the shard arithmetic, the two bucketed
collectives and `ZeroOneDP`, which FlatAdamW (optim.py) calls where sharding
matters, as it calls its twin without sharding, `data_parallel.ReplicatedDP`.
"""

from __future__ import annotations

import torch

from . import comm
from .data_parallel import Reduction, ReplicatedDP, bucket_ranges, wait_all


def padded_size(numel: int, dp: int) -> int:
    """Flat buffer length: numel rounded up to a multiple of dp."""
    return (numel + dp - 1) // dp * dp


def shard_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of the flat buffer that dp rank `dp_rank` owns."""
    size = padded_size(numel, dp) // dp
    return dp_rank * size, (dp_rank + 1) * size


def reduce_scatter_buckets(flat: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """ZeRO-1's gradient step: sum over dp and keep only this rank's shard.

    The padded buffer is viewed as (dp, S): row r is rank r's shard. Buckets
    cut the S columns, bucket_elems // dp of them at a time (so one call still
    moves ~bucket_elems elements), and each rank still owns one contiguous
    slice of the flat buffer (what checkpoints and the parameter all-gather
    rely on).
    """
    if group.size == 1:
        return flat
    # exercise 3b: begin
    rows = flat.view(group.size, -1)                       # (dp, S)
    shard = torch.empty(rows.shape[1], dtype=flat.dtype, device=flat.device)
    for k, (a, b) in enumerate(bucket_ranges(rows.shape[1], bucket_elems // group.size)):
        piece = rows[:, a:b].contiguous().view(-1)         # (dp * (b-a),)
        shard[a:b] = comm.reduce_scatter(piece, group, what=(flat, k))   # (what: flat's bucket k)
    return shard
    # exercise 3b: end


def all_gather_buckets(shard: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """ZeRO-1's parameter step: every rank's updated shard -> the full flat buffer,
    in buckets of bucket_elems // dp elements of each shard (the inverse of
    reduce_scatter_buckets' columns)."""
    if group.size == 1:
        return shard
    # exercise 3c: begin
    full = torch.empty(group.size, shard.numel(), dtype=shard.dtype, device=shard.device)
    for a, b in bucket_ranges(shard.numel(), bucket_elems // group.size):
        full[:, a:b] = comm.all_gather(shard[a:b].contiguous(), group).view(group.size, b - a)
    return full.view(-1)
    # exercise 3c: end


class ZeroOneDP(ReplicatedDP):
    """The sharded update: this dp rank owns [start, stop) of every flat buffer.
    (ReplicatedDP's hooks and overlap; buckets are columns of the (dp, S) view.)"""

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(padded length, start, stop) of a flat buffer of `numel` elements."""
        return (padded_size(numel, self.group.size),
                *shard_range(numel, self.group.size, self.group.rank))

    def buckets(self, padded: int) -> list:
        """reduce_scatter_buckets' buckets as flat ranges: columns [a, b) of every row."""
        n, cols = self.group.size, padded // self.group.size
        return [[(r * cols + a, r * cols + b) for r in range(n)]
                for a, b in bucket_ranges(cols, self.bucket_elems // n)]

    def start(self, r: Reduction, k: int) -> tuple:
        """Overlap: reduce-scatter bucket k into its columns of this rank's shard (r.reduced)."""
        if not r.pending:
            r.reduced = r.grad.new_empty(r.grad.numel() // self.group.size)
        (a, b), n = r.watch.buckets[k][0], self.group.size
        piece = r.grad.view(n, -1)[:, a:b].contiguous().view(-1)   # as reduce_scatter_buckets cuts it
        return comm.start_reduce_scatter(piece, r.reduced[a:b], self.group, what=(r.grad, k)), piece

    def reduce_gradients(self, r: Reduction, flat: torch.Tensor) -> torch.Tensor:
        """Summed gradients of this rank's shard."""
        if r.watch is not None:
            wait_all(r)
            out, r.reduced = r.reduced, None             # (kept no longer than without overlap)
            return out
        return reduce_scatter_buckets(flat, self.group, self.bucket_elems)

    def sum_norm_squares(self, sq: torch.Tensor) -> torch.Tensor:
        """Each dp rank holds a different shard: the squares add up over dp."""
        return comm.all_reduce(sq, self.group, what="grad norm")

    def gather_parameters(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's updated shard -> the full flat buffer of new weights."""
        return all_gather_buckets(shard, self.group, self.bucket_elems)
