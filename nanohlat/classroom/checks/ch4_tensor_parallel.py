"""Chapter 4, tensor and sequence parallelism, on 4 gloo ranks (TP_WORLD).

4a (the four conjugate functions), 4b (column- and row-parallel linears,
with and without sequence parallelism, and kv heads shared by ranks when
tp > n_kv_heads) and 4c (the vocab-parallel cross-entropy, on logits of about
+-8 and on large ones where exp() overflows without the max, with padding)
against plain dense PyTorch on one process: outputs, gradients, and each
forward's and backward's collectives (wire.py:comm_verdict); 4a's custom
autograd Functions and 4c leave their inputs (and 4a its incoming gradients)
as they were, unless a forward says so with ctx.mark_dirty (grading.py:untouched).
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import Kept, case, compare, make_group, spawn, untouched
from nanohlat.classroom.checks.wire import Wire, comm_verdict


TP_WORLD = 4   # chapter 4's checks: at 4 ranks an all-gather + sum costs more than the all-reduce it replaces
# why a custom autograd Function must leave its inputs alone unless it says so: the right values come out
# either way, so the check looks at the inputs themselves (grading.py:untouched)
INPUT_WRITTEN = ("autograd still takes x for the tensor it was, so a backward that saved x (exp saves its "
                 "output, for one) reads the new values and computes a wrong gradient, silently: "
                 "torch.distributed's in-place collectives do not even bump the version counter that "
                 "catches other in-place writes. Return a new tensor (comm.all_reduce(x, group), not "
                 "inplace=True), or say so with ctx.mark_dirty(x)")
GRAD_WRITTEN = ("autograd may hand one gradient tensor to several nodes (an addition gives its gradient "
                "to both of its inputs, as in a residual h + f(h)), and the others would read the changed "
                "one; a backward has no way to say so (no mark_dirty). Return a new tensor")


def _conjugates(rank, world):
    from nanohlat import tensor_parallel as tpl
    group = make_group(rank, world, "tp")
    g = torch.Generator().manual_seed(41)
    B, T, C = 2, 2 * world, 3
    xs = [torch.randn(B, T, C, generator=g) for _ in range(world)]     # every rank's input, known to all
    gs = [torch.randn(B, T, C, generator=g) for _ in range(world)]     # every rank's upstream gradient
    gs_long = [torch.randn(B, T * world, C, generator=g) for _ in range(world)]
    gs_short = [torch.randn(B, T // world, C, generator=g) for _ in range(world)]
    total_x, total_g = sum(xs), sum(gs)
    full = B * T * C * 4                     # bytes of one (B, T, C) fp32 tensor
    cases = [  # (name, function, upstream grads, forward oracle, backward oracle, forward comm, backward comm)
        ("_Copy (enter, no SP)", tpl._Copy, gs, xs[rank], total_g, [], [("all_reduce", full)]),
        ("_Reduce (leave, no SP)", tpl._Reduce, gs, total_x, gs[rank], [("all_reduce", full)], []),
        ("_GatherSeq (enter, SP)", tpl._GatherSeq, gs_long, torch.cat(xs, dim=1),
         sum(gs_long).chunk(world, dim=1)[rank], [("all_gather", full * world)], [("reduce_scatter", full * world)]),
        ("_ScatterSeq (leave, SP)", tpl._ScatterSeq, gs_short, total_x.chunk(world, dim=1)[rank],
         torch.cat(gs_short, dim=1), [("reduce_scatter", full)], [("all_gather", full)]),
    ]
    for name, fn, grads, want_y, want_grad, fwd_comm, bwd_comm in cases:
        case(name)
        leaf = xs[rank].clone().requires_grad_()
        x = leaf.clone()            # not a leaf, as a layer's output is: a forward may write into it if it says so
        given = Kept(x)
        Wire.reset()
        y = fn.apply(x, group)
        dirty = y is x              # ctx.mark_dirty(x): the output is x itself, autograd told
        v = (compare(f"{name} forward", y, want_y, rank)
             or comm_verdict(f"{name} forward", group, fwd_comm, rank)
             or (None if dirty else untouched(f"{name} forward", "its input x", given, INPUT_WRITTEN, rank)))
        if v:
            return v
        Wire.reset()
        incoming = Kept(grads[rank].clone())
        y.backward(incoming.t)
        v = (compare(f"{name} backward (gradient of its input)", leaf.grad, want_grad, rank)
             or comm_verdict(f"{name} backward", group, bwd_comm, rank)
             or untouched(f"{name} backward", "the incoming gradient g", incoming, GRAD_WRITTEN, rank))
        if v:
            return v
    return None


def check_conjugates() -> str | None:
    return spawn(_conjugates, TP_WORLD)


def _linears(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = make_group(rank, world, "tp")
    kv_groups = [make_group(rank, world, "kv", [r, r + 1]) for r in range(0, world, 2)]   # pairs of replicas
    kv = kv_groups[rank // 2]
    g = torch.Generator().manual_seed(42)
    B, T, Cin, Cout = 2, 2 * world, 2 * world, 2 * world
    x, W, G = torch.randn(B, T, Cin, generator=g), torch.randn(Cout, Cin, generator=g), torch.randn(B, T, Cout, generator=g)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    (F.linear(xr, Wr) * G).sum().backward()
    y_full = F.linear(x, W)
    mine = lambda t, d, parts=world, part=rank: t.chunk(parts, dim=d)[part]
    full = B * T * Cout * 4
    for sp in (False, True):
        sp_txt = " with sequence parallel" if sp else ""
        name = case(f"ColumnParallelLinear{sp_txt}")
        col = tpl.ColumnParallelLinear(Cin, Cout, group)
        with torch.no_grad():
            col.weight.copy_(mine(W, 0))
        xi = (mine(x, 1) if sp else x).clone().requires_grad_()
        entered = tpl.enter(xi, group, sp)              # 4a's part, outside what is measured
        xe = entered.detach().requires_grad_()
        Wire.reset()
        y = col(xe)
        v = (compare(f"{name}: output", y, mine(y_full, 2), rank)
             or comm_verdict(f"{name}: forward", group, [], rank))
        if v:
            return v
        Wire.reset()
        (y * mine(G, 2)).sum().backward()
        moved = comm_verdict(f"{name}: backward", group, [], rank)   # reported once the values are right
        entered.backward(xe.grad)
        v = (compare(f"{name}: weight gradient", col.weight.grad, mine(Wr.grad, 0), rank)
             or compare(f"{name}: gradient of its input, after enter's backward", xi.grad,
                        mine(xr.grad, 1) if sp else xr.grad, rank)
             or moved)
        if v:
            return v
        name = case(f"RowParallelLinear{sp_txt}")
        row = tpl.RowParallelLinear(Cin, Cout, group, sp)
        with torch.no_grad():
            row.weight.copy_(mine(W, 1))
        xi = mine(x, 2).clone().requires_grad_()
        Wire.reset()
        y = row(xi)
        v = (compare(f"{name}: output", y, mine(y_full, 1) if sp else y_full, rank)
             or comm_verdict(f"{name}: forward", group, [("reduce_scatter" if sp else "all_reduce", full)], rank))
        if v:
            return v
        Wire.reset()
        (y * (mine(G, 1) if sp else G)).sum().backward()
        v = (compare(f"{name}: weight gradient", row.weight.grad, mine(Wr.grad, 1), rank)
             or compare(f"{name}: gradient of its input", xi.grad, mine(xr.grad, 2), rank)
             or comm_verdict(f"{name}: backward", group, [("all_gather", full)] if sp else [], rank))
        if v:
            return v
    # tp > n_kv_heads (HLAT-70B: tp 32, 8 kv heads): wk and wv are cut into tp / replicas parts, and
    # the `replicas` neighbouring ranks of a kv group hold the same part; each uses it for its own
    # query heads (its own upstream gradient), the optimizer adds their gradients later
    name = case("kv heads shared by ranks (tp > n_kv_heads): ColumnParallelLinear(replicas=2 ranks)")
    part, parts = rank // kv.size, world // kv.size
    col = tpl.ColumnParallelLinear(Cin, Cout, group, replicas=kv)
    with torch.no_grad():
        col.weight.copy_(mine(W, 0, parts, part))
    Gr = torch.randn(world, B, T, Cout // parts, generator=g)[rank]      # this replica's own upstream gradient
    xi = x.clone().requires_grad_()
    Wire.reset()
    y = col(xi)
    v = compare(f"{name}: output, part {part} of {parts}", y, mine(y_full, 2, parts, part), rank)
    if v:
        return v
    (y * Gr).sum().backward()
    return (compare(f"{name}: weight gradient", col.weight.grad, torch.einsum("bto,bti->oi", Gr, x), rank)
            or compare(f"{name}: gradient of its input", xi.grad, Gr @ mine(W, 0, parts, part), rank)
            or comm_verdict(f"{name}: forward and backward", group, [], rank))


def check_linears() -> str | None:
    return spawn(_linears, TP_WORLD)


def _cross_entropy(rank, world):
    import torch.nn.functional as F
    from nanohlat import tensor_parallel as tpl
    group = make_group(rank, world, "tp")
    g = torch.Generator().manual_seed(43)
    B, T, vocab, padded = 2, 6, 4 * world - 3, 4 * world   # 3 padded entries, all on the last rank
    per = padded // world
    targets = torch.randint(0, vocab, (B, T), generator=g)
    # targets on the first and the last id, and on both sides of every boundary between ranks
    edges = [0, vocab - 1] + [i for r in range(1, world) for i in (r * per - 1, r * per)]
    targets.view(-1)[:len(edges)] = torch.tensor(edges)
    spread = torch.randn(B, T, padded, generator=g) * 4
    big = torch.where(torch.arange(B * T).view(B, T, 1) % 2 == 0, 95.0, -95.0)
    cases = [("logits of about +-8", spread, 50.0),
             # realistic for a large vocabulary late in training, and where exp() overflows fp32 without
             # the max subtraction (e^89 > 3.4e38); the padding above every real logit
             ("large logits (about +-95, padding logits 100)", big + spread, 100.0)]
    BT = B * T * 4
    for name, logits, pad in cases:
        case(name)
        logits = logits.clone()
        logits[..., vocab:] = pad                     # padding must never take probability mass
        ref = logits[..., :vocab].double().requires_grad_()
        want = F.cross_entropy(ref.reshape(-1, vocab), targets.reshape(-1), reduction="none").view(B, T)
        want.sum().backward()
        want_grad = torch.cat([ref.grad, torch.zeros(B, T, padded - vocab, dtype=torch.float64)], dim=-1)
        leaf = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        local = leaf.clone()                          # not a leaf: the head's output, as in the model
        given = Kept(local)
        Wire.reset()
        loss = tpl.vocab_parallel_cross_entropy(local, targets, group, vocab)
        v = (compare(f"{name}: per-token loss", loss, want.detach(), rank)
             or comm_verdict(f"{name}: forward", group,
                             [("all_gather", BT * world), ("all_reduce", BT), ("all_reduce", BT)], rank)
             or untouched(f"{name}: forward", "its input logits", given,
                          "the logits are the caller's (the model drops them after the loss, so there it would "
                          "work by luck; a caller that reads them too, for an accuracy say, would find -inf in "
                          "the padding); logits.float() of fp32 logits is the tensor itself, so work on new "
                          "tensors (masked_fill, not masked_fill_)", rank))
        if v:
            return v
        Wire.reset()
        loss.sum().backward()
        v = (compare(f"{name}: gradient of this rank's logits", leaf.grad, want_grad.chunk(world, dim=-1)[rank], rank)
             or comm_verdict(f"{name}: backward", group, [], rank))
        if v:
            return v
    return None


def check_cross_entropy() -> str | None:
    return spawn(_cross_entropy, TP_WORLD)
