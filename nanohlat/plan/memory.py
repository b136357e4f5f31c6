"""What one rank holds: weights, optimizer state, gradient buffers and
activations, and the peak they reach together.

Memory per rank, at its peak, the larger of the step's two phases (e: the
bytes of one value in the parameter dtype, `itemsize` in the code; mb
sequences of T tokens per micro-batch; V the padded vocabulary):

    weights + gradients + optimizer state + fp32 gradient buffers + fixed
        + max(activations + loss backward + transients,  forward/backward
              ZeRO shards and gathers (+ temporaries))    optimizer step

The peak is an upper bound of the allocator's peak on a rank, at most PEAK_MARGIN
(10%) above it: tests/plan/test_plan_peak_memory.py measures it on the CPU with the allocator's own
reports (one process, tp 2 with SP, ZeRO-1/2/3 at dp 2, cp 2 with each attention,
pp 2 and 4 under every schedule, on every stage: 1.004 to 1.098; the moe preset, routing
forced balanced, tests/plan/test_plan_moe.py: tp 2 with SP, pp 2 under 1F1B and ZB-H1, ZeRO-3,
--ep 2 with ZeRO-2, cp 2 with ring attention, cp 2 x --ep 2). There a block
gloo's thread frees (a collective's copy of its input, or a tensor the program let go
of while gloo still held it) counts as freed when the program's wait for its
collective returns: the profiler does not see frees made on gloo's threads, and
read without that, the same run measured a different peak depending on which thread
dropped the last reference.

With ZeRO-2 and ZeRO-3 the forward/backward term is not the sum above but the
largest moment of the backward (backward_moments_bytes): the activations are
largest at its start, the staged buckets and gathered units later.

    weights       parameters x 2 B (bf16) or 4 B (fp32); ZeRO-3: 1/dp of them
    gradients     none kept: each parameter's gradient is added into the fp32
                  buffer (below) as autograd makes it (a hook or a view), and freed
    optimizer     Adam moments (2 x 4 B, or 2 x 2 B with --moments bf16) + master
                  weights only where they are a separate copy: bf16-mixed's fp32 (4 B);
                  in fp32, bf16-sr and bf16 they are the parameters (0 B);
                  1/dp of all that with ZeRO-1, 2 and 3
    activations   what autograd keeps per micro-batch (below) x micro-batches in flight
    loss backward the loss's backward briefly holds the logits' gradients, (4 + e) mb*T*V/tp
    fp32 grads    FlatAdamW accumulates the gradients in one flat fp32 buffer per group, kept between
                  steps (4 B/param; ZeRO-2, 3: its 1/dp shard), also the update's scratch space; ZeRO-1
                  adds the reduce-scattered 1/dp shards, ZeRO-1 and 2 the all-gathered new weights
    grad staging  ZeRO-2, during each backward: the buckets being filled before their
                  reduce-scatter, at most the whole padded buffer (4 B/param; zero2.py);
                  ZeRO-3: at most the rest's unit's and one layer's (its groups are per layer)
    gathered      ZeRO-3, in the forward and backward: the layers' weights whole at once,
                  at most the rest's unit and one layer, and one group's all-gather result (zero3.py)
    temporaries   eager backends only (cpu, cuda): what the in-place AdamW update
                  still allocates (EAGER_STEP_COPIES), or the grad norm's fp64 chunk
                  (fast_adamw.norm_chunk), the larger; XLA fuses them away
    fixed         the rotary tables, the step's token ids and targets, and (eager, pp > 1)
                  the last exchange's output, which gloo may still hold (fixed_bytes)
    transients    eager backends only: what a backward makes beside what its micro-batch
                  holds, a parameter's gradient until it is in the fp32 buffer, and the activations'
                  gradients inside a layer (zb-h1's W: every deferred dW at once), and with
                  pp > 1 what a tick's exchanges hold (backward_transient_bytes)

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, section 4, redone for this model:
RMSNorm, SwiGLU, rotary, grouped-query attention, no dropout, no biases).
Per layer and micro-batch, e bytes per activation value (the parameter dtype),
with N = mb*T*C, n = N/tp with sequence parallel else N:

    each RMSNorm (x2)  fp32 copy of its input 4n, normalised input e*n, and its output
                       as the input of the next matmuls: e*n; with sequence parallel
                       that is the T/tp shard too, all-gathered again in backward
                       (--sp-regather, Megatron's way); with --no-sp-regather the
                       all-gathered full sequence instead (SP_SAVED_GATHERS e*N).
    attention          fused kernel (SDPA flash/efficient on cpu/cuda): q after rotary, k
                         and v (in fp32 on the CPU kv heads not repeated: the kernel shares them;
                         on CUDA, or in bf16, one copy per query head), the output, the fp32 log-sum-exp
                       T*T scores kept (Korthikanti; torch_xla's plain matmul+softmax,
                         which repeats the kv heads): q, k, v repeated, output, 4 * e*N/tp,
                         and the softmax probabilities e*mb*(heads/tp)*T*T
    SwiGLU             gate, silu(gate), up, their product: 4 * e*mb*T*ffn/tp
    selective          the attention core is recomputed: keep its inputs q, k, v (kv
                       heads not repeated) and output, and no T*T term at all
    full               each block is recomputed: keep only its input, e*n

The first stage adds the token ids and embedding mask, the last the final
norm and the vocab-parallel loss, which keeps two (mb, T, V/tp) fp32 tensors
(the masked logits and their exp): at a 32k vocabulary, the largest single
tensors of the 7B model. A pipeline stage holds min(pp - stage, M) micro-batches
at once under 1F1B, all M under AFAB (pipeline.stage_order); interleaved, with
v chunks of n_layers/(pp*v) layers each, min(2(pp-1-stage) + (v-1)pp + 1, v*M) chunk
activations, the embedding's extras on the first stage's chunk 0 only and the
loss's on the last stage's last chunk only (activations_in_flight_bytes).
A mixture of experts holds its routers and experts in flat buffers of their
own (params.moe_counts), replicated over tp like the norms: replicated at ep 1,
E/ep experts a rank at --ep N, their weights, fp32 gradients and Adam state
alike (ZeRO: the experts' sharded over the dp/N ranks holding the same ones);
what its sparse blocks keep for backward instead of a dense MLP's is counted
tensor by tensor (moe_layer_bytes, moe_activation_extra).
With --cp every rank holds T/cp tokens of each sequence: all of the above at
T/cp, the attention core each algorithm's (context.py), ZeRO sharded over dp x cp.
ZB-H1 holds p micro-batches on every stage, each from its forward until its
W: until its B all the forward's activations, from B to W only what W needs,
its linears' inputs and output gradients (weight_grad_bytes; with full
checkpointing that is more than the block input the forward kept).
"""

from __future__ import annotations

import functools

import numpy as np

from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.tools.orders import chunk_layers, stage_ops
from nanohlat.precision import master_dtype, moment_dtype, param_dtype
from nanohlat.data_parallel import bucket_ranges
from nanohlat.plan import context
from nanohlat.plan.context import local_tokens
from nanohlat.plan.params import (dtype_bytes, group_kinds, sparse_in, stage_param_counts,
                                        stage_sparse_layers, zero3_gathered, zero_groups)
from nanohlat.tools.fast_adamw import grad_views, norm_chunk
from nanohlat.tools.timeline import in_flight
from nanohlat.zero1 import padded_size


# The peak is an upper bound of the allocator's peak on a rank, no more than this fraction
# above it: tests/plan/test_plan_peak_memory.py measures it on the CPU (gloo) for one process, tp 2 with SP,
# ZeRO-1/2/3 at dp 2, cp 2 with each attention, pp 2 and 4 under every schedule (and
# tests/plan/test_plan_moe.py for a mixture of experts).
PEAK_MARGIN = 0.10


def micro_batch_size(tcfg: TrainConfig, dp: int) -> int:
    return tcfg.batch_size // (dp * tcfg.microbatches)


# With sequence parallel and --no-sp-regather, comm.all_gather returns the
# gathered (mb, T, C) sequence as one contiguous tensor that the matmuls after
# each norm (wq, wk, wv; gate, up) all save for backward: 2 full-sequence
# tensors per layer. With --sp-regather (the default, Megatron-LM's way) they
# keep only the 1/tp shard and gather it again in backward
# (tensor_parallel._GatherLinears): one more all-gather per norm.
SP_SAVED_GATHERS = 2


def layer_activation_bytes(cfg: ModelConfig, mb: int, T: int, tp: int, itemsize: int, mode: str, sp: bool,
                           fused: bool, regather: bool = True, cp: int = 1, algorithm: str = "allgather",
                           cuda: bool = False) -> int:
    """Bytes one block keeps for backward, one micro-batch, one rank (module docstring); T: a sequence's
    tokens on the rank (--cp: T/cp, its attention core context.py's); cuda: kv heads copied (so in bf16)."""
    C, D = cfg.d_model, cfg.head_dim
    sp = sp and tp > 1
    N = mb * T * C                           # a full-sequence residual-stream tensor, in elements
    n = N // tp if sp else N                 # the residual stream this rank holds
    if mode == "full":
        return itemsize * n
    q = N // tp                              # (mb, T, C/tp): local query heads
    kv = mb * T * cfg.kv_heads_per_rank(tp) * D   # local kv heads, not repeated
    heads = cfg.n_heads // tp
    norms = 2 * (4 * n + itemsize * n + 4 * (n // C))   # fp32 copy of the input, normalised input, fp32 rsqrt
    # the column-parallel matmuls after each norm keep their input: the norm's
    # output (one tensor for wq, wk, wv, another for gate, up; with sequence
    # parallel its T/tp shard), or, with --no-sp-regather, the gathered sequence
    inputs = SP_SAVED_GATHERS * itemsize * N if sp and not regather else 2 * itemsize * n
    if mode == "selective":
        core = itemsize * (q + 2 * kv) + itemsize * q
    elif cp > 1:
        core = context.attention_core_bytes(cfg, mb, T, tp, cp, itemsize, algorithm)
    elif fused:   # (grouped-query: the CPU's kernel reads each kv head for its H/K query heads in fp32, no copy)
        core = itemsize * (2 * q + 2 * (q if cuda or itemsize != 4 else kv)) + 4 * mb * heads * T
    else:
        core = 4 * itemsize * q + itemsize * mb * heads * T * T
    mlp = 4 * itemsize * mb * T * cfg.ffn_dim // tp
    return norms + inputs + core + mlp


def moe_layer_bytes(cfg: ModelConfig, N: int, B: int, itemsize: int, ep: int = 1, grouped: bool = False) -> int:
    """What one sparse layer's block (moe.MoE) keeps for backward, the N tokens of B sequences this rank
    routes, routing balanced (counted tensor by tensor: tests/plan/test_plan_moe.py). The router, in fp32
    (in bf16 it keeps fp32 copies of its input and weight): logits and probabilities (N x E each), the
    top k's values and indices, the sum renormalising them, the logsumexp of the z-loss, the per-sequence
    f and P. Dropless (moe.dispatch_sorted; at --ep dispatch_expert_parallel, whose received rows are
    sorted again: two more int64 permutations): the choices' sorted order and token indices (int64),
    the N*k gathered rows, the experts' SwiGLU intermediates on them (4 x ffn each), their outputs,
    the outputs weighted and the weights in sorted order. Capacity mode (dispatch_capacity): its keep
    mask and slot and token indices, the gathered rows, the dispatch buffer (E*C + 1 rows of C = the
    capacity; at --ep its E*C received rows), 4 x ffn on each of its E*C rows, the outputs picked back,
    weighted. Shared experts: a SwiGLU's four intermediates on every token, each. `grouped` (dropless, where
    moe.grouped multiplies every slice in one grouped matmul: moe_grouped) adds the gate and up weights side
    by side, (E/ep, 2F, C), and the slices' int32 ends."""
    from nanohlat.beyond.moe import capacity   # (a mixture of experts only: a dense plan loads no beyond/)
    E, k, F, C, f = cfg.moe_experts, cfg.moe_top_k, cfg.ffn_dim, cfg.d_model, cfg.moe_capacity_factor
    Nk = N * k
    router = 4 * (2 * N * E + Nk + 2 * N + B * E + 2 * B + E + 1) + 8 * Nk + (4 * (N + E) * C if itemsize != 4 else 0)
    if f:
        rows = E * capacity(N, k, E, f)
        experts = 17 * Nk + itemsize * (3 * Nk * C + (rows + 1) * C + 4 * rows * F + Nk)
    else:
        experts = (32 if ep > 1 else 16) * Nk + itemsize * (3 * Nk * C + 4 * F * Nk + Nk)
        experts += (itemsize * 2 * F * C + 4) * (E // ep) if grouped else 0
    return router + experts + itemsize * 4 * N * cfg.moe_shared_experts * F


def moe_activation_extra(cfg: ModelConfig, tcfg: TrainConfig, mb: int, T: int, tp: int, itemsize: int) -> int:
    """What a sparse layer keeps beyond the dense one layer_activation_bytes counts: moe_layer_bytes, less
    the dense MLP's SwiGLU (4 x mb*T*ffn/tp); replicated over tp, the block routes all mb*T tokens of
    its sequences, or with sequence parallelism its T/tp share, whose input it keeps as it is (with
    --no-sp-regather a dense MLP keeps the gathered sequence instead)."""
    sp = tcfg.sequence_parallel and tp > 1
    N = mb * T // (tp if sp else 1)
    gathered = itemsize * mb * T * cfg.d_model * (tp - 1) // tp if sp and not tcfg.sp_regather else 0
    return moe_layer_bytes(cfg, N, mb, itemsize, tcfg.ep, moe_grouped(cfg, tcfg, N, itemsize)) \
        - 4 * itemsize * mb * T * cfg.ffn_dim // tp - gathered


def moe_grouped(cfg: ModelConfig, tcfg: TrainConfig, N: int, itemsize: int) -> bool:
    """Whether a run's dropless experts take moe.grouped's path, by its rule on shapes (moe.grouped_by_shape):
    the rows per expert of a balanced routing of N tokens, N*k/E (--ep: the N*k rows received over E/ep)."""
    from nanohlat.beyond.moe import grouped_by_shape   # (a mixture of experts only)
    E = cfg.moe_experts // tcfg.ep
    return not cfg.moe_capacity_factor and grouped_by_shape(tcfg.device, itemsize == 4, N * cfg.moe_top_k / E,
                                                            cfg.ffn_dim, cfg.d_model)


def activation_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                     mode: str | None = None, sp: bool | None = None, fused: bool = True, chunk: int = 0) -> int:
    """Bytes autograd (and the pipeline runner) keep for ONE micro-batch on a rank
    of `stage`, at the end of its forward (interleaved: of one of its
    --virtual-stages chunks, `chunk`). mode/sp default to the config's."""
    mode = tcfg.activation_checkpointing if mode is None else mode
    sp = (tcfg.sequence_parallel if sp is None else sp) and tp > 1
    itemsize, mb, T, C = dtype_bytes(tcfg.precision), micro_batch_size(tcfg, dp), local_tokens(tcfg), cfg.d_model
    n = mb * (T // tp if sp else T) * C
    regather = tcfg.sp_regather
    v = tcfg.virtual_stages
    total = cfg.n_layers // (pp * v) * layer_activation_bytes(cfg, mb, T, tp, itemsize, mode, sp, fused, regather,
                                                              tcfg.cp, tcfg.cp_attention, tcfg.device == "cuda")
    if tcfg.cp > 1:   # the rotary angles at this rank's places (and ring's positions tables): context.py
        total += context.fixed_activation_bytes(cfg, T, tcfg.cp, tcfg.cp_attention, cfg.n_layers // (pp * v))
    sparse = sparse_in(cfg, chunk_layers(cfg.n_layers, pp, stage, chunk, v))   # (this chunk's)
    if sparse and mode != "full":
        total += sparse * moe_activation_extra(cfg, tcfg, mb, T, tp, itemsize)
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == v - 1
    if first:       # token ids (int64) and the "my vocabulary shard" mask of the embedding
        total += 8 * mb * T + itemsize * mb * T
    elif mode != "full" and itemsize != 4:
        total += itemsize * n  # the received input, kept for its gradient (fp32: it is the norm's input)
    if not last:
        total += itemsize * n  # the stage's output, kept by the runner until its backward
    else:           # final norm, then the loss
        total += loss_activation_bytes(cfg, tcfg, tp, dp, sp)
    return total


def loss_activation_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, dp: int, sp: bool) -> int:
    """What the last stage's final norm and loss keep for backward, one micro-batch (activation_bytes)."""
    itemsize, mb, T, C = dtype_bytes(tcfg.precision), micro_batch_size(tcfg, dp), local_tokens(tcfg), cfg.d_model
    n, V = mb * (T // tp if sp else T) * C, cfg.padded_vocab // tp
    total = 4 * n + itemsize * n + (itemsize * mb * T * C if sp and not tcfg.sp_regather else itemsize * n) + 4 * (n // C)
    if tp == 1:   # F.cross_entropy: its fp32 log-softmax (unpadded), the flattened targets, one scalar
        return total + 4 * mb * T * cfg.vocab_size + 8 * mb * T + 4
    return total + 8 * mb * T * V + V + 13 * mb * T   # vocab-parallel: masked fp32 logits and their exp, per-token scalars


def microbatches_in_flight(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> int:
    """Most micro-batches (interleaved: chunk activations) whose activations a
    stage holds at once (1F1B: min(pp - stage, m); zb-h1: from F to W, min(pp, m);
    tools/timeline.py:in_flight_formula)."""
    return in_flight(stage_ops(schedule, pp, m, stage, v))


def weight_grad_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int) -> int:
    """zb-h1: what one micro-batch's B leaves for its W on a rank of `stage`
    (split_backward.SplitBackward's stash): each linear's input and output
    gradient. Per layer: the two norms' outputs (with sequence parallel their
    T/tp shard, gathered again in W; with --no-sp-regather the gathered
    sequence), wo's and down's inputs, and the gradients of wq, wk, wv, wo,
    gate, up and down's outputs; the last stage adds the head's input and its
    (mb, T, V/tp) output gradient. Any checkpointing mode: B recomputed them."""
    sp = tcfg.sequence_parallel and tp > 1
    itemsize, mb, T, C = dtype_bytes(tcfg.precision), micro_batch_size(tcfg, dp), local_tokens(tcfg), cfg.d_model
    N = mb * T * C
    n = N // tp if sp else N
    norm_out = N if sp and not tcfg.sp_regather else n
    q, kv, f = N // tp, mb * T * cfg.kv_heads_per_rank(tp) * cfg.head_dim, mb * T * cfg.ffn_dim // tp
    layer = 2 * norm_out + q + f + (q + 2 * kv) + N + 2 * f + N
    head = norm_out + mb * T * cfg.padded_vocab // tp if stage == pp - 1 else 0
    return itemsize * (cfg.n_layers // pp * layer + head)


def backward_transient_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int,
                             stage: int) -> tuple[int, int]:
    """(in a B, in a W): what a backward op makes besides what its micro-batch held, in the
    parameter dtype. The parameter gradients autograd makes before they are added into the flat
    fp32 buffers and freed (a hook or a view: optim.FlatAdamW.attach): a backward makes them one
    at a time, at most the stage's largest parameter, the embedding's or the head's (V/tp x C) on
    the first and last stage, else one of gate, up, down (C x ffn/tp). And the activations'
    gradients inside a layer's backward: the residual stream's, incoming and summed (2n), and
    SwiGLU's, of its product and of gate or up (2 mb*T*ffn/tp). zb-h1's W makes every dW its B
    deferred at once before handing them to autograd (split_backward.weight_grads): all the stage's
    linears, the head included, not the embedding, and AccumulateGrad's copy of one (none into a view)."""
    itemsize, C = dtype_bytes(tcfg.precision), cfg.d_model
    sp = tcfg.sequence_parallel and tp > 1
    mb, T = micro_batch_size(tcfg, dp), local_tokens(tcfg)
    flowing = 2 * mb * (T // tp if sp else T) * C + 2 * mb * T * cfg.ffn_dim // tp
    vocab = cfg.padded_vocab * C // tp if stage in (0, pp - 1) else 0
    one = max(vocab, C * cfg.ffn_dim // tp, C * C // tp)
    # full checkpointing: a sparse block recomputed in its backward holds what it keeps (moe_layer_bytes) meanwhile
    recompute = moe_layer_bytes(cfg, mb * T // (tp if sp else 1), mb, itemsize, tcfg.ep) \
        if tcfg.activation_checkpointing == "full" and stage_sparse_layers(cfg, pp, stage, tcfg.virtual_stages) else 0
    if tcfg.schedule != "zb-h1":
        return itemsize * (one + flowing) + recompute, 0
    deferred = cfg.n_layers // pp * cfg.layer_matrix_params(tp) + (cfg.padded_vocab * C // tp if stage == pp - 1 else 0)
    # W: AccumulateGrad copies each dW it cannot take over (the list still holds it), one at a time; into
    # a view of the flat buffer (fast_adamw.grad_views) it adds in place, copying none
    largest_linear = 0 if grad_views(tcfg, dp * tcfg.cp) else max(C * cfg.ffn_dim // tp, C * C // tp, cfg.padded_vocab * C // tp if stage == pp - 1 else 0)
    return itemsize * ((cfg.padded_vocab * C // tp if stage == 0 else C) + flowing) + recompute, \
        itemsize * (deferred + largest_linear)   # B: the embedding's or a norm's gradient


def activations_in_flight_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                                fused: bool = True, grads: bool = False) -> int:
    """The most activation bytes a rank of `stage` holds at once: its order
    walked op by op, each forward adding its chunk's bytes until its backward
    (one chunk per stage: in-flight micro-batches x activation_bytes).
    grads: also the gradients each B or W makes (backward_transient_bytes), alive while that
    op's micro-batch still holds what it held before the op, and (pp > 1) the tensors each
    tick's exchanges hold (comm.exchange)."""
    v = tcfg.virtual_stages
    size = [activation_bytes(cfg, tcfg, tp, pp, dp, stage, fused=fused, chunk=c) for c in range(v)]
    left = weight_grad_bytes(cfg, tcfg, tp, pp, dp, stage) if tcfg.schedule == "zb-h1" else 0   # from B to W
    made = dict(zip("BW", backward_transient_bytes(cfg, tcfg, tp, pp, dp, stage))) if grads else {}
    if grads and pp > 1:
        # each tick's exchanges (comm.exchange), one per neighbour (interleaved: the first and last stage
        # are neighbours too): the all-gather's output, mine and theirs (the view returned keeps both), and
        # the zeros of an idle direction, each (mb, T or T/tp, C)
        sp = tcfg.sequence_parallel and tp > 1
        exchange = exchange_neighbours(tcfg, pp, stage) * 3 * dtype_bytes(tcfg.precision) * micro_batch_size(tcfg, dp) * local_tokens(tcfg) \
            // (tp if sp else 1) * cfg.d_model
        made = {k: made.get(k, 0) + exchange for k in "FBW"}
    held = peak = 0
    for kind, _, c in stage_ops(tcfg.schedule, pp, tcfg.microbatches, stage, v):
        peak = max(peak, held + made.get(kind, 0))
        held += {"F": size[c], "B": left - size[c], "W": -left}[kind]
        peak = max(peak, held)
    return peak


@functools.lru_cache(maxsize=4096)   # (a search asks for the same group's under every checkpointing mode)
def _staged_at_moments(segments: tuple[tuple[int, int], ...], dp: int, bucket_elems: int, overlap: bool,
                       moments: int) -> list[int]:
    """ZeRO-2/3: the fp32 staging one flat group holds at each moment of a backward, at most
    (zero2.ZeroTwoDP.grad_hook). `segments`: (moment its gradients are made at, elements), in the
    buffer's order; the backward makes them last first, so by moment m a suffix [x, numel) is in.
    A bucket (columns [a, b) of every row of the (dp, S) view) is staged whole from its first
    gradient until its last; with overlap its staging and its 1/dp result stay until the group's
    last bucket is started. Within a moment, the buckets it touches count as staged from its start
    to its end (an upper bound of what its parameters' hooks hold one after another)."""
    numel = sum(n for _, n in segments)
    cols = padded_size(numel, dp) // dp
    buckets = [(a, b) for a, b in bucket_ranges(cols, bucket_elems // dp)]
    def suffix(m):   # the first element made by the end of moment m
        x = numel
        for when, n in reversed(segments):
            if when > m:
                break
            x -= n
        return x
    a, b = np.array(buckets, dtype=np.int64).reshape(-1, 2).T
    top = np.minimum(dp - 1, np.maximum(0, numel - 1 - a) // cols)   # the last row holding real elements here
    reach = np.minimum(top * cols + b, numel)   # a bucket holds real elements at or after x if reach > x
    out = []
    for m in range(moments):
        before, after = suffix(m - 1), suffix(m)
        done_before = not len(a) or a.min() >= before
        staged = (reach > after) & ((overlap and not done_before) | (a < before))
        result = staged & (a >= after) if overlap else staged & False   # (overlap: its 1/dp result too)
        out.append(int(4 * dp * (b - a)[staged].sum() + 4 * (b - a)[result].sum()))
    return out


def backward_moments_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                           loss_backward: int, transients: int) -> int:
    """ZeRO-2 and ZeRO-3 (dp > 1): what a micro-batch's forward and backward add, at its largest
    moment, beyond the activations the other micro-batches in flight hold. The backward is walked
    as a sequence of moments, the loss's, then the head's (and final norm's), each layer's, last
    first, and the embedding's: the activations shrink by a layer's (layer_activation_bytes) as
    each layer's backward ends, while the staged buckets grow (_staged_at_moments) and, ZeRO-3,
    the rest's unit stays whole and each layer's is gathered for its own backward (that of the
    layer after it counted as still whole: its last gradients may come after the next one's
    gather). The loss's moment holds the logits' gradients (loss_backward) and nothing staged: the
    head's gradient comes out of the same matmul backward that frees them. The largest is the
    peak's, not the sum of each term's largest (which are at opposite ends of the backward)."""
    v, itemsize = tcfg.virtual_stages, dtype_bytes(tcfg.precision)
    L = cfg.n_layers // (pp * v)
    mb, zdp = micro_batch_size(tcfg, dp), dp * tcfg.cp   # (ZeRO's ranks: dp x cp)
    layer_act = layer_activation_bytes(cfg, mb, local_tokens(tcfg), tp, itemsize, tcfg.activation_checkpointing,
                                       tcfg.sequence_parallel and tp > 1, True, tcfg.sp_regather,
                                       cuda=tcfg.device == "cuda")
    moments = L + 2                       # 0: head and final norm; 1 + i: layer L-1-i; L+1: embedding
    head, emb = stage == pp - 1, stage == 0
    vocab = cfg.padded_vocab * cfg.d_model // tp
    bucket = int(tcfg.bucket_mb * 2**20 / 4)
    overlap = tcfg.overlap_grad_reduce
    kinds = group_kinds(cfg, tp, pp, stage, ep=tcfg.ep, v=v)
    ranks = {k: zdp // tcfg.ep if k == "experts" else zdp for k, _ in kinds}   # (--ep's experts: over dp/ep)
    # each group's elements per layer: less the embedding and head (sharded), the final norm (replicated)
    ends = {"sharded": vocab * (emb + head), "replicated": cfg.d_model * head}
    per_layer = {k: (n - ends.get(k, 0)) // (L * v) for k, n in kinds}
    staged = [0] * moments
    gathered = [0] * moments
    def add(segments, kind="sharded"):
        for m, b in enumerate(_staged_at_moments(tuple(segments), ranks.get(kind, zdp), bucket, overlap, moments)):
            staged[m] += b
    if tcfg.zero == 2:
        for kind, _ in kinds:
            segs = [(L - layer, per_layer[kind]) for layer in range(L)]
            if kind == "sharded":
                segs = ([(L + 1, vocab)] if emb else []) + segs + ([(0, vocab)] if head else [])
            elif kind == "replicated" and head:
                segs.append((0, cfg.d_model))
            add([s for s in segs if s[1]], kind)
    else:                                 # ZeRO-3 (pp 1): one unit per layer, and the rest's
        layer_groups = [padded_size(per_layer[k], ranks[k]) for k, _ in kinds]
        rest = [padded_size(2 * vocab, zdp), padded_size(cfg.d_model, zdp)]
        for layer in range(L):
            for k, _ in kinds:
                add([(L - layer, per_layer[k])], k)
        add([(L + 1, vocab), (0, vocab)])
        add([(0, cfg.d_model)])
        whole_rest, whole_layer = itemsize * sum(rest), itemsize * sum(layer_groups)
        # all_gather_buckets' result, one group at a time, beside the buffer it is copied into
        gather_out = itemsize * max(rest + layer_groups)
        for m in range(moments):
            gathered[m] = whole_rest + gather_out + (min(m, 2) * whole_layer if 1 <= m <= L else 0)
    forward = gathered[0] + (itemsize * sum(layer_groups) if tcfg.zero == 3 else 0)   # the last layer's forward
    loss = loss_backward + transients + gathered[0]
    # after the head's backward the final norm's and the loss's saved tensors are freed (one chunk a stage)
    tail = loss_activation_bytes(cfg, tcfg, tp, dp, tcfg.sequence_parallel and tp > 1) if head and v == 1 else 0
    # the layers whose backward has ended by moment m, last first (a mixture's sparse ones hold more)
    extra = moe_activation_extra(cfg, tcfg, mb, local_tokens(tcfg), tp, itemsize) \
        if cfg.moe_experts and tcfg.activation_checkpointing != "full" else 0
    acts = [layer_act + extra * cfg.is_moe_layer(i) for i in chunk_layers(cfg.n_layers, pp, stage, v - 1, v)]
    walk = [transients + staged[m] + gathered[m] - sum(acts[L - max(0, m - 1):]) - (tail if m else 0)
            for m in range(moments)]
    return max(forward, loss, *walk)


def exchange_neighbours(tcfg: TrainConfig, pp: int, stage: int) -> int:
    """The stages this one exchanges with (interleaved: the first and the last are neighbours too)."""
    return (stage > 0) + (stage < pp - 1) + (tcfg.virtual_stages > 1 and pp > 1 and stage in (0, pp - 1))


def fixed_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                eager: bool = True) -> int:
    """What a rank holds through the whole step besides the model's state: the rotary tables
    (cos and sin, fp32, (max_seq_len, head_dim) each: model.rotary_tables), this step's token
    ids and targets (int64, its B/dp sequences: data_parallel.split_batch), and (pp > 1) the
    last exchange's all-gather output with each neighbour, mine and theirs (comm.exchange),
    which gloo's worker thread may still hold when the optimizer step begins (eager backends;
    on xla the step is one graph). (ZeRO-1's reduce-scattered gradient shards live only from
    phase 1 to the end of the step: train.py frees them; optimizer_step_bytes counts them.)"""
    sp = tcfg.sequence_parallel and tp > 1
    last_exchange = eager * exchange_neighbours(tcfg, pp, stage) * 2 * dtype_bytes(tcfg.precision) \
        * micro_batch_size(tcfg, dp) * local_tokens(tcfg) // (tp if sp else 1) * cfg.d_model
    # a mixture's figures (moe.py): each sparse block keeps its last forward's per-sequence losses and its
    # load (MoE.losses, .load: fp32, 2 x mb + E + 1), the step's Figures a row of E + 4 per sparse layer
    figures = 4 * (stage_sparse_layers(cfg, pp, stage, tcfg.virtual_stages) * (2 * micro_batch_size(tcfg, dp)
                   + cfg.moe_experts + 1) + cfg.sparse_layers() * (cfg.moe_experts + 4)) if cfg.moe_experts else 0
    return 2 * 4 * cfg.max_seq_len * cfg.head_dim + 2 * 8 * (tcfg.batch_size // dp) * local_tokens(tcfg) \
        + last_exchange + figures


def state_bytes_per_param(tcfg: TrainConfig) -> int:
    """Optimizer state per parameter: two Adam moments (4 B each, 2 B with --moments bf16), plus
    4 B of fp32 master weights only where they differ from the parameters' dtype (bf16-mixed);
    elsewhere the master weights are the parameters themselves (precision.py)."""
    master = master_dtype(tcfg.precision)
    return 2 * moment_dtype(tcfg.moments).itemsize + (master.itemsize if master != param_dtype(tcfg.precision) else 0)


def optimizer_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0,
                    zero: int | None = None) -> int:
    """Adam moments + separate master weights, if any, on one rank (1/dp of them with ZeRO-1, 2 and 3),
    under ZeRO stage `zero` (default: the config's)."""
    zero = tcfg.zero if zero is None else zero
    shards = dp * tcfg.cp if zero else 1
    return sum(padded_size(n, s) // s
               for n, s in zero_groups(cfg, tp, pp, stage, zero, tcfg.ep, shards, tcfg.virtual_stages)) \
        * state_bytes_per_param(tcfg)


def bytes_per_param_line(tcfg: TrainConfig) -> str:
    """What --precision and --moments keep per parameter, before any ZeRO-1 sharding."""
    itemsize, moment_itemsize = dtype_bytes(tcfg.precision), moment_dtype(tcfg.moments).itemsize
    sep = state_bytes_per_param(tcfg) - 2 * moment_itemsize
    weights = f"weights {itemsize} ({'fp32' if itemsize == 4 else 'bf16'}" + (", also the master weights)" if not sep else ")")
    master = f" + fp32 master weights {sep}" if sep else ""
    moments = f"Adam moments 2 x {moment_itemsize} ({'fp32' if moment_itemsize == 4 else 'bf16, stochastically rounded'})"
    return (f"bytes per parameter: {weights}{master} + {moments} + fp32 gradient buffer 4 (micro-batches and "
            f"the dp sum added exactly) = {itemsize + sep + 2 * moment_itemsize + 4}")


def weight_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0) -> int:
    """The parameters in their flat buffers (optim.FlatGroup.flat), padded to a multiple of dp under ZeRO;
    ZeRO-3 keeps only the 1/dp shard between uses (zero3.py)."""
    shards = dp * tcfg.cp if tcfg.zero else 1
    return dtype_bytes(tcfg.precision) * sum(padded_size(n, s) // (s if tcfg.zero == 3 else 1)
                                             for n, s in zero_groups(cfg, tp, pp, stage, tcfg.zero, tcfg.ep, shards,
                                                                     tcfg.virtual_stages))


# Eager backends (cpu, cuda) run FlatAdamW.step's AdamW one op at a time. The
# update works in place in the flat gradient buffer, so fp32 and bf16-mixed
# allocate almost nothing more (bf16-mixed: the bf16 copy of the new weights,
# half an fp32 copy); pure bf16 works on an fp32 copy of its bf16 master (1.5
# copies with the rounding); software stochastic rounding adds its int32 noise
# and bit buffers (4.5 copies). Counted in fp32-sized copies of the largest
# group's shard (measured on CUDA: tests/plan/test_plan_peak_memory.py). --moments bf16 adds the
# fp32 copies of the two moments, alive beside the master's while each is
# rounded back: 2 more (derived from the above, not measured). XLA fuses the
# update into one kernel and needs none of them.
EAGER_STEP_COPIES = {"fp32": 0.0, "bf16-mixed": 0.5, "bf16": 1.5, "bf16-sr": 4.5}
EAGER_STEP_COPIES_BF16_MOMENTS = 2.0
# Eager backends sum the gradients' squares in fp64 (optim.sum_of_squares), a chunk of at most 2^20
# elements of a buffer at a time (optim.NORM_CHUNK; 2^16 on the CPU: fast_adamw.norm_chunk): 8 B each.
# Beside the chunk, the norm's scalars: its running sums (fp64), each group's, the loss and its finiteness:
# at most 8 of 8 bytes (measured: 53 bytes, a mixture's 3 groups, where the norm sets the peak).
NORM_SCALARS = 64


def optimizer_step_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                         eager: bool) -> tuple[int, int]:
    """(flat fp32 gradient buffers kept between steps, extra bytes during FlatAdamW.step).

    One buffer per group (tp-sharded matrices, replicated norms), padded to a
    multiple of dp under ZeRO-1; ZeRO-2 keeps only its 1/dp shard. During the
    step ZeRO-1 also holds the reduce-scattered 1/dp gradient shards (ZeRO-2's
    are the buffers) and, one group at a time, the all-gathered new weights in
    the parameter dtype."""
    shards = dp * tcfg.cp if tcfg.zero else 1
    # (--ep: the experts' over dp/ep)
    groups = zero_groups(cfg, tp, pp, stage, tcfg.zero, tcfg.ep, shards, tcfg.virtual_stages)
    buffers = 4 * sum(padded_size(n, s) // (s if tcfg.zero >= 2 else 1) for n, s in groups)
    largest_shard = max(padded_size(n, s) // s for n, s in groups)
    during = 0
    if shards > 1:
        during += 4 * sum(padded_size(n, s) // s for n, s in groups) if tcfg.zero == 1 else 0
        during += dtype_bytes(tcfg.precision) * max(padded_size(n, s) for n, s in groups) if tcfg.zero < 3 else 0
    if eager:
        copies = EAGER_STEP_COPIES[tcfg.precision] + (EAGER_STEP_COPIES_BF16_MOMENTS if tcfg.moments == "bf16" else 0)
        # phase 2 before phase 3: the grad norm's fp64 copy of one chunk of a buffer, then AdamW's copies
        during += max(int(4 * copies * largest_shard), 8 * min(largest_shard, norm_chunk(tcfg.device)) + NORM_SCALARS)
    return buffers, during


def memory_per_rank(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                    fused: bool = True, eager: bool = False) -> dict:
    """The per-rank breakdown of one stage, in bytes (module docstring). `fused`:
    the attention kernel keeps no T*T scores; `eager`: cpu/cuda, not xla."""
    params = stage_param_counts(cfg, tp, pp, stage, tcfg.ep, tcfg.virtual_stages)["total"]
    itemsize = dtype_bytes(tcfg.precision)
    flight = microbatches_in_flight(tcfg.schedule, pp, tcfg.microbatches, stage, tcfg.virtual_stages)
    flat, temporaries = optimizer_step_bytes(cfg, tcfg, tp, pp, dp, stage, eager)
    zdp, v = dp * tcfg.cp, tcfg.virtual_stages   # the ranks ZeRO shards over: dp, with --cp dp x cp (mesh.grad_group)
    out = {"params": params, "weights": weight_bytes(cfg, tcfg, tp, pp, dp, stage),
           "grads": 0,   # accumulated in the fp32 buffers
           "optimizer": optimizer_bytes(cfg, tcfg, tp, pp, dp, stage),
           "optimizer_zero1": optimizer_bytes(cfg, tcfg, tp, pp, dp, stage, zero=1),
           "optimizer_replicated": optimizer_bytes(cfg, tcfg, tp, pp, dp, stage, zero=0),
           "in_flight": flight,
           "activations": activations_in_flight_bytes(cfg, tcfg, tp, pp, dp, stage, fused=fused),
           "fixed": fixed_bytes(cfg, tcfg, tp, pp, dp, stage, eager),
           # the loss's backward briefly holds two more (mb, T, V/tp) tensors, the
           # gradient of the fp32 logits and of the head's output (parameter
           # dtype), while most activations are still alive (measured on CUDA)
           "loss_backward": (4 + itemsize) * micro_batch_size(tcfg, dp) * local_tokens(tcfg) * cfg.padded_vocab // tp
                            if stage == pp - 1 else 0,
           "flat_grads": flat, "step_temporaries": temporaries,
           # ZeRO-2: buckets staged in the backward until their reduce-scatter (ends), at most all of them
           "grad_staging": (4 * sum(padded_size(n, r) for n, r in zero_groups(cfg, tp, pp, stage, 2, tcfg.ep, zdp, v))
                            if tcfg.zero == 2 else 4 * zero3_gathered(cfg, tp, zdp, tcfg.ep))
                           if tcfg.zero >= 2 and zdp > 1 else 0,
           # ZeRO-3: the units whole at once (in the parameter dtype), and one group's all-gather result
           "gathered": itemsize * (zero3_gathered(cfg, tp, zdp, tcfg.ep)
                            + max(padded_size(n, r) for n, r in zero_groups(cfg, tp, pp, 0, 3, tcfg.ep, zdp)))
                       if tcfg.zero == 3 else 0}
    if out["grad_staging"] and tcfg.overlap_grad_reduce and eager:
        # overlapped: each started bucket also holds its 1/dp result until the micro-batch's backward ends
        out["grad_staging"] += out["grad_staging"] // zdp
    # eager: the gradients a backward makes before they are freed, and the exchange's buffers, at the walk's worst moment
    # (xla: the step is one compiled graph whose buffers the compiler assigns; not modelled, not measured)
    out["backward_transients"] = (activations_in_flight_bytes(cfg, tcfg, tp, pp, dp, stage, fused=fused, grads=True)
                          - out["activations"]) if eager else 0
    out["forward_backward"] = out["activations"] + (
        backward_moments_bytes(cfg, tcfg, tp, pp, dp, stage, out["loss_backward"], out["backward_transients"])
        if tcfg.zero >= 2 and zdp > 1 else out["backward_transients"] + out["loss_backward"])
    out["optimizer_step"] = temporaries
    out["peak"] = (out["weights"] + out["grads"] + out["optimizer"] + flat + out["fixed"]
                   + max(out["forward_backward"], out["optimizer_step"]))
    return out


def peak_memory_per_rank(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> int:
    """The plan's peak over the first and last stage (the largest ones)."""
    dp, eager = world // (tcfg.tp * tcfg.pp * tcfg.cp), tcfg.device in ("cpu", "cuda")
    return max(memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, dp, s, fused=eager, eager=eager)["peak"]
               for s in sorted({0, tcfg.pp - 1}))
