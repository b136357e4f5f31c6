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
"""

from __future__ import annotations


def padded_size(numel: int, dp: int) -> int:
    """Flat buffer length: numel rounded up to a multiple of dp."""
    return (numel + dp - 1) // dp * dp


def shard_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of the flat buffer that dp rank `dp_rank` owns."""
    size = padded_size(numel, dp) // dp
    return dp_rank * size, (dp_rank + 1) * size


def overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int] | None:
    """Intersection of [a0, a1) and [b0, b1), or None."""
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None
