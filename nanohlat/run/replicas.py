"""--check-replicas N: every N steps, prove that replicas are still identical.

Many ranks hold copies of the same parameter: every dp rank holds all of its
stage's weights (with ZeRO-1 too, after the all-gather), every tp rank holds
the RMSNorm gains, tp ranks that share a kv head (tp > n_kv_heads) hold
that head, and under --ep the dp ranks of one ep_dp group hold the same
experts (compared over that group: the ep ranks of a dp group hold others). Nothing in training ever compares them: each rank applies its own
update to its own copy, and the tests prove the update is the same everywhere.
If it were not (a rank-dependent random number, a missing all-reduce, a
flaky device), the copies would drift apart silently and the checkpoint,
which saves one copy, would hide it. After Megatron-LM's
--check-weight-hash-across-dp-replicas-interval, this check makes the
invariant visible in a real run: each rank hashes every parameter bit by
bit, the groups that should agree all-gather the hashes and compare them,
and a mismatch stops the run (exit code 2) naming the parameter, the ranks
and the step.

With --zero 3 no rank keeps whole parameters between steps: the check
all-gathers them first, as a forward would (the whole model at once, for a
moment), and compares what the ranks assembled. Across dp that proves every
rank rebuilds the same weights from the shards; across tp it compares the
replicated norm gains and kv heads, each tp rank's own shards of them.

Cost: one small all-gather per group (8 bytes per parameter tensor) and a
host sync, on checking steps only; other steps do not even build the hashes
(no extra work or sync in the XLA step graph). The check's bytes are kept out
of the comm ledger, which reports what training itself sends.
"""

from __future__ import annotations

import dataclasses

import torch

from nanohlat import comm
from nanohlat.config import UserError
from nanohlat.run.build import whole_params

_INT = {4: torch.int32, 2: torch.int16}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """A bitwise hash of a tensor, as an int64 scalar: sum of (bits x (2i + 1)),
    wrapping modulo 2^64. Equal tensors give equal sums; a change in any one
    element changes the sum (an odd factor times a nonzero difference of at
    most 32 bits is never 0 modulo 2^64)."""
    bits = t.detach().contiguous().view(_INT[t.element_size()]).reshape(-1).long()
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) * 2 + 1
    return (bits * weights).sum()


def holders(p: torch.Tensor, kind: str, size: int) -> list[list[int]]:
    """The sets of ranks (indices within a `kind` group of `size`) that hold copies of p.
    A mixture's experts under --ep (p.shard.group "ep"): the dp ranks holding the same
    ones are an ep_dp group, not dp (the ep ranks of a dp group hold different experts)."""
    experts = p.shard.group == "ep"
    if kind in ("dp", "ep_dp"):
        return [list(range(size))] if experts == (kind == "ep_dp") else []
    # tp: ranks r with the same chunk r * chunks // tp hold the same slice (chunks 1: replicated;
    # experts: cut over ep, replicated over tp)
    chunks = 1 if experts else p.shard.parts
    sets: dict = {}
    for r in range(size):
        sets.setdefault(r * chunks // size, []).append(r)
    return [s for s in sets.values() if len(s) > 1]


def check(model, mesh, step: int, every: int, opt=None) -> None:
    """After step `step`: every `every` steps (0 = never), compare the replicas (module docstring).
    `opt`: the optimizer, whose parameters ZeRO-3 (--zero 3) gathers for the check."""
    if not every or step % every:
        return
    quiet = lambda g: dataclasses.replace(g, ledger=None)    # noqa: E731  (not training's traffic)
    with whole_params(opt, quiet=True):   # (ZeRO-3: each unit over its ranks: dp, dp x cp, or the experts' ep_dp)
        _check(model, mesh, step, quiet)


def _check(model, mesh, step: int, quiet) -> None:
    params = list(model.named_parameters())
    sums = torch.stack([checksum(p) for _, p in params])
    problems = []
    for kind, group in (("dp", mesh.grad_group), ("ep_dp", mesh.group("ep_dp")),   # (--cp: its ranks are replicas too)
                        ("tp", mesh.tp_group)):
        if group.size == 1:
            continue
        gathered = comm.all_gather(sums, quiet(group)).view(group.size, -1).cpu()
        for i, (name, p) in enumerate(params):
            for ranks in holders(p, kind, group.size):
                if len(set(gathered[ranks, i].tolist())) > 1:
                    problems.append((name, [group.ranks[r] for r in ranks], "dp x cp" if group.name == "dp_cp" else kind))
    # every rank stops together: one that saw nothing would wait forever in its next collective
    bad = torch.tensor([float(len(problems))], device=sums.device)
    for g in (mesh.grad_group, mesh.tp_group, mesh.pp_group):
        bad = comm.all_reduce(bad, quiet(g))
    if bad.item() == 0:
        return
    if problems:
        name, ranks, kind = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"--check-replicas: after step {step}, parameter {name} differs between its {kind} "
                        f"replicas on ranks {ranks}{more}; replicas must be bitwise identical, so this is a bug "
                        f"or a faulty device: resume from an earlier checkpoint on other hardware or report it")
    raise UserError(f"--check-replicas: after step {step}, replicas differ on other ranks (their error names "
                    f"the parameter)")
