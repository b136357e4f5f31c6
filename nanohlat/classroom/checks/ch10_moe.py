"""Chapter 10, a mixture of experts: the router, the sorted dispatch, the expert-parallel groups.

10a (top-k routing with the load-balancing and z losses, moe.route) against
the formulas written here in fp64, values and gradients: the k likeliest
experts, their probabilities renormalised over the k; per sequence f_e (the
share of the T*k choices, counts with no gradient), P_e (the mean
probability), balance E * sum_e f_e P_e and z the mean of logsumexp^2; k 1,
2 and E, sequences routed very differently (a batch mean is not a sequence's),
a bias that chooses (p + bias) but does not weigh (--moe-bias-rate),
router logits of several hundred (exp() overflows fp32 past about 88), bf16
inputs (routed in fp32: balance and z to fp32 round-off, so a bf16 matmul cast up
is seen), x and w_router left as they were (values and version counters); then
with sequence parallelism on 2 gloo ranks, each holding half of every sequence
(the sums over a sequence add up over tp).
10b (the sorted dispatch, moe.dispatch_sorted) against the plain loop over
experts written here, values and the gradients of x, the weights and every
expert's matrices: many tokens on one expert, experts with no token (their
gradients zeros, not missing), k 1 and k E, bf16 inputs (y in bf16, what the
next matmul takes); every input left as it was (a combine written into x passes
on values and breaks train.py's backward). 10c (the ep and ep_dp groups,
mesh.ep_groups) on 4 gloo ranks: a MoE layer under expert parallelism (dp 4,
ep 2 and ep 4) trained one backward through FlatAdamW's gradient reduction,
its router and experts' gradients against one process on all the tokens, then
which group carried the tokens (the all-to-all on a run of ep neighbouring dp
ranks: a strided ep and a contiguous ep_dp give the same sums through the
wrong groups); then the groups of other layouts (tp, pp) against tables
written here.
"""

from __future__ import annotations

import torch

from nanohlat.classroom.checks.grading import Kept, case, compare, make_group, spawn, untouched
from nanohlat.classroom.checks.wire import Wire


# ---------------------------------------------------------------------------
# The oracles: the router's formulas and the plain loop, in fp64
# ---------------------------------------------------------------------------

def _route(x, w, k, bias=None):
    """(experts, weights, balance, z) of the router, per sequence, straight from the formulas
    (bias: p + bias chooses the experts, p weighs them)."""
    B, T, _ = x.shape
    E = w.shape[0]
    logits = x.double() @ w.double().t()
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    score = p.detach() if bias is None else p.detach() + bias.double()
    order = torch.sort(score, dim=-1, descending=True).indices[..., :k]   # (B, T, k)
    top = torch.gather(p, -1, order)
    weights = top / top.sum(-1, keepdim=True)
    balance, z = [], []
    for b in range(B):
        counts = torch.zeros(E, dtype=torch.float64)
        for t in range(T):
            for e in order[b, t].tolist():
                counts[e] += 1
        f = counts / (T * k)                                  # a constant: counts have no gradient
        P = p[b].mean(0)
        balance.append(E * (f * P).sum())
        lse = logits[b].max(-1).values + torch.log(torch.exp(logits[b] - logits[b].max(-1, keepdim=True).values).sum(-1))
        z.append((lse ** 2).mean())
    return order, weights, torch.stack(balance), torch.stack(z)


def _swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def _loop(x, experts, weights, gate, up, down):
    """Token by token, choice by choice: y_t = sum_j weight_tj * SwiGLU_(expert_tj)(x_t)."""
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros_like(x[t])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            y = y + weights[t, j] * _swiglu(x[t:t + 1], gate[e], up[e], down[e])[0]
        rows.append(y)
    return torch.stack(rows) if rows else x[:0].clone()


def _leaves(*ts, dtype=torch.float64):
    return [t.detach().to(dtype).clone().requires_grad_() for t in ts]


def _grads(what, got, want, names, rank=None, **tol) -> str | None:
    for name, g, w in zip(names, got, want):
        if g is None:
            return (f"{what}: no gradient reached {name} (it was not used in the graph: every part of the "
                    f"result must come from it, through autograd)")
        v = compare(f"{what}: the gradient of {name}", g, w, rank, **tol)
        if v:
            return v
    return None


# ---------------------------------------------------------------------------
# 10a: the router
# ---------------------------------------------------------------------------

def _route_case(name, x, w, k, seq_group=None, part=None, rank=None, bias=None, losses_tol=None,
                **tol) -> str | None:
    """route on x (or on `part`, this rank's slice of the tokens, under SP) against the oracle
    on the whole x: each output, then the gradients of x and w_router through each output."""
    from nanohlat.beyond.moe import route
    B, T, C = x.shape
    ref_x, ref_w = _leaves(x, w)
    want = _route(ref_x, ref_w, k, bias)
    g = torch.Generator().manual_seed(3)
    up_w = torch.randn(B, T, k, generator=g, dtype=torch.float64)
    up_b, up_z = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)
    sl = slice(None) if part is None else part
    mx, mw = x[:, sl].detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    given = [Kept(mx), Kept(mw)]
    outs = route(mx, mw, k, seq_group) if bias is None else route(mx, mw, k, seq_group, bias)
    for which, kept in zip(("x", "w_router"), given):
        v = untouched(f"{name}: route", which, kept, "x is the residual stream, which the block adds its output "
                      "to, and w_router the parameter the optimizer steps: the router only reads them", rank)
        if v:
            return v
    if not isinstance(outs, tuple) or len(outs) != 4:
        return f"{name}: route returned {type(outs).__name__}, expected (experts, weights, balance, z)"
    experts, weights, balance, z = outs
    want_e, want_w, want_b, want_z = want[0][:, sl], want[1][:, sl], want[2], want[3]
    if not isinstance(experts, torch.Tensor) or tuple(experts.shape) != tuple(want_e.shape):
        shape = tuple(experts.shape) if isinstance(experts, torch.Tensor) else type(experts).__name__
        return f"{name}: experts has shape {shape}, expected {tuple(want_e.shape)} (B, T, k): each token's k choices"
    if not torch.equal(experts.long(), want_e):
        i = tuple(int(a) for a in (experts.long() != want_e).nonzero()[0][:2])
        return (f"{name}: token {list(i)} chose experts {experts[i].tolist()}, expected {want_e[i].tolist()} "
                f"(the k largest router probabilities over the E experts, likeliest first"
                f"{'; with a bias, the k largest p + bias, the weights still from p' if bias is not None else ''})")
    if weights is None or weights.dtype != x.dtype:
        return f"{name}: weights are {None if weights is None else weights.dtype}, expected {x.dtype} (the input's)"
    for what, got, exact in (("weights", weights, want_w), ("balance", balance, want_b), ("z", z, want_z)):
        v = compare(f"{name}: {what}", got, exact, rank, **(tol if what == "weights" or not losses_tol else losses_tol))
        if v:
            hint = {"weights": " (the chosen k probabilities divided by their own sum)",
                    "balance": " (per sequence: E * sum_e f_e P_e, f_e the share of its T*k choices on e, "
                               "P_e its mean probability of e)",
                    "z": " (per sequence: the mean over its tokens of logsumexp(logits)^2)"}[what]
            return v + hint
    for what, got, exact, upstream in (("weights", weights, want[1], up_w), ("balance", balance, want_b, up_b),
                                       ("z", z, want_z, up_z)):
        mine = upstream[:, sl] if what == "weights" else upstream
        gx, gw = torch.autograd.grad((got.double() * mine).sum(), (mx, mw), retain_graph=True, allow_unused=True)
        if seq_group is not None and gw is not None:   # each tp rank's router gradient is partial: optim.py adds them
            from nanohlat import comm
            gw = comm.all_reduce(gw, seq_group)
        ex, ew = torch.autograd.grad((exact * upstream).sum(), (ref_x, ref_w), retain_graph=True)
        v = _grads(f"{name}: through {what}", (gx, gw), (ex[:, sl], ew), ("x", "w_router"), rank, **tol)
        if v and what == "balance" and gw is not None:
            v += " (f_e counts choices: no gradient flows through it, only through P_e)"
        if v:
            return v
    return None


def _sp_route(rank, world):
    group = make_group(rank, world, "tp")
    name = case("sequence parallelism: 2 tp ranks holding half of every sequence each (seq_group)")
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(3, 8, 6, generator=g), torch.randn(5, 6, generator=g)
    half = x.shape[1] // world
    return _route_case(name, x, w, 2, group, slice(rank * half, (rank + 1) * half), rank, rtol=1e-4, atol=1e-5)


def check_route() -> str | None:
    g = torch.Generator().manual_seed(10)
    cases = [("k 2 of E 5, 3 sequences of 7 tokens", 3, 7, 6, 5, 2, 1.0),
             ("k 1 (each token's weight 1)", 2, 6, 4, 4, 1, 1.0),
             ("k E (every expert chosen: the weights are the probabilities)", 2, 5, 4, 4, 4, 1.0)]
    for name, B, T, C, E, k, scale in cases:
        name = case(name)
        x, w = torch.randn(B, T, C, generator=g, dtype=torch.float64), torch.randn(E, C, generator=g, dtype=torch.float64)
        v = _route_case(name, x * scale, w, k)
        if v:
            return v
    name = case("sequences routed very differently (one on expert 0 only): each sequence's own f_e and P_e")
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    x = torch.randn(3, 6, 6, generator=g, dtype=torch.float64)
    x[0] = w[0] * 3 + 0.1 * x[0]          # sequence 0 leans hard on expert 0
    v = _route_case(name, x, w, 2)
    if v:
        return v
    name = case("a bias (--moe-bias-rate) that moves some tokens: p + bias chooses the k, p alone weighs them")
    x, w = torch.randn(3, 7, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    v = _route_case(name, x, w, 2, bias=torch.tensor([0.2, -0.15, 0.0, 0.1], dtype=torch.float64))
    if v:
        return v
    name = case("large logits (router logits of several hundred, fp32: exp() overflows past about 88 without "
                "the max taken out, as logsumexp and softmax do)")
    w, x = torch.randn(4, 6, generator=g), torch.randn(2, 5, 6, generator=g)
    w[:, 0], x[..., 0] = 1.0, 200.0          # every logit 200 + a spread of a few: a well-posed softmax
    v = _route_case(name, x, w, 2, rtol=1e-4, atol=1e-4)
    if v:
        return v
    # bf16 inputs: the weights and gradients come back in bf16 (within its rounding), but balance and z are
    # fp32 sums of fp32 logits: a router that multiplies in bf16 and casts up moves them by ~1e-3
    name = case("bf16 inputs (routed in fp32: logits, balance and z to fp32 round-off; the weights in bf16)")
    x, w = torch.randn(2, 6, 8, generator=g).bfloat16(), torch.randn(4, 8, generator=g).bfloat16()
    v = _route_case(name, x, w, 2, losses_tol=dict(rtol=1e-5, atol=1e-6), rtol=1e-2, atol=1e-2)
    if v:
        return v
    from nanohlat.beyond.moe import route
    _, _, balance, z = route(x, w, 2)
    if balance.dtype != torch.float32 or z.dtype != torch.float32:
        return f"{name}: balance and z are {balance.dtype} and {z.dtype}; compute the router in fp32 at least"
    return spawn(_sp_route, 2)


# ---------------------------------------------------------------------------
# 10b: the sorted dispatch
# ---------------------------------------------------------------------------

def check_dispatch() -> str | None:
    from nanohlat.beyond.moe import dispatch_sorted
    g = torch.Generator().manual_seed(20)
    C, F = 6, 5
    cases = []   # (name, E, experts as a list of rows)
    perm = lambda n, E: [torch.randperm(E, generator=g)[:n].tolist() for _ in range(9)]   # noqa: E731
    cases.append(("9 tokens, k 2 of E 4", 4, perm(2, 4)))
    cases.append(("many tokens on one expert (ties in the sort: 7 of 9 tokens choose expert 2 first)", 4,
                  [[2, (i % 3) + (i % 3 >= 2)] for i in range(7)] + [[0, 1], [3, 0]]))
    cases.append(("experts with no token (1 and 3 of E 5): their gradients zeros, not missing", 5,
                  [[0, 2], [4, 0], [2, 4], [0, 4], [2, 0]]))
    cases.append(("k 1", 4, perm(1, 4)))
    cases.append(("k E (every token on every expert, in another order each)", 3, perm(3, 3)))
    cases.append(("bf16 inputs (--precision bf16: y in bf16, the next matmul's dtype; within its rounding)", 4,
                  perm(2, 4)))
    for name, E, rows in cases:
        name = case(name)
        dtype = torch.bfloat16 if "bf16" in name else torch.float64
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
        experts = torch.tensor(rows)
        N, k = experts.shape
        x = torch.randn(N, C, generator=g, dtype=torch.float64)
        weights = torch.rand(N, k, generator=g, dtype=torch.float64) + 0.1
        params = [torch.randn(E, F, C, generator=g, dtype=torch.float64) * 0.5,
                  torch.randn(E, F, C, generator=g, dtype=torch.float64) * 0.5,
                  torch.randn(E, C, F, generator=g, dtype=torch.float64) * 0.5]
        mine = _leaves(x, weights, *params, dtype=dtype)
        ref = _leaves(*mine)                                    # (the oracle in fp64, on the same values)
        given = [Kept(t) for t in mine] + [Kept(experts.clone())]
        y = dispatch_sorted(mine[0], given[-1].t, mine[1], *mine[2:])
        for which, kept in zip(("x", "weights", "gate", "up", "down", "experts"), given):
            v = untouched(f"{name}: dispatch_sorted", which, kept, "x is the residual stream, added to the "
                          "block's output, and autograd reads the inputs it saved in the backward (train.py's "
                          "backward then fails: a variable needed for gradient computation has been modified)")
            if v:
                return v
        want = _loop(ref[0], experts, ref[1], *ref[2:])
        if isinstance(y, torch.Tensor) and y.dtype != dtype:
            return (f"{name}: y is {y.dtype} for {dtype} inputs; return the input's dtype (under --precision bf16 "
                    f"the next matmul takes bf16 and fails on fp32)")
        v = compare(f"{name}: y", y, want, **tol)
        if v:
            return v + " (y_t: the sum over t's k choices of weight x SwiGLU of the chosen expert)"
        upstream = torch.randn(N, C, generator=g, dtype=torch.float64)
        got = torch.autograd.grad((y * upstream.to(dtype)).sum(), mine, allow_unused=True)
        exact = torch.autograd.grad((want * upstream).sum(), ref, allow_unused=True)
        exact = [torch.zeros_like(t) if e is None else e for e, t in zip(exact, ref)]
        v = _grads(name, got, exact, ("x", "weights", "gate", "up", "down"), **tol)
        if v:
            return v
    return None


# ---------------------------------------------------------------------------
# 10c: the ep and ep_dp groups
# ---------------------------------------------------------------------------

# (tp, pp, dp, ep) -> (ep groups, ep_dp groups), written out by hand (rank = (pp * dp + dp) * tp + tp)
EP_TABLES = {
    (1, 1, 4, 2): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (1, 1, 4, 4): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (1, 1, 6, 3): ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]]),
    (1, 1, 8, 2): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (2, 1, 4, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 2, 4, 2): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (2, 2, 2, 2): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0], [2], [1], [3], [4], [6], [5], [7]]),
}
D, FF, E_ALL, K, T_SEQ = 6, 5, 4, 2, 5


def _ep_run(rank, world, ep, zero) -> str | None:
    """One MoE layer's forward and backward at dp 4 and this ep, its gradients reduced by FlatAdamW:
    against one process on all 4 ranks' tokens; then the groups the collectives ran on."""
    import dataclasses
    import torch.distributed as dist
    from nanohlat import comm
    from nanohlat.recipe import TrainConfig
    from nanohlat.device import get_device
    from nanohlat.mesh import Mesh
    from nanohlat.beyond.moe import MoE, add_groups
    from nanohlat.optim import FlatAdamW
    name = case(f"dp {world}, ep {ep}" + (", ZeRO-1" if zero else "") + f": rank {rank}")
    mesh = add_groups(Mesh(1, 1, world, rank, ledger=comm.CommLedger()), ep).build_groups(get_device("cpu"))
    ep_group = mesh.group("ep")
    g = torch.Generator().manual_seed(30)                      # the same tensors on every rank
    x = torch.randn(world, T_SEQ, D, generator=g)
    full = {"router": torch.randn(E_ALL, D, generator=g), "gate": torch.randn(E_ALL, FF, D, generator=g) * 0.5,
            "up": torch.randn(E_ALL, FF, D, generator=g) * 0.5, "down": torch.randn(E_ALL, D, FF, generator=g) * 0.5}
    upstream = torch.randn(world, T_SEQ, D, generator=g)
    moe = MoE(D, FF, E_ALL, K, ep_group=ep_group if ep > 1 else None)
    mine = slice(ep_group.rank * (E_ALL // ep), (ep_group.rank + 1) * (E_ALL // ep))
    with torch.no_grad():
        moe.router.weight.copy_(full["router"])
        for what in ("gate", "up", "down"):
            getattr(moe, what).weight.copy_(full[what][mine])
    tcfg = dataclasses.replace(TrainConfig(), zero=zero, ep=ep, bucket_mb=1e-4)
    opt = FlatAdamW(moe, mesh, tcfg, get_device("cpu"))
    opt.zero_grad()
    Wire.reset()
    y = moe(x[rank:rank + 1])
    balance, z = moe.losses
    ((y * upstream[rank:rank + 1]).sum() + 0.3 * balance.sum() + 0.2 * z.sum()).backward()
    grads = opt.reduce_gradients()
    calls = list(Wire.calls)
    # one process, all the tokens, every expert
    ref = {k_: v.double().requires_grad_() for k_, v in full.items()}
    experts, weights, balance, z = _route(x.double(), ref["router"], K)
    out = _loop(x.double().reshape(-1, D), experts.reshape(-1, K), weights.reshape(-1, K),
                ref["gate"], ref["up"], ref["down"])
    ((out * upstream.double().reshape(-1, D)).sum() + 0.3 * balance.sum() + 0.2 * z.sum()).backward()
    for fg, grad in zip(opt.groups, grads):
        for pname, p, off in zip(fg.names, fg.params, fg.offsets):
            want = ref[pname.split(".")[0]].grad
            want = want if p.shard.group != "ep" else want[mine]
            lo, hi = max(off, fg.start), min(off + p.numel(), fg.stop)
            if lo >= hi:
                continue                                        # ZeRO-1: none of it on this rank's shard
            shard = grad[lo - fg.start:hi - fg.start] if grad.numel() == fg.stop - fg.start else grad[lo:hi]
            v = compare(f"{name}: the summed gradient of {pname}", shard, want.reshape(-1)[lo - off:hi - off],
                        rank, rtol=1e-4, atol=1e-5)
            if v:
                held = ("the experts' gradients sum over the ranks holding the same experts (ep_dp), the "
                        "router's over all of dp") if p.shard.group == "ep" else "the router is replicated: summed over dp"
                return v + f" ({held}; ep groups {mesh._all('ep')}, ep_dp groups {mesh._all('ep_dp')})"
    ranks_of = lambda c: dist.get_process_group_ranks(c.pg) if c.pg is not None else [rank]   # noqa: E731
    run = [r for r in range(world) if r // ep == rank // ep]     # ep neighbouring dp ranks
    for c in calls:
        if c.kind == "all_to_all" and ranks_of(c) != run:
            return (f"{name}: right values, but the tokens' all-to-all ran on ranks {ranks_of(c)}, expected {run}: "
                    f"an ep group is a run of ep neighbouring dp ranks (the all-to-all of every MoE layer then stays "
                    f"on the nearest links, a node's)")
    return None


def _ep_runs(rank, world):
    for ep, zero in ((2, 0), (2, 1), (4, 0)):
        v = _ep_run(rank, world, ep, zero)
        if v:
            return v
    return None


def check_ep_groups() -> str | None:
    v = spawn(_ep_runs, 4)
    if v:
        return v
    from nanohlat.beyond.moe import ep_groups
    for (tp, pp, dp, ep), (want_ep, want_ep_dp) in EP_TABLES.items():
        for kind, want in (("ep", want_ep), ("ep_dp", want_ep_dp)):
            name = case(f"tp={tp}, pp={pp}, dp={dp}, ep={ep}, the {kind} groups")
            got = ep_groups(kind, tp, pp, dp, ep)
            if not isinstance(got, list) or sorted(sorted(g) for g in got) != sorted(want):
                return (f"{name}: ep_groups({kind!r}, tp={tp}, pp={pp}, dp={dp}, ep={ep}) = {got}, expected the "
                        f"groups {sorted(want)} (" + ("runs of ep neighbouring dp ranks, per pp stage and tp rank"
                                                      if kind == "ep" else "the dp ranks at the same place of each "
                                                      "ep group: they hold the same experts") + ")")
            if any(list(g) != sorted(g) for g in got):
                return f"{name}: ep_groups({kind!r}, ...) = {got}: list each group's ranks in increasing order"
    return None
