"""Chapter 8, resharding a checkpoint (8a): ShardSet.full rebuilds a full tensor from saved tp parts.

From shards written here by hand as a tp run saves them: a tensor split along
dimension 0 or 1, two parts held by four ranks (a shared kv head), and a
replicated one, in the model and the optimizer sections, exactly; and a
missing shard noticed (an error), never read as zeros.
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import case, compare


def _saved_parts(full: torch.Tensor, tp_dim: int, parts: int, tp: int, optim: bool = False) -> list[dict]:
    """The shards a tp-`tp` run saves of `full`, cut into `parts` along tp_dim (-1:
    replicated); ranks sharing a part (parts < tp) save it once, the first of them."""
    shards = []
    for rank in range(tp):
        copies = tp // parts
        part = rank // copies
        piece = full.chunk(parts, dim=tp_dim)[part] if tp_dim >= 0 else full
        meta = {"w": {"full_shape": list(full.shape), "tp_dim": tp_dim, "parts": parts, "part": part}}
        entry = {}
        if rank % copies == 0:
            n = piece.numel()
            entry = {"w": {"start": 0, "stop": n, "master": piece.reshape(-1).clone(),
                           "exp_avg": piece.reshape(-1) * 2, "exp_avg_sq": piece.reshape(-1) ** 2}} if optim \
                else {"w": piece.clone()}
        shards.append({"tp": tp, "tp_rank": rank, "meta": meta, "model": {} if optim else entry,
                       "optim": entry if optim else {}})
    return shards


def check_reshard() -> str | None:
    from types import SimpleNamespace
    from nanohlat.run.checkpoint import ShardSet
    from nanohlat.config import UserError
    g = torch.Generator().manual_seed(81)
    full = torch.randn(8, 12, generator=g)
    cases = [(0, 2, 2, "split along dim 0 over tp 2 (a column-parallel weight)"),
             (1, 4, 4, "split along dim 1 over tp 4 (a row-parallel weight)"),
             (0, 2, 4, "2 parts held by tp 4, each by 2 ranks (a replicated kv head)"),
             (-1, 1, 2, "replicated over tp 2 (a norm gain)")]
    for tp_dim, parts, tp, what in cases:
        for section in ("model", "optim"):
            case(f"a tensor {what}, section {section!r}")
            shards = _saved_parts(full, tp_dim, parts, tp, optim=section == "optim")
            fake = SimpleNamespace(path="(in memory)", shards={f"shard_{r}.pt": sh for r, sh in enumerate(shards)})
            got = ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
            v = compare(f"a tensor {what}, section {section!r}: ShardSet.full('w', {section!r})", got, full,
                        rtol=0, atol=0)
            if v:
                return v
            if parts > 1:   # a missing shard must be noticed, not silently read as zeros
                fake.shards = {k: sh for k, sh in fake.shards.items() if k != "shard_0.pt"}
                try:
                    ShardSet.full(fake, "w", section, "master" if section == "optim" else None)
                except UserError:
                    continue
                return (f"a tensor {what}, section {section!r}, rank 0's shard missing: ShardSet.full returned a "
                        f"tensor: mark the elements each part covers (cov), so that a gap raises")
    return None
