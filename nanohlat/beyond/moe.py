"""Mixture of experts: a feed-forward block in which each token uses k of E expert MLPs.

A dense block runs every token through one SwiGLU MLP. A mixture-of-experts
(MoE) block holds E of them, the *experts*, and a *router* that picks k for
each token (Shazeer et al. 2017; GShard; Switch; Mixtral uses E 8, k 2):

    x (N tokens, C) -> router: logits = x W_r^T (N, E), p = softmax(logits)
                    -> top-k:  each token's k likeliest experts, their p renormalised to sum to 1
                    -> dispatch: send each token to its k experts
                    -> each expert e: SwiGLU_e(its tokens)
                    -> combine: y_t = sum over t's k experts of weight * SwiGLU_e(x_t)
                       (+ the shared experts, which every token uses: --moe-shared-experts)

The parameters grow E times, the compute per token only k times: that is the
point. The price is balance: a router left alone sends most tokens to a few
experts (the rest never learn), so training adds two small losses to the
language-model loss:

  * the load-balancing loss (Switch, GShard): E * sum_e f_e * P_e, where f_e
    is the share of the k*N routing choices that went to expert e and P_e the
    mean router probability of e. It is 1 when both are uniform (1/E each) and
    larger when the router favours some experts; f_e counts choices and has no
    gradient, so the gradient flows through P_e, pushing probability away from
    the experts that got more than their share. Coefficient --moe-aux-coef.
  * the router z-loss (ST-MoE): the mean of logsumexp(logits)^2, which keeps
    the router's logits small (large ones make its softmax, and bf16, brittle).
    Coefficient --moe-z-coef.

Or balance without a loss (DeepSeek-V3, --moe-bias-rate r): each sparse layer
keeps a bias per expert, b (E,), state and not a parameter. The router chooses
each token's k experts by p + b and weighs them by p alone, as without it; after
every optimizer step b_e moves by r towards balance (+r if e got fewer than its
share of the global batch's routing choices, -r if more: `update_bias`). The
language model's gradient never sees it, so balance costs it nothing but the
routing; the loads are summed over every rank that saw other tokens (tp with SP,
dp x cp, pp's stages; `Figures.move_biases`), so every layout moves b by the same
counts as one process, bit for bit, for as long as its routing is one
process's: tests/beyond/test_moe_bias.py holds dp 2 and ep 2 to one process's biases
bit for bit over 6 steps. Not for ever: a layout's weights differ from one
process's by round-off, and a token whose two likeliest experts are that close
can go to the other one, which moves two counts by one and can turn a bias's
step. Measured at cp 2 x ep 2 (moe preset, r 1e-3, no balance loss, 60 steps):
the logged loads first differ at step 36, the biases are equal at steps 20 and
40 and at step 60 two of 16 differ, by one and two steps of r. The scale: b is
added to softmax probabilities (mean 1/E), where DeepSeek-V3 adds its bias to
sigmoid scores (about 0.5), so its rate of 1e-3 corresponds to about 2e-3 / E
here. It is saved in checkpoints with the weights (run/checkpoint) and Mixtral,
whose router has none, refuses it on export (serving/hf.py).

Both losses are computed per *sequence* (f_e, P_e over one sequence's T tokens; as
DeepSeek-V3's sequence-wise balance loss) and then averaged over sequences
(why not over a micro-batch's tokens is tutorial question 10.3: its answer is
in the tutorial's Solutions and docs/design.md 5). `route` returns them per
sequence; each MoE layer puts them into the backward where it makes them, with
their weight in the training objective (`RouterLoss`), so they need no path of
their own to the loss; the run logs the language model's loss as `loss` and the
router losses beside it (`moe_router_loss`, from the step's `Figures`).

Dispatch, two ways (`MoE.capacity_factor`):

  * dropless (capacity factor 0, the default): every routed token is computed.
    The N*k (token, expert) pairs are sorted by expert, so that each expert's
    tokens are one contiguous slice, and each expert multiplies its slice: E
    matmuls of data-dependent sizes (`dispatch_sorted`), or where the slices are
    small, each projection of all E slices in one grouped matmul where torch has
    one (`swiglu_slices`). `dispatch_loop` is the plain per-expert loop (find
    expert e's tokens, compute, add back) that the tests compare it with, for
    equality and speed (python -m nanohlat.bench.moe_dispatch times them).
  * capacity (factor c > 0): each expert takes at most C = ceil(c * N * k / E)
    tokens, in a fixed-size (E, C, d) buffer: every shape is known before the
    step runs, which XLA (and trn1) need, since a new shape is a new compiled
    graph. The drop rule: choices are served in order of rank (every token's
    first choice before any second choice), then in token order; a choice that
    finds its expert full is dropped (that expert adds nothing to the token,
    whose other choices and residual stream still do; the weights are not
    renormalised again). `dispatch_capacity` returns the dropped fraction,
    which is logged. N is what one rank routes in one micro-batch (with SP its
    T/tp share of each sequence, with --cp its T/cp): unlike dropless, what is
    dropped depends on the layout (at dp 2 each half of the batch fills its own queues).

Experts are replicated on every rank, like the dense weights: with data
parallelism their gradients are all-reduced over dp with the rest. Or, with
expert parallelism (--ep N, carved out of dp: `add_groups` below), each
group of N neighbouring dp ranks shares the E experts, E/N each, and tokens
travel to their experts' ranks and back (`dispatch_expert_parallel`; in
capacity mode each rank's fixed queues do, `capacity_expert_parallel`); an
expert's gradient is then summed over the dp/N ranks holding the same experts
(optim.py; ZeRO-1, 2 and 3 shard their state over those ranks).

With tensor parallelism (--tp) the router and the experts are replicated over
the tp group, as the norms are: every tp rank computes the whole block on the
tokens it holds. Without sequence parallelism those are all T tokens, the same
on every tp rank, and so are the gradients; with it (--sequence-parallel) each
rank routes its T/tp tokens, so the router's sums over a sequence (f_e, P_e,
z) add up over tp (`route`'s seq_group) and the gradients, partial, too
(optim.py). Splitting each expert over tp is the other choice (Megatron's
expert tensor parallelism); replication keeps tp out of this block but for
the router's sums. Its price: every tp rank holds all E experts, and under SP
all-reduces their gradients over tp each step (without SP it computes them
on every token, as each of its tp peers does).
With context parallelism (--cp) each cp rank routes its zigzag T/cp tokens of
every sequence, and the router's sums over a sequence add up over the cp
ranks as over tp under SP (`route`'s seq_group: the cp group, and the tp group
too under SP); the gradients, partial, are summed over dp x cp with every
other weight's. Expert parallelism then carves its groups out of dp x cp, the
ranks holding the same weights (`add_groups`): at --cp 2 --ep 2 the two cp
ranks of a sequence share the experts.
With pipeline parallelism the router losses of a chunk before the last enter
its backward as at pp 1, by the same RouterLoss. Mixtral's shape exports (serving/hf.py).
Shapes: N tokens, C d_model, E experts, k chosen per token, F ffn_dim of one expert.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanohlat import comm, shard_spec
from nanohlat.comm import Group
from nanohlat.mesh import rank_of
from nanohlat.beyond.moe_figures import Figures, step_metrics, tally, update_bias  # noqa: F401 (moe.X, as before)


ONE = Group("ep", [0], 0)   # expert parallelism of one rank: every expert here, no collective


class Weight(nn.Module):
    """One parameter `weight` of the given shape, replicated on every rank: the
    router (E, C), or the gate, up or down matrices of all experts stacked
    (E, F, C) / (E, C, F). Named like the dense MLP's linears, so that
    model.full_init initialises them alike (`...mlp.down.weight` is scaled down)."""

    def __init__(self, *shape: int, ep: int = 1, ep_rank: int = 0, sequence_parallel: bool = False):
        super().__init__()
        sp = sequence_parallel   # (its tp ranks saw other tokens: their gradients add up over tp, optim.py)
        if ep == 1:
            self.weight = shard_spec._param(shape, None, 1, sequence_parallel=sp)
        else:   # expert parallelism: this rank's E/ep experts of the full (E, ...) stack
            self.weight = shard_spec._param(shape, 0, ep, ep_rank, sequence_parallel=sp, group="ep")


def swiglu(x, gate, up, down):
    """One expert: down(silu(gate x) * up x). x (n, C); gate, up (F, C); down (C, F)."""
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


class _SumOver(torch.autograd.Function):
    """The router's sums over a sequence whose tokens several ranks share: forward all-reduce, backward
    identity (tensor_parallel.reduce_sum's), named "router sums" for --timeline's cp rows."""

    @staticmethod
    def forward(ctx, t, group):
        return comm.all_reduce(t, group, what="router sums")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def route(x, w_router, k: int, seq_group=None, bias=None):
    """The router. x (B, T, C), w_router (E, C) -> (experts, weights, balance, z):

    experts (B, T, k)  int64: each token's k chosen experts, likeliest first (bias: highest p + bias first)
    weights (B, T, k)  x's dtype (bf16 under --precision bf16): their softmax probabilities
                       renormalised over the k (Mixtral), never the bias, computed in fp32 and cast once at the end
    balance (B,)       fp32 at least: each sequence's load-balancing loss E * sum_e f_e P_e
    z       (B,)       fp32 at least: each sequence's router z-loss, mean over its tokens of logsumexp^2

    Everything from the logits on (the matmul included) in fp32 at least, whatever the model's
    precision: a softmax over bf16 logits ties too often, and bf16 logits move the losses.
    seq_group: with sequence parallelism x holds T/tp of each sequence's tokens, and the
    sums over a sequence add up over this tp group (forward all-reduce, backward identity);
    a tuple of groups, each holding a share of the tokens (--cp: the cp group, and with SP the
    tp group too: T/(cp tp) tokens here), adds them up over each in turn.
    bias (E,): balancing without a loss (--moe-bias-rate, `update_bias`): added to p for choosing
    the k only, so it moves tokens between experts without entering the weights or the gradient."""
    E, dtype = w_router.shape[0], torch.promote_types(x.dtype, torch.float32)
    groups = seq_group if isinstance(seq_group, tuple) else (() if seq_group is None else (seq_group,))
    T = x.shape[1] * math.prod([g.size for g in groups])           # the whole sequence's tokens

    def over_sequence(t):   # (B, T or a share of it, ...) -> (B, ...): the sum over the sequence's tokens
        t = t.sum(dim=1)
        for g in groups:
            t = _SumOver.apply(t, g) if g.size > 1 else t
        return t
    # exercise 10a: begin
    logits = x.to(dtype) @ w_router.to(dtype).t()                  # (B, T, E)
    lse = torch.logsumexp(logits, dim=-1)                          # (B, T): the softmax's normaliser, and z's
    probs = (logits - lse.unsqueeze(-1)).exp()                     # (B, T, E): softmax, = exp(logits) / exp(lse)
    top_p, experts = probs.topk(k, dim=-1)                         # (B, T, k), likeliest first
    if bias is not None:   # (DeepSeek-V3) p + bias chooses the k, highest first; p alone weighs them
        experts = (probs + bias).topk(k, dim=-1).indices
        top_p = probs.gather(-1, experts)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)              # renormalised over the chosen k
    # f_e: share of the sequence's T*k choices that picked e (counts: no gradient)
    chosen = torch.zeros_like(probs).scatter_(-1, experts, 1.0)    # (B, T, E): 1 where e is among t's k
    f = over_sequence(chosen) / (T * k)                            # (B, E), sums to 1 per sequence
    P = over_sequence(probs) / T                                   # (B, E), sums to 1 per sequence
    balance = E * (f * P).sum(dim=-1)                              # (B,)
    z = over_sequence(lse.pow(2)) / T                              # (B,)
    return experts, weights.to(x.dtype), balance, z
    # exercise 10a: end


# The experts' weights are stacked, (E, F, C). Where a dispatch computes expert by expert
# (dispatch_loop, swiglu_slices slice by slice) it takes every expert's own as a view, with
# unbind, whose backward stacks the E experts' gradients into one (E, F, C) tensor: O(E F C)
# work. Indexing the stack instead (gate[e]) gives each expert's backward a zero gradient the size
# of the whole stack with its slice filled, E of them added up: O(E^2 F C), what dominates the
# backward once E is in the tens.

def per_expert(flat, n_experts: int):
    """How many of the choices `flat` (int64) went to each of n_experts: bincount's numbers, in a tensor of a
    shape known before the step runs (bincount's size follows the largest id: a shape --compile cannot trace)."""
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


def dispatch_loop(x, experts, weights, gate, up, down):
    """The plain reference: for each expert, find its tokens, compute them, add them back.
    x (N, C); experts, weights (N, k); gate, up (E, F, C); down (E, C, F) -> y (N, C)."""
    y = torch.zeros_like(x)
    gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)   # each expert's weights, views (above)
    for e in range(gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)        # which tokens chose e, as which choice
        if token.numel():
            out = swiglu(x[token], gates[e], ups[e], downs[e])
            y = y.index_add(0, token, out * weights[token, slot].unsqueeze(-1))
    return y


def dispatch_sorted(x, experts, weights, gate, up, down):
    """Dropless: sort the N*k (token, expert) choices by expert, so each expert's
    tokens are one contiguous slice; each expert's SwiGLU on its slice (`swiglu_slices(xs,
    counts, gate, up, down)`, below: xs the N*k rows in that order, counts the E slices'
    sizes, zeros included, a list or an (E,) tensor: `per_expert`'s tensor keeps --compile's graph
    whole, where a list is a host read, a graph break; returns (N*k, C), row i its expert's SwiGLU of xs[i]);
    combine. Same arguments and result as `dispatch_loop`. The model's dropless dispatch
    (without --ep)."""
    # exercise 10b: begin
    N, k = experts.shape
    flat = experts.reshape(-1)                                     # choice j = token j // k, rank j % k
    order = flat.argsort(stable=True)                              # choices grouped by expert, token order inside
    token = order // k
    xs = x[token]                                                  # (N*k, C): the permuted tokens
    counts = per_expert(flat, gate.shape[0])                       # (E,) tokens per expert
    out = swiglu_slices(xs, counts, gate, up, down)                # (N*k, C): expert e's SwiGLU on slice e
    out = out * weights.reshape(-1)[order].unsqueeze(-1)           # each scaled by its weight
    return torch.zeros_like(x).index_add(0, token, out)            # the inverse permutation: sum back per token
    # exercise 10b: end


# One matmul per expert's slice costs a fixed overhead each (a call, its autograd node, three in
# the forward and six in the backward per expert), which at E 64 and small experts is most of the
# time. A grouped matmul computes every expert's slice times its own matrix in one call
# (F.grouped_mm, torch >= 2.10: rows [ends[e-1], ends[e]) of the input use matrix e), and the gate
# and up projections share one (their matrices side by side, (E, 2F, C)). On the CPU its kernel is
# slower per multiply-add than one large matmul, so it pays only where the slices are small.
# Measured on a 2-core CPU, fp32, C 64, forward + backward of the dispatch, against one matmul per
# slice, with 1 thread / 2 threads: 32 rows x F 16 per expert (E 64, k 8) 0.44x / 0.48x the time,
# 128 rows x F 128 (the moe preset's, E 4, k 2) 0.93x / 0.85x, 256 x F 128 1.01x / 0.96x, 512 x
# F 128 1.05x / 0.99x. swiglu_slices computes that way where torch has one for these tensors and
# slices are below GROUPED_BELOW: small or fine-grained experts.

GROUPED_BELOW = 2 ** 21   # multiply-adds of the mean expert's slice, rows x F x C (2M: 256 x 128 x 64)


def grouped_by_shape(device: str, fp32: bool, rows: float, Fd: int, C: int) -> bool:
    """`grouped`'s rule on the shapes alone (what --plan can know: plan/memory.py): torch >= 2.10,
    the CPU, fp32, F and C multiples of 4, `rows` x F x C below GROUPED_BELOW."""
    return (hasattr(F, "grouped_mm") and device == "cpu" and fp32 and Fd % 4 == 0 and C % 4 == 0
            and rows * Fd * C < GROUPED_BELOW)


def grouped(x, *stacks, rows: float = 0.0) -> bool:
    """Whether to use F.grouped_mm for x (N, C) and the stacked (E, F, C) weights, `rows` per expert
    on average: grouped_by_shape, and every row and matrix 16-byte aligned (what its kernel asks).
    While torch.compile traces, tensors have no address: the shapes alone decide (the CPU's kernel
    computes unaligned operands alike: tests/beyond/test_moe_router_and_dispatch.py)."""
    E, Fd, C = stacks[0].shape
    return (grouped_by_shape(x.device.type, x.dtype == torch.float32, rows, Fd, C)
            and all(t.dtype == torch.float32 and t.shape[-1] % 4 == 0 and t.shape[-2] % 4 == 0 for t in stacks)
            and (torch.compiler.is_compiling() or all(t.data_ptr() % 16 == 0 for t in stacks)))


def swiglu_slices(xs, counts, gate, up, down, parts=None):
    """Expert e's SwiGLU on its slice of xs (N*k, C), the slices in expert order, counts[e] rows
    each (a list, or an (E,) tensor: then the grouped matmul needs no host read and --compile
    captures it). One grouped matmul per projection where `grouped`; else one SwiGLU per slice, on
    unbind's views (above). Every expert runs, on no tokens too: its gradient is then zeros, not
    missing (the overlapped gradient reduction waits for every parameter's, data_parallel.py).
    `parts` (--ep): each slice's rows by the rank they came from, parts[e][r] (what an FP8 expert
    scales apart: beyond/fp8_experts.py; each row's SwiGLU here is its own)."""
    if not grouped(xs, gate, up, down, rows=xs.shape[0] / len(counts)):
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts   # (the host reads them)
        gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)
        return torch.cat([swiglu(c, gates[e], ups[e], downs[e]) for e, c in enumerate(xs.split(counts))])
    ends = torch.as_tensor(counts, device=xs.device).cumsum(0).to(torch.int32)   # slice e ends at row ends[e]
    gate_up = torch.cat([gate, up], dim=1)                         # (E, 2F, C): both in one grouped matmul
    mm = torch.ops.nanohlat.grouped_mm if torch.compiler.is_compiling() else grouped_mm
    g, u = mm(xs, gate_up.transpose(1, 2), ends).chunk(2, dim=-1)
    return mm(F.silu(g) * u, down.transpose(1, 2), ends)


def grouped_mm(a, b, ends):
    """Rows [ends[e-1], ends[e]) of a (N, K) times b[e] (K, M): (N, M), in one call (F.grouped_mm)."""
    return F.grouped_mm(a, b, offs=ends)


# --compile: Dynamo cannot trace F.grouped_mm in fp32 on the CPU (torch 2.13's shape function asks for
# bf16), so under torch.compile the grouped matmul is an op of nanohlat's own that the graph holds whole,
# its output's shape declared (register_fake), its backward the two grouped matmuls of the gradients: the
# router, the sort and the combine around it compile with the rest of the stage (transformers' Mixtral wraps
# its grouped matmul the same way).
if hasattr(F, "grouped_mm") and not hasattr(torch.ops.nanohlat, "grouped_mm"):   # (once per process)
    _ARGS = "(Tensor a, Tensor b, Tensor ends) -> Tensor"
    _op = torch.library.custom_op("nanohlat::grouped_mm", grouped_mm, mutates_args=(), schema=_ARGS)
    _op.register_fake(lambda a, b, ends: a.new_empty(a.shape[0], b.shape[-1]))
    # its gradient for b: (E, K, M), expert e's a_e^T grad_e (F.grouped_mm splitting the N rows)
    _weight_grad = torch.library.custom_op("nanohlat::grouped_mm_weight_grad", mutates_args=(), schema=_ARGS)(
        lambda a, grad, ends: F.grouped_mm(a.t(), grad, offs=ends))
    _weight_grad.register_fake(lambda a, grad, ends: a.new_empty(ends.shape[0], a.shape[1], grad.shape[1]))

    def _keep(ctx, inputs, output):
        ctx.a, ctx.b, ctx.ends = inputs

    _op.register_autograd(lambda ctx, grad: (_op(grad, ctx.b.transpose(-2, -1), ctx.ends),
                                             _weight_grad(ctx.a, grad, ctx.ends), None), setup_context=_keep)


class _AllToAll(torch.autograd.Function):
    """comm.all_to_all as an autograd function: its backward sends each row's
    gradient back the way the row came (the same call, send and recv swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def dispatch_expert_parallel(x, experts, weights, gate, up, down, group, slices=None):
    """Dropless with the E experts spread over the ep ranks of `group`, E/ep each
    (rank r holds experts r*E/ep ... (r+1)*E/ep - 1: gate, up, down are its slice).
    Each rank routes its own tokens; then, as `dispatch_sorted` but across ranks:

      1. sort this rank's N*k choices by expert: the choices for rank r's experts are
         one contiguous run, since its experts are consecutive;
      2. the counts go first (an all-to-all of E/ep numbers per rank pair), so that
         every rank knows how many rows it will receive, from whom, for which expert;
      3. all-to-all the tokens: each run goes to the rank holding its experts;
      4. each rank groups what it received by local expert, computes it, ungroups;
      5. all-to-all back (the same splits, reversed), weight and sum per token.

    The same result as dispatch_sorted on the whole group's tokens with all E
    experts, and (through _AllToAll's backward) the same gradients; each expert's
    gradient, on the one rank of the group that holds it, sums over every token
    of the group routed to it. `slices`: the experts' SwiGLU on their slices (swiglu_slices, or
    MoE.slices), told each slice's rows by source rank. A group of one rank is dispatch_sorted."""
    N, k = experts.shape
    ep, local = group.size, gate.shape[0]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)                              # 1. by expert: by destination rank too
    token = order // k
    counts = torch.bincount(flat, minlength=ep * local)            # (E,) choices per global expert
    got_counts = comm.all_to_all(counts, [local] * ep, [local] * ep, group).view(ep, local)   # 2. [source, expert]
    send, recv = counts.view(ep, local).sum(1).tolist(), got_counts.sum(1).tolist()
    received = _AllToAll.apply(x[token], send, recv, group)       # 3. by source rank, by expert inside
    expert_of = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(got_counts.reshape(-1))
    by_expert = expert_of.argsort(stable=True)                     # 4. group by local expert
    sizes = torch.bincount(expert_of, minlength=local).tolist()
    parts = got_counts.t().tolist()                                 # [expert][source]: each slice's rows by source
    out = (slices or swiglu_slices)(received[by_expert], sizes, gate, up, down, parts)[by_expert.argsort()]
    back = _AllToAll.apply(out, recv, send, group)                 # 5. to the tokens' ranks, in sorted order
    return torch.zeros_like(x).index_add(0, token, back * weights.reshape(-1)[order].unsqueeze(-1))


# ---------------------------------------------------------------------------
# Expert parallelism's groups, only with --ep > 1 (build.py gives them to the mesh). Out
# of each dp group, runs of ep neighbouring dp ranks form an "ep" group that
# shares the E experts (E/ep each, tokens sent to them by all-to-all); the dp
# ranks with the same place in their run hold the same experts and form an
# "ep_dp" group (dp/ep ranks), over which those experts' gradients are summed.
# Example dp 4, ep 2: ep groups [0 1] [2 3], ep_dp groups [0 2] [1 3].
# ---------------------------------------------------------------------------

def ep_groups(kind: str, tp: int, pp: int, dp: int, ep: int) -> list[list[int]]:
    """The 'ep' or 'ep_dp' groups as lists of ranks (none when ep = 1)."""
    if ep == 1:
        return []
    r = lambda d, p, t: rank_of(d, p, t, tp, dp)   # noqa: E731
    # exercise 10c: begin
    if kind == "ep":
        return [[r(d, p, t) for d in range(i, i + ep)] for p in range(pp) for t in range(tp) for i in range(0, dp, ep)]
    return [[r(d, p, t) for d in range(j, dp, ep)] for p in range(pp) for t in range(tp) for j in range(ep)]
    # exercise 10c: end


def carve(kind: str, grad_groups: list[list[int]], ep: int) -> list[list[int]]:
    """The 'ep' or 'ep_dp' groups out of any partition into groups of ranks holding the same weights:
    runs of ep neighbours in each (ep), and the ranks at the same place of every run (ep_dp). Over the
    dp groups it gives ep_groups' groups; with --cp it is given the dp x cp groups (`add_groups`)."""
    if kind == "ep":
        return [g[i:i + ep] for g in grad_groups for i in range(0, len(g), ep)]
    return [g[j::ep] for g in grad_groups for j in range(ep)]


def add_groups(mesh, ep: int):
    """Give `mesh` the kinds 'ep' and 'ep_dp' (before its groups are built). Returns it.
    Expert parallelism draws its ranks from those that hold the same weights and other tokens, the
    mesh's gradient groups (grad_kind): the dp groups (ep_groups), or with --cp the dp x cp groups
    (context_parallel.ContextMesh; as Megatron and torchtitan do), whose runs of ep neighbours (cp
    neighbours first) are `carve`d out, so --ep may be up to dp x cp."""
    for kind in ("ep", "ep_dp"):
        def groups(m, kind=kind):
            if m.grad_kind == "dp":
                return ep_groups(kind, m.tp, m.pp, m.dp, ep)
            return carve(kind, m._all(m.grad_kind), ep)
        mesh.extra[kind] = groups
    return mesh


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Tokens one expert takes in capacity mode: ceil(factor * N * k / E)."""
    return math.ceil(factor * n_tokens * k / n_experts)


def batched_swiglu(h, gate, up, down):
    """Every expert at once on a queue of the same length: h (E, n, C) -> (E, n, C)."""
    return torch.bmm(F.silu(torch.bmm(h, gate.transpose(1, 2))) * torch.bmm(h, up.transpose(1, 2)),
                     down.transpose(1, 2))


def capacity_expert_parallel(h, gate, up, down, group):
    """Capacity mode's experts over the ep ranks of `group`: h (E, C, d), this rank's queue
    for every expert; gate, up, down this rank's E/ep experts. The queues are all one size,
    so the all-to-alls need no counts: E/ep x C rows to each rank, and the same back.
    Returns (E, C, d), every queue computed by its expert's holder."""
    E, C, d = h.shape
    ep, local = group.size, gate.shape[0]
    rows = [local * C] * ep                                        # rank r's experts' queues: one run
    got = _AllToAll.apply(h.reshape(E * C, d), rows, rows, group).view(ep, local, C, d)   # [source, expert]
    out = batched_swiglu(got.transpose(0, 1).reshape(local, ep * C, d), gate, up, down)   # each expert's rows
    out = out.view(local, ep, C, d).transpose(0, 1).reshape(E * C, d)                   # back by source
    return _AllToAll.apply(out, rows, rows, group).view(E, C, d)


def dispatch_capacity(x, experts, weights, gate, up, down, factor: float, group=None):
    """Capacity mode, every shape static: (y, dropped fraction). Drop rule (the
    module docstring): choices served rank by rank, then token by token; each
    expert keeps its first C = capacity(N, k, E, factor) and drops the rest.
    group: --ep, gate, up, down are this rank's E/ep experts (capacity_expert_parallel)."""
    N, k = experts.shape
    E = gate.shape[0] * (group.size if group is not None else 1)
    C = capacity(N, k, E, factor)
    rank_major = experts.t().reshape(-1)                           # (k*N,): all first choices, then all second ...
    onehot = F.one_hot(rank_major, E)                              # (k*N, E)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)           # place of each choice in its expert's queue
    keep = position < C
    slot = torch.where(keep, rank_major * C + position, E * C)     # buffer row; E*C: the dump row of the dropped
    token = torch.arange(N, device=x.device).repeat(k)             # rank-major order: token of choice j is j % N
    buf = torch.zeros(E * C + 1, x.shape[1], dtype=x.dtype, device=x.device).index_add(0, slot, x[token])
    h = buf[:E * C].view(E, C, -1)                                 # (E, C, C_model): each expert's queue
    if group is None or group.size == 1:
        out = batched_swiglu(h, gate, up, down)                    # (E, C, d): all experts in one batched matmul
    else:
        out = capacity_expert_parallel(h, gate, up, down, group)   # (E, C, d): on the experts' ranks
    out = torch.cat([out.reshape(E * C, -1), out.new_zeros(1, out.shape[-1])])   # a zero row for the dropped
    w = weights.t().reshape(-1) * keep                             # a dropped choice adds nothing
    y = torch.zeros_like(x).index_add(0, token, out[slot] * w.unsqueeze(-1).to(x.dtype))
    return y, 1.0 - keep.float().mean()


class RouterLoss(torch.autograd.Function):
    """The router losses into the backward from where they are made (Megatron's MoEAuxLossAutoScaler):
    forward y unchanged; backward y's gradient, and for each router loss, (B,) one per sequence (balance,
    z), its weight in the training objective (`scales`: coefficient x the sequence's weight). So they train
    the router through any pipeline stage or schedule without being added to the language model's loss
    (which is what the run logs as `loss`). Each weight goes straight into the backward: no sum
    aux_coef x balance + z_coef x z is made to be differentiated again (its three tiny ops and their
    backward took 70 us of a sparse layer's 2.6 ms, forward + backward, at the moe preset, 2-core CPU)."""

    @staticmethod
    def forward(ctx, y, balance, z, scales: tuple):
        ctx.shape, ctx.dtype, ctx.scales = balance.shape, balance.dtype, scales
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.full(ctx.shape, s, dtype=ctx.dtype, device=grad.device) for s in ctx.scales), None)


class MoE(nn.Module):
    """The sparse feed-forward block (a drop-in for model.MLP, replicated over tp). After each
    forward, `self.losses` holds this forward's per-sequence (balance, z) and `self.load` its
    tokens per expert and dropped fraction, for the log (`Figures`). In training (loss_scale > 0)
    its router losses join the backward (`RouterLoss`), each sequence's balance with weight
    aux_coef x loss_scale and its z with z_coef x loss_scale: loss_scale is 1 / the global batch's
    sequences, so the objective gains the mean over sequences of aux_coef x balance + z_coef x z."""

    def __init__(self, d_model: int, ffn_dim: int, n_experts: int, top_k: int, n_shared: int = 0,
                 capacity_factor: float = 0.0, ep_group=None, seq_group=None, aux_coef: float = 0.0,
                 z_coef: float = 0.0, loss_scale: float = 0.0, bias_rate: float = 0.0, cp_group=None):
        super().__init__()
        self.aux_coef, self.z_coef, self.loss_scale = aux_coef, z_coef, loss_scale
        self.k, self.capacity_factor, self.n_experts, self.ep_group = top_k, capacity_factor, n_experts, ep_group
        # the groups over which a sequence's tokens are shared (route): --tp with SP (x holds T/tp tokens),
        # --cp (T/cp tokens: this rank's zigzag chunks; with SP T/(cp tp))
        shares = tuple(g for g in (cp_group, seq_group) if g is not None and g.size > 1)
        self.seq_group = shares if len(shares) > 1 else (shares[0] if shares else None)
        W = functools.partial(Weight, sequence_parallel=seq_group is not None)   # (tp's SP; cp's sum: the grad group)
        ep, ep_rank = (ep_group.size, ep_group.rank) if ep_group is not None else (1, 0)
        self.router = W(n_experts, d_model)                        # one linear, no bias: logits = x W_r^T
        self.gate = W(n_experts, ffn_dim, d_model, ep=ep, ep_rank=ep_rank)   # (E/ep of them with --ep)
        self.up = W(n_experts, ffn_dim, d_model, ep=ep, ep_rank=ep_rank)
        self.down = W(n_experts, d_model, ffn_dim, ep=ep, ep_rank=ep_rank)
        self.n_shared = n_shared
        if n_shared:   # shared experts: every token uses them; n of width F act as one of width n * F
            self.shared_gate = W(n_shared * ffn_dim, d_model)
            self.shared_up = W(n_shared * ffn_dim, d_model)
            self.shared_down = W(d_model, n_shared * ffn_dim)
        self.losses = self.load = None
        # the dropless experts' SwiGLU on their slices: None, swiglu_slices; or any function of its
        # arguments (a seam: docs/design.md 1), dispatched by dispatch_expert_parallel (fp8_experts.py)
        self.slices = None
        # balancing without a loss: state, not a parameter (no gradient, no optimizer; moved in the optimizer's
        # step hook, Figures.move_biases); None without --moe-bias-rate
        self.register_buffer("expert_bias", torch.zeros(n_experts) if bias_rate else None)

    def _apply(self, fn, recurse=True):
        """module.to(device, dtype) moves the bias but keeps it fp32: its steps of --moe-bias-rate
        (1e-3) would round away in bf16 (8 bits: 1e-3 is under half an ulp of 0.25)."""
        bias = self._buffers.pop("expert_bias")
        out = super()._apply(fn, recurse)
        self._buffers["expert_bias"] = None if bias is None else bias.to(fn(bias).device, torch.float32)
        return out

    def forward(self, x):
        B, T, C = x.shape
        experts, weights, balance, z = route(x, self.router.weight, self.k, self.seq_group,
                                             self.expert_bias)
        flat, experts, weights = x.reshape(B * T, C), experts.reshape(B * T, -1), weights.reshape(B * T, -1)
        params = (self.gate.weight, self.up.weight, self.down.weight)
        if (self.capacity_factor == 0 and (self.ep_group is None or self.ep_group.size == 1) and self.slices is None
                and grouped(flat, *params, rows=experts.numel() / self.n_experts)):
            # dropless, each projection one grouped matmul: no host read, so --compile captures it with the stage
            y, dropped = dispatch_sorted(flat, experts, weights, *params), flat.new_zeros((), dtype=torch.float32)
        else:
            y, dropped = self.dispatch_on_host(flat, experts, weights, params)
        if self.n_shared:   # (one slice of every row: through `slices` where it is set)
            shared = (self.shared_gate.weight, self.shared_up.weight, self.shared_down.weight)
            y = y + (swiglu(flat, *shared) if self.slices is None else
                     self.slices(flat, [flat.shape[0]], *(w.unsqueeze(0) for w in shared), shared=True))
        self.losses = (balance, z)
        self.load = (per_expert(experts.reshape(-1), self.n_experts).float(),
                     dropped.detach().float())
        if self.loss_scale and torch.is_grad_enabled():   # training: the router losses join the backward here
            y = RouterLoss.apply(y, balance, z, (self.aux_coef * self.loss_scale, self.z_coef * self.loss_scale))
        return y.view(B, T, C)

    def dispatch_on_host(self, flat, experts, weights, params):
        """The dispatches whose shapes the host reads from the routing (tokens per expert, --ep's all-to-all
        splits), and capacity mode's (static, not yet tried compiled): (y, dropped). --compile runs this
        eagerly (run/build.py)."""
        if self.capacity_factor > 0:   # (with --ep: the queues to the experts' ranks and back)
            return dispatch_capacity(flat, experts, weights, *params, self.capacity_factor, self.ep_group)
        dropped = flat.new_zeros((), dtype=torch.float32)
        if self.ep_group is not None and self.ep_group.size > 1 or self.slices is not None:
            # --ep: to the experts' ranks and back (a group of one: this rank's experts, as dispatch_sorted)
            return dispatch_expert_parallel(flat, experts, weights, *params, self.ep_group or ONE, self.slices), dropped
        return dispatch_sorted(flat, experts, weights, *params), dropped   # (one SwiGLU a slice)


def apply(model, cfg, ep_group=None, loss_scale: float = 0.0, cp_group=None) -> Figures:
    """A mixture of experts in place of the MLP of every sparse layer (cfg.is_moe_layer) of `model`, this
    rank's stage, before init_weights fills its parameters by name: replicated over tp like the norms (with
    sequence parallelism each tp rank routes its T/tp tokens: `route`'s seq_group); `ep_group`: the ranks
    sharing the experts (--ep), E/ep each; `loss_scale`: each sequence's router losses' weight in the
    objective (training: 1 / the global batch's sequences; 0: not trained); `cp_group`: --cp's ranks, each
    routing its zigzag T/cp tokens of every sequence, the router's sums added up over them as over tp under
    SP. Returns the step's Figures, which each forward of the stage in training adds to."""
    seq_group = model.group if model.sequence_parallel else None
    for i, block in model.layers.items():
        if cfg.is_moe_layer(int(i)):
            block.mlp = MoE(cfg.d_model, cfg.ffn_dim, cfg.moe_experts, cfg.moe_top_k, cfg.moe_shared_experts,
                            cfg.moe_capacity_factor, ep_group, seq_group, cfg.moe_aux_coef, cfg.moe_z_coef,
                            loss_scale, cfg.moe_bias_rate, cp_group)
    figures = Figures(cfg, model)
    model.register_forward_hook(figures.after_forward, with_kwargs=True)
    return figures
