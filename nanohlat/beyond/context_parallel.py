"""Context parallelism: one sequence split over the cp ranks, attention across them.

Everything in a transformer block except attention treats the tokens of a sequence
independently: RMSNorm, the matmuls and the MLP work on each token alone. So a
long sequence can be cut into pieces, one piece per rank of the cp group, and
each rank runs the whole block on its piece only. Its activations are then those
of T/cp tokens. Attention is the exception: a token attends to every token before
it, wherever that token lives. This file holds the split and three ways to
compute exact causal attention across the pieces:

    allgather  all-gather K and V over the group, attend locally. Backward:
               reduce-scatter dK and dV. Simplest; with grouped-query attention
               K and V are small (Llama 3's choice).
    ring       K/V blocks travel round the group, one hop a step; each rank
               merges the partial results with an online softmax. No rank ever
               holds more than two blocks of K/V (a custom backward).
    ulysses    all-to-all from "my tokens, all heads" to "all tokens, my
               heads", one process's causal attention on heads/cp heads,
               all-to-all back. (What that asks of the model: tutorial question
               11.3; ulysses_attention refuses a layout it cannot split.)

All three compute only the (query, key) pairs the causal mask keeps, block by
block ("The blocks" below): a rank's two chunks against the key chunks, with no
mask below the diagonal, causal on it, skipped above it, each block through torch's
fused CPU kernel (fp32 matmuls elsewhere) and the partial results merged; none keeps
a mask or the repeated kv heads for the backward.

Shapes: B batch, H query heads, K kv heads, D head dim, T the whole sequence,
t = T/cp the tokens on one rank, n = cp. `positions` is the (n, t) table of every
rank's tokens' places in the whole sequence (`zigzag_positions`); every rank
holds the same table, so no rank needs to ask another where its tokens are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanohlat import comm
from nanohlat.mesh import Mesh, coords, rank_of

ALGORITHMS = ("allgather", "ring", "ulysses")


# ---------------------------------------------------------------------------
# The split: shift first, then zigzag
# ---------------------------------------------------------------------------
#
# Two mistakes are easy here. (1) Shift into (input, target) AFTER the split and
# the last token of each piece loses its target (it lives on another rank), so
# shift the whole sequence first: input = tokens[:-1], target = tokens[1:], then
# split both the same way. (2) Under the causal mask the token at position p
# attends to p + 1 tokens, so a contiguous split gives the later ranks more
# attention work than the earlier ones (how much, and what it costs the others:
# tutorial question 11.2). Zigzag cuts
# the sequence into 2n chunks and gives rank i chunks i and 2n-1-i: an early chunk
# and a late one, and every rank the same total work.
#
#   n = 2, T = 8:   chunks  [0 1] [2 3] [4 5] [6 7]
#                   rank 0 holds chunks 0 and 3: positions 0 1 6 7
#                   rank 1 holds chunks 1 and 2: positions 2 3 4 5


def zigzag_positions(T: int, cp: int) -> torch.Tensor:
    """(cp, T/cp) int64: row i holds the positions, in the whole sequence, of rank i's tokens."""
    if T % (2 * cp):
        raise ValueError(f"a sequence of {T} tokens does not split into 2 x cp = {2 * cp} equal chunks: "
                         f"make --seq-len a multiple of {2 * cp}")
    # exercise 11b: begin
    c = T // (2 * cp)   # tokens per chunk
    rows = [torch.cat([torch.arange(i * c, (i + 1) * c), torch.arange((2 * cp - 1 - i) * c, (2 * cp - i) * c)])
            for i in range(cp)]
    return torch.stack(rows)
    # exercise 11b: end


def contiguous_positions(T: int, cp: int) -> torch.Tensor:
    """(cp, T/cp): the naive split, rank i holding tokens i*t .. (i+1)*t - 1 (for comparison)."""
    return torch.arange(T).view(cp, T // cp)


class Context:
    """What a model's layers need to run context parallel (`apply`): the cp group and the
    algorithm. Every table comes from the number of tokens a rank holds."""

    def __init__(self, group, algorithm: str):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown cp attention {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.group, self.algorithm = group, algorithm

    def positions(self, t: int) -> torch.Tensor:
        """(cp, t): every rank's t tokens' places in the whole sequence of cp * t tokens."""
        return zigzag_positions(t * self.group.size, self.group.size)

    def token_positions(self, t: int) -> torch.Tensor:
        """This rank's t tokens' places in the whole sequence (t,), at which they are rotated
        (model.Transformer.token_positions, set by `apply`)."""
        return self.positions(t)[self.group.rank]

    def attention(self, q, k, v):
        """`attention` below with this rank's group, table and algorithm (--timeline: timed, tools/comm_trace.py)."""
        args = (q, k, v, self.group, self.positions(q.shape[2]), self.algorithm)
        return self.group.trace.timed(attention, *args) if self.group.trace else attention(*args)

    def __call__(self, q, k, v):
        """A layer's attention core (model.Attention.core, set by `apply`): `attention`."""
        return self.attention(q, k, v)


def apply(model, group, algorithm: str) -> Context:
    """Context parallelism on this rank's stage `model` (model.py's seams): every layer's attention core
    across the cp ranks of `group` by `algorithm`, and the rotary angles of each of this rank's tokens at
    its place in the whole sequence (Context.token_positions)."""
    ctx = Context(group, algorithm)
    for block in model.layers.values():
        block.attn.core = ctx
    model.token_positions = ctx.token_positions
    return ctx


def split_sequence(tokens: torch.Tensor, cp: int, rank: int):
    """tokens (B, T+1) -> this rank's (inputs, targets, positions): (B, T/cp), (B, T/cp), (T/cp,).
    The shift into (input, target) comes first, on the whole sequence (see above)."""
    # exercise 11b: begin
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = zigzag_positions(inputs.shape[1], cp)[rank]
    return inputs[:, positions], targets[:, positions], positions
    # exercise 11b: end


def attention(q, k, v, group, positions: torch.Tensor, algorithm: str):
    """Causal attention of this rank's queries over the whole sequence's keys.
    q (B, H, t, D), k and v (B, K, t, D), already rotated with this rank's
    positions (positions[group.rank]); returns (B, H, t, D) in q's dtype."""
    if algorithm == "allgather":
        return allgather_attention(q, k, v, group, positions)
    if algorithm == "ring":
        return RingAttention.apply(q, k, v, group, positions)
    if algorithm == "ulysses":
        return ulysses_attention(q, k, v, group, positions)
    raise ValueError(f"unknown cp attention {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")


# ---------------------------------------------------------------------------
# The mesh with a cp dimension. The cp ranks of one sequence talk in every layer's
# attention, so they sit next to the tp ranks: (cp, tp) together form the inner
# coordinate,
#
#     rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
#
# and every other kind of group is the cp = 1 mesh's, once for each cp rank
# (`lift`). Example dp 2, cp 2: cp groups [0 1] [2 3], dp groups [0 2] [1 3],
# dp_cp [0 1 2 3] (all four hold the same weights: gradients summed over them).
# ---------------------------------------------------------------------------

def lift(base_rank: int, cp_rank: int, tp: int, cp: int) -> int:
    """A rank of the cp = 1 mesh (same tp, pp, dp) -> that place at cp rank `cp_rank`."""
    outer, t = divmod(base_rank, tp)
    return (outer * cp + cp_rank) * tp + t


@dataclass
class ContextMesh(Mesh):
    """mesh.Mesh with a cp dimension between tp and dp: the groups 'cp' (the ranks sharing each
    sequence) and 'dp_cp' (those holding the same weights: the gradients' group, grad_kind), every
    other kind of mesh.py's lifted to each cp rank, and each rank's zigzag part of its sequences. A kind
    given in `extra` draws its groups from this mesh itself (schedules.wrap_groups lifts nothing it has
    not read from it; --ep carves dp x cp: moe.add_groups)."""

    cp: int = 1
    grad_kind = "dp_cp"

    def __post_init__(self):
        self.dp_rank, self.pp_rank, inner = coords(self.rank, self.tp * self.cp, self.pp, self.dp)
        self.cp_rank, self.tp_rank = divmod(inner, self.tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def kinds(self) -> tuple:
        return super().kinds() + ("cp", "dp_cp")

    def _all(self, kind: str) -> list[list[int]]:
        """Every group of one kind (each list in increasing order, as torch numbers a group)."""
        tp, pp, dp, cp = self.tp, self.pp, self.dp, self.cp
        if kind == "cp":
            return [[lift(b, c, tp, cp) for c in range(cp)] for b in range(tp * pp * dp)]
        if kind == "dp_cp":
            return [[lift(rank_of(d, p, t, tp, dp), c, tp, cp) for d in range(dp) for c in range(cp)]
                    for p in range(pp) for t in range(tp)]
        if kind in self.extra:   # (drawn from this mesh: mesh.Mesh.extra)
            return self.extra[kind](self)
        base = Mesh(tp, pp, dp, kv_replicas=self.kv_replicas)
        return [[lift(b, c, tp, cp) for b in ranks] for c in range(cp) for ranks in base._all(kind)]

    def stage_of(self, rank: int) -> int:
        return coords(rank, self.tp * self.cp, self.pp, self.dp)[1]

    def sequence_part(self, inputs, targets) -> tuple:
        """This cp rank's zigzag chunks of each sequence, (mb, T/cp) each; the shift into (input, target)
        came first, on the whole sequence (split_sequence)."""
        mine = zigzag_positions(inputs.shape[1], self.cp)[self.cp_rank]
        return inputs[:, mine], targets[:, mine]


# ---------------------------------------------------------------------------
# The blocks: what the causal mask hides is never computed
# ---------------------------------------------------------------------------
#
# Every algorithm below cuts the work the same way. A rank's t tokens are two
# zigzag chunks, and the keys are the sequence's 2n chunks. A (query chunk, key
# chunk) pair is one of three kinds:
#
#     skip      every key after every query: the causal mask hides it all, so nothing is computed
#     full      every key at or before every query: attention with no mask
#     diagonal  the query chunk against itself: plain causal attention (the fused kernel's is_causal)
#
#   n = 2, rank 0 (chunks 0 and 3):   key chunk  0     1     2     3
#                               query chunk 0   diag  skip  skip  skip
#                               query chunk 3   full  full  full  diag
#
# So no rank ever computes a (query, key) pair the mask hides, and none keeps a
# mask: the pairs it computes are the causal pairs of its tokens, the plan's
# "zigzag pairs" (plan/context.py). Each computed pair gives a partial
# result over its keys, and partial results over disjoint keys merge exactly.
#
# Softmax over all keys, one block of keys at a time. For one query row and one
# block b of its keys, with scores s_j = q.k_j / sqrt(D):
#
#     m_b   = max_j s_j                         (the block's max: keeps exp() finite)
#     l_b   = sum_j exp(s_j - m_b)
#     o_b   = sum_j exp(s_j - m_b) v_j / l_b    (the block's own softmax-weighted values)
#     lse_b = m_b + log l_b                     (log of sum_j exp(s_j): all a merge needs)
#
# Two blocks a, b merge exactly: o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b).
# Computed as written, e^lse overflows fp32 once a score passes about 88: how `merge`
# computes it without overflow, and the merged lse, is exercise 11a. All in fp32.


def _relation(q_pos: torch.Tensor, k_pos: torch.Tensor) -> str:
    """'skip' (every key after every query), 'full' (every key at or before every query) or
    'diagonal' (the same chunk: causal)."""
    if int(k_pos.min()) > int(q_pos.max()):
        return "skip"
    if int(k_pos.max()) <= int(q_pos.min()):
        return "full"
    if not torch.equal(q_pos, k_pos):
        raise ValueError("a query chunk and a key chunk overlap without being the same chunk: the positions "
                         "table is not one of whole chunks (zigzag_positions)")
    return "diagonal"


def _pairs(q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The (query chunk a, key chunk b, causal) pairs of two chunks each that are not skipped."""
    for a, qp in enumerate(q_pos.chunk(2)):
        for b, kp in enumerate(k_pos.chunk(2)):
            rel = _relation(qp, kp)
            if rel != "skip":
                yield a, b, rel == "diagonal"


def merge(o_a, lse_a, o_b, lse_b):
    """Two partial results for the same queries over disjoint keys -> the result over both."""
    # exercise 11a: begin
    # lse = log(e^lse_a + e^lse_b), o = (e^lse_a o_a + e^lse_b o_b) / e^lse, computed with
    # e^(lse_a - m), e^(lse_b - m), m = max(lse_a, lse_b) (the running max): nothing overflows
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / total.clamp_min(1e-30)[..., None]
    return o, m + torch.log(total)
    # exercise 11a: end


# One pair's arithmetic. On the CPU it is torch's fused flash-attention kernel
# (aten::_scaled_dot_product_flash_attention_for_cpu), which returns each row's
# log-sum-exp beside its output, and whose backward, given the FINAL merged output
# and log-sum-exp, rebuilds P = exp(S - lse) and delta = rowsum(dO * O) of the whole
# softmax: a pair's backward is then exactly its share of dQ, dK, dV (FlashAttention-2's
# backward, which the ring needs). Where that kernel is absent (cuda, xla) a pair is
# two fp32 matmuls and a softmax (_block, _block_grads), its scores recomputed in the
# backward. Either way every pair runs in fp32 (bf16 inputs are cast), so a merge adds
# no rounding, and the kernel needs the kv heads repeated to the query heads: done
# here, per pair, and never kept (the backward repeats them again and sums dK, dV over
# the query heads that share each kv head).

FUSED = True   # the CPU kernel where torch has it (tests turn it off to check _block, _block_grads)


def _fused(x: torch.Tensor) -> bool:
    return _fused_on(x.device.type)


def _fused_on(device_type: str) -> bool:
    return FUSED and device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def kernel(device_type: str) -> str:
    """What a pair's arithmetic is on `device_type` (--timeline and the cp benchmark say it)."""
    if _fused_on(device_type):
        return "torch's fused flash-attention kernel, with its log-sum-exp"
    return f"fp32 matmul blocks, {ROWS} query rows at a time (no fused kernel with a log-sum-exp here)"


def _expand(kv, H):
    """(B, K, ., D) -> (B, H, ., D) in fp32: each kv head repeated for the query heads that share it."""
    return kv.float().repeat_interleave(H // kv.shape[1], dim=1)


def _fold(g, K):
    """(B, H, ., D) -> (B, K, ., D): the gradient of each kv head, summed over the query heads sharing it
    (kv head i's are i*rep .. i*rep + rep-1: query heads j, j + rep, ... are one of each)."""
    rep = g.shape[1] // K
    return sum((g[:, j::rep] for j in range(1, rep)), g[:, ::rep])


def _attend(q, k, v, causal: bool):
    """One pair: q (B, H, tq, D) against k, v (B, K, tk, D) -> (o fp32 (B, H, tq, D), lse fp32 (B, H, tq)).
    causal: the diagonal pair (tq = tk, the same positions)."""
    q, k, v = q.float(), _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return _block(q, k, v, causal)


def _attend_grads(q, dout, out, lse, k, v, causal: bool):
    """One pair's share of dQ (B, H, tq, D), dK and dV (B, K, tk, D), fp32, from the final out and lse of
    its queries (over all their keys) and the output's gradient dout (fp32)."""
    H, K = q.shape[1], k.shape[1]
    q, kx, vx = q.float(), _expand(k, H), _expand(v, H)
    if _fused(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kx, vx, out, lse, 0.0, causal)
    else:
        dq, dk, dv = _block_grads(q, dout, out, lse, kx, vx, causal)
    return dq, _fold(dk, K), _fold(dv, K)


ROWS = 1024   # the fp32-matmul path's query rows at a time: its scores (B, H, ROWS, tk) are all it makes


def _block(q, k, v, causal):
    """One pair in fp32 matmuls (no fused kernel): (o_b, lse_b) as derived above, ROWS query rows at a time."""
    outs, lses = [], []
    for i in range(0, q.shape[2], ROWS):   # rows i .. : a causal row r sees keys 0 .. i + r
        s = q[:, :, i:i + ROWS] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).tril(i).logical_not(), float("-inf"))
        outs.append(torch.softmax(s, -1) @ v)
        lses.append(torch.logsumexp(s, -1))   # (every row has a key: none is skipped)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _block_grads(q, dout, out, lse, k, v, causal):
    """One pair's share of dQ, dK, dV in fp32 matmuls: flash attention's backward, with P = exp(S - lse)
    the final softmax and delta = rowsum(dO * O) of the final output, ROWS query rows at a time:
        dV = P^T dO     dP = dO V^T     dS = P * (dP - delta)
        dQ = dS K / sqrt(D)             dK = dS^T Q / sqrt(D)"""
    scale = 1 / math.sqrt(q.shape[-1])
    dq, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for i in range(0, q.shape[2], ROWS):
        rows = slice(i, i + ROWS)
        p = torch.exp(q[:, :, rows] @ k.transpose(-1, -2) * scale - lse[:, :, rows, None])
        if causal:
            p = p.tril(i)
        d = dout[:, :, rows]
        ds = p * (d @ v.transpose(-1, -2) - (d * out[:, :, rows]).sum(-1, keepdim=True))
        dq.append(ds @ k * scale)
        dk += ds.transpose(-1, -2) @ q[:, :, rows] * scale
        dv += p.transpose(-1, -2) @ d
    return torch.cat(dq, 2), dk, dv


class LocalAttention(torch.autograd.Function):
    """Causal attention of query chunks whose keys are all on this rank, in position order (allgather's
    gathered K/V, ulysses' whole sequence): the query chunk at positions s .. s+c-1 attends to the keys
    before it, [0, s), in one full pair, and to its own chunk [s, s+c) causally, the two merged; the keys
    after it are never touched. Keeps q, k, v as given (kv heads not repeated), the fp32 output and its
    log-sum-exp; the backward gives each pair its share (`_attend_grads`)."""

    @staticmethod
    def forward(ctx, q, k, v, starts):
        outs, lses = [], []
        for qc, s in zip(q.chunk(len(starts), dim=2), starts):
            c = qc.shape[2]
            o, lse = _attend(qc, k[:, :, s:s + c], v[:, :, s:s + c], causal=True)   # the diagonal pair
            if s > 0:                                                                # the full pair before it
                o, lse = merge(o, lse, *_attend(qc, k[:, :, :s], v[:, :, :s], causal=False))
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.starts = starts
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        n = len(ctx.starts)
        dq = []
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for qc, dc, oc, lc, s in zip(q.chunk(n, 2), grad.float().chunk(n, 2), out.chunk(n, 2), lse.chunk(n, 2),
                                     ctx.starts):
            c = qc.shape[2]
            g_q, g_k, g_v = _attend_grads(qc, dc, oc, lc, k[:, :, s:s + c], v[:, :, s:s + c], causal=True)
            dk[:, :, s:s + c] += g_k
            dv[:, :, s:s + c] += g_v
            if s > 0:
                g_before, g_k, g_v = _attend_grads(qc, dc, oc, lc, k[:, :, :s], v[:, :, :s], causal=False)
                g_q = g_q + g_before
                dk[:, :, :s] += g_k
                dv[:, :, :s] += g_v
            dq.append(g_q)
        return torch.cat(dq, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _chunk_order(positions: torch.Tensor) -> list[int]:
    """The 2n chunks as gathered (rank 0's two, then rank 1's, ...) in their order in the sequence:
    torch.cat([chunks[i] for i in order]) is position order."""
    return positions.view(2 * positions.shape[0], -1)[:, 0].argsort().tolist()


def _in_order(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """x's 2n chunks along dim 2, rearranged: chunk i of the result is chunk order[i] of x."""
    chunks = x.chunk(len(order), dim=2)
    return torch.cat([chunks[i] for i in order], dim=2)


# ---------------------------------------------------------------------------
# allgather: everyone gets all of K and V
# ---------------------------------------------------------------------------

class _GatherSeq(torch.autograd.Function):
    """Forward all-gather along the sequence (dim 2); backward reduce-scatter: every rank's
    queries put gradient on every key, and the sum of it belongs to the key's own rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=2, what="fwd [K;V]")

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g, ctx.group, dim=2, what="bwd d[K;V]"), None


def allgather_attention(q, k, v, group, positions):
    K = k.shape[1]
    kv = _GatherSeq.apply(torch.cat([k, v], dim=1), group)     # one gather for both: (B, 2K, T, D), rank order
    kv = _in_order(kv, _chunk_order(positions))                 # the whole sequence's K/V in position order
    starts = [int(p[0]) for p in positions[group.rank].chunk(2)]   # where this rank's two chunks begin
    return LocalAttention.apply(q, kv[:, :K], kv[:, K:], starts)


# ---------------------------------------------------------------------------
# ulysses: trade the sequence split for a head split, and back
# ---------------------------------------------------------------------------

def all_to_all_pieces(x: torch.Tensor, group, split_dim: int, cat_dim: int, what=None) -> torch.Tensor:
    """Cut x into group.size equal pieces along `split_dim`, send piece j to rank j, and
    concatenate the pieces received, in rank order, along `cat_dim`: comm.all_to_all with one
    row a rank. Its own inverse with the two dims swapped (Ulysses goes sequence -> heads and
    back with it)."""
    if group.size == 1:
        return x
    pieces = torch.stack(x.chunk(group.size, dim=split_dim))   # (n, ...): piece j for rank j
    out = comm.all_to_all(pieces, [1] * group.size, [1] * group.size, group, what)
    return torch.cat(out.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    """Forward all-to-all (split one dim, gather another); backward the inverse: the same with them swapped."""

    @staticmethod
    def forward(ctx, x, group, split_dim, cat_dim, what):
        ctx.args = (group, cat_dim, split_dim, what[1])         # (what: its names in --timeline, forward and back)
        return all_to_all_pieces(x, group, split_dim, cat_dim, what[0])

    @staticmethod
    def backward(ctx, g):
        return all_to_all_pieces(g, *ctx.args), None, None, None, None


def ulysses_attention(q, k, v, group, positions):
    n, H, K = group.size, q.shape[1], k.shape[1]
    if H % n or K % n:
        raise ValueError(f"ulysses attention needs the heads ({H}) and kv heads ({K}) on a rank divisible by "
                         f"cp {n}: use --cp-attention allgather or ring, or another cp")
    h, kh = H // n, K // n
    # (B, n, h + 2kh, t, D): along dim 1, piece j is what rank j gets: query heads j*h .. (j+1)*h - 1
    # and the kv heads they use (kv head of query head i is i // (H/K), so kv heads j*kh .. (j+1)*kh - 1)
    x = torch.cat([q.unflatten(1, (n, h)), k.unflatten(1, (n, kh)), v.unflatten(1, (n, kh))], dim=2)
    x = _AllToAll.apply(x, group, 1, 3, ("fwd qkv>heads", "bwd dqkv>seq")).squeeze(1)   # (B, h + 2kh, T, D)
    order = _chunk_order(positions)
    q_mine, k_mine, v_mine = _in_order(x, order).split([h, kh, kh], dim=1)   # all tokens in position order, my heads
    y = LocalAttention.apply(q_mine, k_mine, v_mine, [0])                    # one process's causal attention
    y = _in_order(y, sorted(range(len(order)), key=order.__getitem__))      # (B, h, T, D) back in rank order
    return _AllToAll.apply(y, group, 2, 1, ("fwd out>seq", "bwd dout>heads"))   # back: (B, H, t, D), heads in order again


# ---------------------------------------------------------------------------
# ring: K/V blocks go round, partial results merge with an online softmax
# ---------------------------------------------------------------------------
#
# Each K/V block is a rank's two zigzag chunks, so at every step a rank meets four
# (query chunk, key chunk) pairs and computes those `_pairs` does not skip, merging
# each into what it had (`merge`). The backward is FlashAttention-2's: from the final
# output and log-sum-exp, each pair's share of dQ, dK, dV (`_attend_grads`).


class RingAttention(torch.autograd.Function):
    """Forward: step s (0 .. n-1) attends to the K/V block of rank (me - s) mod n, while the
    next block is already on its way (the send and receive overlap the arithmetic).
    Backward: the K/V blocks go round the other way, each with the dK/dV accumulated for it
    so far; every rank adds its queries' part and passes both on, and a last hop brings each
    block's dK/dV home. dK/dV travel in fp32, so the ring adds no bf16 rounding per hop."""

    @staticmethod
    def forward(ctx, q, k, v, group, positions):
        n, me = group.size, group.rank
        q_chunks, q_pos = q.chunk(2, dim=2), positions[me]
        out, lse = [None, None], [None, None]
        kv = torch.stack([k, v])                                    # one message: (2, B, K, t, D)
        for s in range(n):
            if s < n - 1:
                arriving, handles = comm.start_ring_shift(kv, group, +1, f"fwd K/V {s + 1}/{n - 1}")
            k_chunks, v_chunks = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for a, b, causal in _pairs(q_pos, positions[(me - s) % n]):
                o, l = _attend(q_chunks[a], k_chunks[b], v_chunks[b], causal)
                out[a], lse[a] = (o, l) if out[a] is None else merge(out[a], lse[a], o, l)
            if s < n - 1:
                for h in handles:
                    h.wait()
                kv = arriving
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)    # (B, H, t, D), (B, H, t): fp32
        ctx.group, ctx.positions = group, positions
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, positions = ctx.group, ctx.positions
        n, me = group.size, group.rank
        q_pos = positions[me]
        qc, dc, oc, lc = q.float().chunk(2, 2), grad.float().chunk(2, 2), out.chunk(2, 2), lse.chunk(2, 2)
        dq = [torch.zeros_like(c) for c in qc]
        # exercise 11c: begin
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)   # travels with its block
        for s in range(n):
            if s < n - 1:
                arriving, handles = comm.start_ring_shift(kv, group, -1, f"bwd K/V {s + 1}/{n - 1}")
            kc, vc = kv[0].float().chunk(2, 2), kv[1].float().chunk(2, 2)
            dk, dv = list(dkv[0].chunk(2, 2)), list(dkv[1].chunk(2, 2))   # views: += writes into dkv
            for a, b, causal in _pairs(q_pos, positions[(me + s) % n]):
                g_q, g_k, g_v = _attend_grads(qc[a], dc[a], oc[a], lc[a], kc[b], vc[b], causal)
                dq[a] += g_q
                dk[b] += g_k
                dv[b] += g_v
            # this block's dK/dV goes on with it; after the last step, the hop home
            dkv, dkv_handles = comm.start_ring_shift(dkv, group, -1, f"bwd dK/dV {s + 1}/{n}")
            for h in dkv_handles + (handles if s < n - 1 else []):
                h.wait()
            if s < n - 1:
                kv = arriving
        return torch.cat(dq, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
        # exercise 11c: end
