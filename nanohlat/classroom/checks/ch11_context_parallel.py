"""Chapter 11, context parallelism: the online-softmax merge, the zigzag split, the ring's backward.

11a (the merge of two partial attention results) against one softmax over the
union of the key blocks, computed here in fp64: blocks of unequal sizes, logits
so large that exp() overflows fp32 without the running max, a block wholly
masked (lse -inf), three blocks merged in turn, its inputs left as they were
(no row with lse -inf in both inputs: the ring never merges one). 11b (the zigzag split) against tables derived by hand for small T and
cp: every position exactly once, every rank the same causal work, then the
exact table; and the shift into (input, target) made before the split, each
token's target the next token of the whole sequence. 11c (the ring's backward)
on 4 gloo ranks (cp 4, and cp 3 on a group of 3 of them) against autograd
through dense causal attention over the whole sequence in fp64, fp32 and bf16
inputs; once the gradients are right, what the backward moved: every message on
the cp group, no more bytes sent than the ring sends, and no message larger than
one block of K/V and its fp32 dK/dV (the ring's point: no rank holds all of K/V);
q, k, v and the incoming gradient left as they were; then how each shift ran
(Wire's clock against each _attend_grads call, as 3d sees ZeRO-2's overlap):
every message waited, the next K/V block in flight during a step's arithmetic
(n - 1 of them) and waited before the next step's. A deadlock (a handle waited
twice, a shift never waited) ends after grading.STALL_S s of no rank moving,
naming what each rank was blocked in.
The positions tables here are written out by hand, not taken from 11b's code.
"""

from __future__ import annotations

import math

import torch

from nanohlat.classroom.checks.grading import TOL, Kept, case, compare, make_group, spawn, untouched
from nanohlat.classroom.checks.wire import Wire, _name

# rank i holds chunks i and 2n-1-i of 2n chunks (c tokens each): written out, not computed
ZIGZAG = {
    (6, 1): [[0, 1, 2, 3, 4, 5]],
    (8, 2): [[0, 1, 6, 7], [2, 3, 4, 5]],
    (12, 3): [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]],
    (16, 2): [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
}


# ---------------------------------------------------------------------------
# 11a: the merge
# ---------------------------------------------------------------------------

def _softmax_attention(q, k, v, mask):
    """fp64 (o, lse) of softmax(q k^T / sqrt(D)) v over these keys; a row with no key: o 0, lse -inf."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)      # a row with no key: exp(-inf - -inf) = nan -> 0
    return p @ v.double(), lse


def _compare_lse(what, got, want) -> str | None:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return compare(what, got, want)
    none = torch.isneginf(want)
    if not torch.equal(torch.isneginf(got), none):
        idx = [int(i) for i in (torch.isneginf(got) != none).nonzero()[0]]
        return (f"{what}: at index {idx} got {got[tuple(idx)].item():.6g}, expected "
                f"{want[tuple(idx)].item():.6g} (a row with no key has lse -inf: log of an empty sum)")
    return compare(what, torch.where(none, 0.0, got.double()), torch.where(none, 0.0, want))


def check_merge() -> str | None:
    from nanohlat.beyond.context_parallel import merge
    g = torch.Generator().manual_seed(111)
    B, H, tq, D = 2, 3, 5, 8
    everyone = torch.ones(B, H, tq, 1, dtype=torch.bool)
    cases = []   # (name, q scale, [key block sizes], the mask of each block or None for all keys)
    cases.append(("two blocks of 6 keys", 1.0, [6, 6], None))
    cases.append(("unequal blocks (1 key and 9 keys)", 1.0, [1, 9], None))
    cases.append(("large logits (scores of several hundred: exp() overflows fp32 without the running max)",
                  100.0, [4, 7], None))
    cases.append(("a block wholly masked (every row's lse -inf, its o zeros)", 1.0, [5, 3], "second"))
    # (no row with lse -inf in both inputs: the ring merges a query chunk's own diagonal block first, where
    # every query has its own key, so no merge it makes has such a row; a merge may give it anything)
    cases.append(("three blocks merged in turn (the merged lse is merged again)", 3.0, [2, 5, 3], None))
    for name, scale, sizes, masking in cases:
        name = case(name)
        q = torch.randn(B, H, tq, D, generator=g) * scale
        ks = [torch.randn(B, H, n, D, generator=g) for n in sizes]
        vs = [torch.randn(B, H, n, D, generator=g) for n in sizes]
        masks = [everyone.expand(B, H, tq, n).clone() for n in sizes]
        if masking == "second":
            masks[1][:] = False
        parts = [_softmax_attention(q, k, v, m) for k, v, m in zip(ks, vs, masks)]
        o, lse = parts[0][0].float(), parts[0][1].float()      # the ring's partial results are fp32
        for o_b, lse_b in parts[1:]:
            given = [Kept(t) for t in (o, lse, o_b.float(), lse_b.float())]
            o, lse = merge(*(g.t for g in given))
            for which, kept in zip(("o_a", "lse_a", "o_b", "lse_b"), given):
                v = untouched(f"{name}: merge", which, kept, "merge returns the merged result as new tensors; a "
                              "caller still holding a partial result (to merge it in another order, or to log "
                              "it) would read a changed one: leave the inputs as they were, as every exercise does")
                if v:
                    return v
        want_o, want_lse = _softmax_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(masks, -1))
        v = (compare(f"{name}: the merged o", o, want_o)
             or _compare_lse(f"{name}: the merged lse", lse, want_lse))
        if v:
            return v
        if o.dtype != torch.float32 or lse.dtype != torch.float32:
            return f"{name}: merge returned {o.dtype} and {lse.dtype} for fp32 inputs; keep the running result in fp32"
    return None


# ---------------------------------------------------------------------------
# 11b: the zigzag split
# ---------------------------------------------------------------------------

def check_zigzag() -> str | None:
    from nanohlat.beyond.context_parallel import split_sequence, zigzag_positions
    for (T, cp), table in ZIGZAG.items():
        name = case(f"zigzag_positions(T={T}, cp={cp})")
        got = zigzag_positions(T, cp)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (cp, T // cp):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"{name}: got {shape}, expected a ({cp}, {T // cp}) tensor: row i is rank i's positions"
        rows = got.tolist()
        if sorted(p for row in rows for p in row) != list(range(T)):
            return (f"{name}: the table {rows} does not hold every position 0..{T - 1} exactly once: each "
                    f"token of the whole sequence lives on one rank, at its place in the sequence")
        work = [sum(p + 1 for p in row) for row in rows]   # the token at position p attends to p + 1 keys
        if len(set(work)) > 1:
            return (f"{name}: the causal work per rank is unbalanced: {rows} gives the ranks {work} (query, key) "
                    f"pairs (a token at position p attends to p + 1 keys); the last rank waits for no one and "
                    f"the others wait for it. Cut {2 * cp} chunks and give rank i chunks i and {2 * cp - 1}-i")
        if rows != table:
            return f"{name}: got {rows}, expected {table} (rank i: chunk i, then chunk {2 * cp - 1}-i, in order)"
    for T, cp in ((8, 2), (12, 3)):
        tokens = 1000 * torch.arange(2)[:, None] + torch.arange(T + 1)   # a token's value names its place
        for rank in range(cp):
            name = case(f"split_sequence of {T + 1} tokens over cp={cp}, rank {rank}")
            mine = torch.tensor(ZIGZAG[(T, cp)][rank])
            given = Kept(tokens.clone())
            got = split_sequence(given.t, cp, rank)
            v = untouched(f"{name}: split_sequence", "tokens", given, "the caller's batch must come back as it "
                          "was (every exercise's rule: read the inputs, return new tensors or views)")
            if v:
                return v
            if not isinstance(got, tuple) or len(got) != 3:
                return f"{name}: expected (inputs, targets, positions), got {type(got).__name__}"
            inputs, targets, positions = got
            for what, value, want in (("inputs", inputs, tokens[:, mine]), ("targets", targets, tokens[:, mine + 1])):
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want.shape) \
                        or not torch.equal(value, want):
                    return (f"{name}: {what} {value.tolist() if isinstance(value, torch.Tensor) else value}, "
                            f"expected {want.tolist()} (tokens numbered by their place, +1000 in the second row): "
                            + ("the target of each token is the next token of the whole sequence, so shift the "
                               "whole sequence into (input, target) first and split both the same way"
                               if what == "targets" else "this rank's tokens are those at its zigzag positions"))
            if not isinstance(positions, torch.Tensor) or positions.tolist() != mine.tolist():
                p = positions.tolist() if isinstance(positions, torch.Tensor) else positions
                return (f"{name}: positions {p}, expected {mine.tolist()}: each token's place in the whole "
                        f"sequence (its rotary angle and its row of the causal mask), not its place on the rank")
    return None


# ---------------------------------------------------------------------------
# 11c: the ring's backward
# ---------------------------------------------------------------------------

RING_WORLD = 4
B, H, KV, D = 2, 4, 2, 8      # grouped-query: two query heads a kv head


def _bf16_steps(got, want, floor):
    """|got - want| in units of the spacing of bf16 numbers at max(|want|, floor)."""
    mag = want.double().abs().clamp_min(floor)
    return (got.double() - want.double()).abs() / torch.exp2(torch.floor(torch.log2(mag)) - 7)


def _dense_grads(q, k, v, upstream):
    """Autograd through dense causal attention over the whole sequence, in fp64: out, dq, dk, dv."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    rep = H // KV
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[2]
    s = q @ kk.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ vv
    out.backward(upstream.double())
    return out.detach(), q.grad, k.grad, v.grad


def _ring_verdict(name, group, calls, rank, kv_bytes, dkv_bytes) -> str | None:
    """What the backward moved: on the cp group; sent no more than the ring ((n-1) hops of K/V,
    n of fp32 dK/dV); no message over one block of K/V and its fp32 dK/dV."""
    import torch.distributed as dist
    from nanohlat.classroom.checks.wire import _describe
    n = group.size
    for c in calls:
        if c.pg is not group.pg:
            which = "the default (world) process group" if c.pg is dist.group.WORLD else "another process group"
            return (f"{name} backward on rank {rank}: right values, but a {c.kind} ran on {which}, not on the cp "
                    f"group it was given (ranks {group.ranks}): pass the group (nanohlat.comm, group.pg)")
    sent = sum(c.wire for c in calls if c.kind != "recv")
    ring = (n - 1) * kv_bytes + n * dkv_bytes
    if sent > ring:
        return (f"{name} backward on rank {rank}: right values, but this rank sent {round(sent)} bytes where "
                f"{ring} suffice ({_describe(calls)}; the ring sends its K/V block on {n - 1} times "
                f"({kv_bytes} bytes each) and the fp32 dK/dV {n} times ({dkv_bytes} bytes each), the last hop home)")
    most = kv_bytes + dkv_bytes
    big = [c for c in calls if c.payload > most]
    if big:
        article = "an" if big[0].kind[0] in "aeiou" else "a"
        return (f"{name} backward on rank {rank}: right values, but {article} {big[0].kind} of {big[0].payload} bytes "
                f"({_describe(calls)}): a ring rank never holds more than one block of K/V and its dK/dV "
                f"({most} bytes) besides its own; pass each block to the next rank (comm.start_ring_shift)")
    return None


def _shifts_verdict(name, rank, calls, stamps, n) -> str | None:
    """How each shift ran, against the arithmetic (`stamps`: when each _attend_grads call began, on
    Wire's clock): every started message waited; the K/V block of the next step in flight while
    this step's blocks are computed (n - 1 of them: the overlap the ring exists for); and each
    message that was in flight during a step's arithmetic waited before the next step's begins
    (the block it brings is what that step reads). Steps: runs of _attend_grads calls with no
    collective started or waited in between."""
    never = sorted((c for c in calls if c.waited is None), key=lambda c: c.kind != "recv")   # (a recv first)
    if never:
        return (f"{name} backward on rank {rank}: right values, but {_name(never[0])} was never waited "
                f"({len(never)} message(s) never waited): reading a received block before its wait() returns "
                f"reads whatever has arrived so far; gloo happened to deliver it in time here, a GPU's "
                f"communication stream does not. Wait on every handle comm.start_ring_shift returns")
    if not stamps:
        return (f"{name} backward on rank {rank}: the backward never called _attend_grads; compute each (query "
                f"chunk, key chunk) pair's gradients with it (the check sees each step's arithmetic through it)")
    events = sorted({c.started for c in calls} | {c.waited for c in calls})
    runs = []
    for t in sorted(stamps):
        if runs and not any(runs[-1][-1] < e < t for e in events):
            runs[-1].append(t)
        else:
            runs.append([t])
    recvs = [c for c in calls if c.kind == "recv"]
    over = [c for c in recvs if any(c.started < t < c.waited for t in stamps)]
    if len(over) < n - 1:
        return (f"{name} backward on rank {rank}: right values, but no block travelled while a block was computed "
                f"({len(over)} of its {len(recvs)} receives were in flight during any _attend_grads; {n - 1} "
                f"needed, one for each K/V block that arrives): the ring exists to hide the shifts behind the "
                f"arithmetic. Start the next K/V block's shift before this step's pairs, wait after them")
    for j, run in enumerate(runs[:-1]):
        for c in recvs:
            if c.started < run[-1] and c.waited > run[-1] and c.waited > runs[j + 1][0]:
                return (f"{name} backward on rank {rank}: right values, but {_name(c)}, in flight during one "
                        f"step's arithmetic, was waited only after the next step's began: that step computes "
                        f"on the block it brings, so wait on it before reading it")
    return None


def _ring(rank, world):
    from nanohlat.beyond import context_parallel
    from nanohlat.beyond.context_parallel import RingAttention
    stamps, block_grads = [], context_parallel._attend_grads

    def stamped(*args, **kwargs):   # (each pair's arithmetic, on Wire's clock)
        stamps.append(Wire.now())
        return block_grads(*args, **kwargs)
    context_parallel._attend_grads = stamped
    groups = [make_group(rank, world, "cp"), make_group(rank, world, "cp", [0, 1, 2])]
    cases = [("cp 4, fp32", groups[0], torch.float32), ("cp 3 (ranks 0-2 of 4), fp32", groups[1], torch.float32),
             ("cp 4, bf16 inputs (within 1.5 bf16 steps of the exact gradients)", groups[0], torch.bfloat16)]
    for name, group, dtype in cases:
        if rank not in group.ranks:
            continue
        name = case(name)
        n, me = group.size, group.rank
        T = 4 * n
        table = torch.tensor(ZIGZAG[(T, n)])                    # chunks of 2 tokens
        g = torch.Generator().manual_seed(7 + n)                 # the same tensors on every rank
        full = [torch.randn(B, h, T, D, generator=g).to(dtype) for h in (H, KV, KV)]
        upstream = torch.randn(B, H, T, D, generator=g).to(dtype)
        want = _dense_grads(*full, upstream)
        mine = table[me]
        q, k, v = (x[:, :, mine].clone().requires_grad_() for x in full)
        out = RingAttention.apply(q, k, v, group, table)
        Wire.reset()
        stamps.clear()
        given = [Kept(t) for t in (q, k, v, upstream[:, :, mine].clone())]
        out.backward(given[3].t)
        calls = list(Wire.calls)
        for which, kept in zip(("q", "k", "v", "the gradient of the output"), given):
            verdict = untouched(f"{name}: the backward", which, kept, "autograd hands the backward the saved "
                                "inputs and the incoming gradient to read; the layers before attention and the "
                                "optimizer read them after it", rank)
            if verdict:
                return verdict
        got = [("the forward's output (through 11a's merge)", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]
        for (what, value), exact in zip(got, want):
            exact = exact[:, :, mine]
            if dtype == torch.float32:
                verdict = compare(f"{name}: {what}", value, exact, rank)
            elif value is None or value.dtype != torch.bfloat16:
                verdict = f"{name}: {what} on rank {rank} is {None if value is None else value.dtype}, expected bf16"
            else:
                steps = _bf16_steps(value, exact, 2.0 ** -6 * exact.abs().max().item())
                verdict = None if steps.max() <= 1.5 else (
                    f"{name}: {what} on rank {rank} is {steps.max().item():.2f} bf16 steps off the exact result "
                    f"({int((steps > 1.5).sum())} of {steps.numel()} elements more than 1.5 steps): accumulate "
                    f"dK/dV in fp32 as it travels and round once, at home")
            if verdict:
                return verdict
        kv_bytes = 2 * k.numel() * k.element_size()
        v = _ring_verdict(name, group, calls, rank, kv_bytes, 2 * k.numel() * 4) or \
            _shifts_verdict(name, rank, calls, stamps, n)
        if v:
            return v
    return None


def check_ring_backward() -> str | None:
    return spawn(_ring, RING_WORLD)
