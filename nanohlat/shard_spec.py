"""`ShardSpec`, how a parameter is split over the tp ranks (`p.shard`); cutting a full tensor to it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tp ranks, attached to it as `p.shard`
    (by `_param`). The one contract between the parallel layers that create
    parameters and everything else that must know their layout:

        full_shape         the unsharded shape: what init draws, what a checkpoint stores
        dim                the dimension cut over tp ranks; None: replicated, every rank
                           holds the whole tensor
        parts              the full tensor is cut into `parts` equal contiguous chunks
                           along `dim` (1 when replicated) ...
        part               ... and this rank holds chunk `part` (0 when replicated);
                           `local_part` cuts it out of a full tensor
        sequence_parallel  a replicated weight used inside a sequence-parallel region
                           (the norms' gains): each rank sees only its T/tp tokens, so
                           its gradient is a partial sum to be all-reduced over tp
        group              "tp"; or the name of another group of the mesh over which
                           the parameter is cut instead (part = the rank in it),
                           replicated over tp: its gradient is summed over the
                           ranks holding the same part, '<group>_dp' (optim.py;
                           a mixture's experts over expert parallelism's ranks:
                           a seam, docs/design.md 1)

    Usually parts = tp and part = the tp rank. The one exception is kv-head replication
    (only when tp > n_kv_heads; the last section of tensor_parallel.py): wk and wv are cut
    into n_kv_heads parts, fewer than tp, and each part is held by copies = tp // parts
    neighbouring ranks (part = tp_rank // copies). So `tp // parts` is how many tp ranks
    hold each element: 1 for a split weight, tp for a replicated one.

    Who reads it: whatever a search for `.shard` in nanohlat/ finds (this attribute).
    """

    full_shape: tuple
    dim: int | None = None
    parts: int = 1
    part: int = 0
    sequence_parallel: bool = False
    group: str = "tp"


def shard(full: torch.Tensor, dim, part: int, parts: int) -> torch.Tensor:
    """Chunk `part` of `parts` contiguous chunks of a full tensor along `dim` (None: the
    whole tensor). A tp rank's slice is chunk tp_rank of tp, or, for replicated kv
    heads, chunk p.shard.part of p.shard.parts (`local_part`)."""
    if dim is None or parts == 1:
        return full
    return full.chunk(parts, dim=dim)[part]


def local_part(full: torch.Tensor, p) -> torch.Tensor:
    """The part of a full tensor that parameter `p` holds on this rank (`p.shard`)."""
    return shard(full, p.shard.dim, p.shard.part, p.shard.parts)


def _param(full_shape, dim, parts: int, part: int = 0, sequence_parallel: bool = False,
           group: str = "tp") -> nn.Parameter:
    """A parameter holding part `part` of `parts` equal parts of a full tensor
    cut along `dim` (dim None: the whole tensor, one part), its `ShardSpec`
    attached as `p.shard`."""
    shape = list(full_shape)
    if dim is not None:
        shape[dim] //= parts
    p = nn.Parameter(torch.empty(shape))
    parts, part = (parts, part) if dim is not None else (1, 0)
    p.shard = ShardSpec(tuple(full_shape), dim, parts, part, sequence_parallel, group)
    return p
