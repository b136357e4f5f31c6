"""Before a run: what each rank holds, computes and sends, and how long a step
should take (`train.py --plan`); which layouts fit and are fastest (`--search`).

Everything here is arithmetic on the config: no devices, no tensors, so it
answers for hlat-70b on 2048 ranks in a moment. The same formulas are checked
against what small real runs measure (tests/test_plan.py: the comm ledger,
the optimizer's bytes, the bytes autograd keeps after a forward), so the plan
is a prediction you can trust, not a guess.

Memory per rank, at its peak, the larger of the step's two phases:

    weights + gradients + optimizer state + fp32 gradient buffers
        + max(activations + loss backward,              forward/backward
              ZeRO shards and gathers (+ temporaries))   optimizer step

    weights       parameters x 2 B (bf16) or 4 B (fp32); ZeRO-3: 1/dp of them
    gradients     none kept: FlatAdamW's hooks add each parameter's gradient into
                  the fp32 buffer (below) as autograd makes it, and free it
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
                  still allocates (EAGER_STEP_COPIES); XLA fuses them away

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, section 4, redone for this model:
RMSNorm, SwiGLU, rotary, grouped-query attention, no dropout, no biases).
Per layer and micro-batch of mb sequences of T tokens, e bytes per activation
(the parameter dtype), with N = mb*T*C, n = N/tp with sequence parallel else N:

    each RMSNorm (x2)  fp32 copy of its input 4n, normalised input e*n, and its output
                       as the input of the next matmuls: e*n; with sequence parallel
                       that is the T/tp shard too, all-gathered again in backward
                       (--sp-regather, Megatron's way); with --no-sp-regather the
                       all-gathered full sequence instead (SP_SAVED_GATHERS e*N).
    attention          q after rotary, k and v after repeating kv heads, the kernel's
                       output: 4 * e*N/tp, plus
                         fused kernel (SDPA flash/efficient on cpu/cuda): fp32 log-sum-exp
                         T*T scores kept (Korthikanti; torch_xla's plain matmul+softmax):
                         the softmax probabilities e*mb*(heads/tp)*T*T
    SwiGLU             gate, silu(gate), up, their product: 4 * e*mb*T*ffn/tp
    selective          the attention core is recomputed: keep its inputs q, k, v (kv
                       heads not repeated) and output, and no T*T term at all
    full               each block is recomputed: keep only its input, e*n

The first stage adds the token ids and embedding mask, the last the final
norm and the vocab-parallel loss, which keeps two (mb, T, V/tp) fp32 tensors
(the masked logits and their exp): at a 32k vocabulary, the largest single
tensors of the 7B model. A pipeline stage holds min(pp - stage, M) micro-batches
at once under 1F1B, all M under AFAB (pipeline.stage_order); interleaved, with
v chunks of L/(pp*v) layers each, min(2(pp-1-stage) + (v-1)pp + 1, v*M) chunk
activations, the embedding's extras on the first stage's chunk 0 only and the
loss's on the last stage's last chunk only (activations_in_flight_bytes).
ZB-H1 holds p micro-batches on every stage, each from its forward until its
W: until its B all the forward's activations, from B to W only what W needs,
its linears' inputs and output gradients (weight_grad_bytes; with full
checkpointing that is more than the block input the forward kept).
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap

from nanohlat import comm
from nanohlat.config import ModelConfig, TrainConfig
from nanohlat.config import UserError
from nanohlat.mesh import Mesh, coords, kv_replicas, layout_table, rank_of, stage_layer_text, validate_layout
from nanohlat.tools.metrics import flops_per_token, peak_flops
from nanohlat.tools.timeline import FORMULAS, in_flight
from nanohlat.pipeline import stage_ops, timetable
from nanohlat.precision import master_dtype, moment_dtype, param_dtype
from nanohlat.zero1 import padded_size

GiB = 2**30

# Memory of ONE process's device (one NeuronCore / GPU), for "does it fit".
# trn1: 32 GiB HBM per Trainium chip, 2 NeuronCore-v2 each (trn1.32xlarge:
# 512 GiB for 32 cores). GPUs: the datasheet sizes of the SXM parts.
DEVICE_MEMORY = {"NeuronCore-v2": 16 * GiB, "A100": 80e9, "H100": 80e9, "H200": 141e9}

# --device -> the devices of the time estimate and the "does it fit" lines.
PLAN_DEVICES = {"xla": ["NeuronCore-v2"], "cuda": ["A100", "H100", "H200"], "cpu": ["cpu"],
                "auto": ["NeuronCore-v2", "H100", "cpu"]}
DEFAULT_MFU = 0.40


def dtype_bytes(precision: str) -> int:
    return param_dtype(precision).itemsize


def local_kv_heads(cfg: ModelConfig, tp: int) -> int:
    return cfg.kv_heads_per_rank(tp)


def stage_param_counts(cfg: ModelConfig, tp: int, pp: int, stage: int) -> dict:
    """Parameters of one (stage, tp rank): tp-sharded matrices and tp-replicated norms;
    "kv": of the matrices, the wk and wv rows replicated over a kv group (tp > n_kv_heads)."""
    d, layers = cfg.d_model, cfg.n_layers // pp
    sharded = layers * cfg.layer_matrix_params(tp)
    norms = layers * 2 * d
    kv = layers * 2 * d * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
    if stage == 0:
        sharded += cfg.padded_vocab * d // tp
    if stage == pp - 1:
        sharded += cfg.padded_vocab * d // tp
        norms += d
    return {"sharded": sharded, "replicated": norms, "kv": kv, "total": sharded + norms}


def group_kinds(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0) -> list[tuple[str, int]]:
    """(kind, elements) of each of optim.FlatAdamW's flat buffers on one rank: the tp-split
    matrices ("sharded"), the replicated kv heads' ("kv", if any: summed over their kv group), the
    norms ("replicated": summed over tp under SP). Each is padded to a multiple of dp under ZeRO,
    so the plan sums them group by group. ZeRO-3 (pp 1): the same kinds per unit (zero3.py), each
    layer's, then the rest's (embedding and head; final norm)."""
    if zero == 3:
        d, kv = cfg.d_model, 2 * cfg.d_model * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
        layer = [("sharded", cfg.layer_matrix_params(tp) - kv), ("kv", kv), ("replicated", 2 * d)]
        groups = layer * cfg.n_layers + [("sharded", 2 * cfg.padded_vocab * d // tp), ("replicated", d)]
    else:
        c = stage_param_counts(cfg, tp, pp, stage)
        groups = [("sharded", c["sharded"] - c["kv"]), ("kv", c["kv"]), ("replicated", c["replicated"])]
    return [(kind, n) for kind, n in groups if n]


def flat_groups(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0) -> list[int]:
    """Elements of each flat buffer on one rank (group_kinds)."""
    return [n for _, n in group_kinds(cfg, tp, pp, stage, zero)]


def zero3_gathered(cfg: ModelConfig, tp: int, dp: int) -> int:
    """ZeRO-3: elements of the flat buffers whole at once in a backward, at most: the rest's unit
    (whole through a micro-batch's forward and backward) and one layer's (zero3.py)."""
    groups = [padded_size(n, dp) for n in flat_groups(cfg, tp, 1, 0, 3)]
    rest = sum(groups[-2:])                           # (the last unit's two groups: embedding + head, final norm)
    return rest + sum(groups[:len(groups) - 2]) // cfg.n_layers


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

def micro_batch_size(tcfg: TrainConfig, dp: int) -> int:
    return tcfg.batch_size // (dp * tcfg.microbatches)


# With sequence parallel and --no-sp-regather, comm.all_gather returns the
# gathered (mb, T, C) sequence as one contiguous tensor that the matmuls after
# each norm (wq, wk, wv; gate, up) all save for backward: 2 full-sequence
# tensors per layer. With --sp-regather (the default, Megatron-LM's way) they
# keep only the 1/tp shard and gather it again in backward
# (tensor_parallel._GatherLinears): one more all-gather per norm.
SP_SAVED_GATHERS = 2


def layer_activation_bytes(cfg: ModelConfig, mb: int, T: int, tp: int, e: int, mode: str, sp: bool,
                           fused: bool, regather: bool = True) -> int:
    """Bytes one block keeps for backward, one micro-batch, one rank (module docstring)."""
    C, D = cfg.d_model, cfg.head_dim
    sp = sp and tp > 1
    N = mb * T * C                           # a full-sequence residual-stream tensor, in elements
    n = N // tp if sp else N                 # the residual stream this rank holds
    if mode == "full":
        return e * n
    q = N // tp                              # (mb, T, C/tp): local query heads
    kv = mb * T * local_kv_heads(cfg, tp) * D   # local kv heads, not repeated
    heads = cfg.n_heads // tp
    norms = 2 * (4 * n + e * n + 4 * (n // C))   # fp32 copy of the input, normalised input, fp32 rsqrt
    # the column-parallel matmuls after each norm keep their input: the norm's
    # output (one tensor for wq, wk, wv, another for gate, up; with sequence
    # parallel its T/tp shard), or, with --no-sp-regather, the gathered sequence
    inputs = SP_SAVED_GATHERS * e * N if sp and not regather else 2 * e * n
    if mode == "selective":
        core = e * (q + 2 * kv) + e * q
    elif fused:
        core = 4 * e * q + 4 * mb * heads * T
    else:
        core = 4 * e * q + e * mb * heads * T * T
    mlp = 4 * e * mb * T * cfg.ffn_dim // tp
    return norms + inputs + core + mlp


def activation_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                     mode: str | None = None, sp: bool | None = None, fused: bool = True, chunk: int = 0) -> int:
    """Bytes autograd (and the pipeline runner) keep for ONE micro-batch on a rank
    of `stage`, at the end of its forward (interleaved: of one of its
    --virtual-stages chunks, `chunk`). mode/sp default to the config's."""
    mode = tcfg.activation_checkpointing if mode is None else mode
    sp = (tcfg.sequence_parallel if sp is None else sp) and tp > 1
    e, mb, T, C = dtype_bytes(tcfg.precision), micro_batch_size(tcfg, dp), tcfg.seq_len, cfg.d_model
    n = mb * (T // tp if sp else T) * C
    regather = tcfg.sp_regather
    v = tcfg.virtual_stages
    total = cfg.n_layers // (pp * v) * layer_activation_bytes(cfg, mb, T, tp, e, mode, sp, fused, regather)
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == v - 1
    if first:       # token ids (int64) and the "my vocabulary shard" mask of the embedding
        total += 8 * mb * T + e * mb * T
    elif mode != "full" and e != 4:
        total += e * n  # the received input, kept for its gradient (fp32: it is the norm's input)
    if not last:
        total += e * n  # the stage's output, kept by the runner until its backward
    else:           # final norm, then the loss
        V = cfg.padded_vocab // tp
        total += 4 * n + e * n + (e * mb * T * C if sp and not regather else e * n) + 4 * (n // C)
        if tp == 1:   # F.cross_entropy: its fp32 log-softmax (unpadded), the flattened targets, one scalar
            total += 4 * mb * T * cfg.vocab_size + 8 * mb * T + 4
        else:         # vocab-parallel: masked fp32 logits and their exp, and per-token scalars
            total += 8 * mb * T * V + V + 13 * mb * T
    return total


def microbatches_in_flight(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> int:
    """Most micro-batches (interleaved: chunk activations) whose activations a
    stage holds at once (1F1B: min(pp - stage, m); zb-h1: from F to W, min(pp, m);
    tools/timeline.py:in_flight_formula)."""
    return in_flight(stage_ops(schedule, pp, m, stage, v))


def weight_grad_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int) -> int:
    """zb-h1: what one micro-batch's B leaves for its W on a rank of `stage`
    (tensor_parallel.WEIGHT_GRADS.stash): each linear's input and output
    gradient. Per layer: the two norms' outputs (with sequence parallel their
    T/tp shard, gathered again in W; with --no-sp-regather the gathered
    sequence), wo's and down's inputs, and the gradients of wq, wk, wv, wo,
    gate, up and down's outputs; the last stage adds the head's input and its
    (mb, T, V/tp) output gradient. Any checkpointing mode: B recomputed them."""
    sp = tcfg.sequence_parallel and tp > 1
    e, mb, T, C = dtype_bytes(tcfg.precision), micro_batch_size(tcfg, dp), tcfg.seq_len, cfg.d_model
    N = mb * T * C
    n = N // tp if sp else N
    norm_out = N if sp and not tcfg.sp_regather else n
    q, kv, f = N // tp, mb * T * local_kv_heads(cfg, tp) * cfg.head_dim, mb * T * cfg.ffn_dim // tp
    layer = 2 * norm_out + q + f + (q + 2 * kv) + N + 2 * f + N
    head = norm_out + mb * T * cfg.padded_vocab // tp if stage == pp - 1 else 0
    return e * (cfg.n_layers // pp * layer + head)


def activations_in_flight_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                                fused: bool = True) -> int:
    """The most activation bytes a rank of `stage` holds at once: its order
    walked op by op, each forward adding its chunk's bytes until its backward
    (one chunk per stage: in-flight micro-batches x activation_bytes)."""
    v = tcfg.virtual_stages
    size = [activation_bytes(cfg, tcfg, tp, pp, dp, stage, fused=fused, chunk=c) for c in range(v)]
    left = weight_grad_bytes(cfg, tcfg, tp, pp, dp, stage) if tcfg.schedule == "zb-h1" else 0   # from B to W
    held = peak = 0
    for kind, _, c in stage_ops(tcfg.schedule, pp, tcfg.microbatches, stage, v):
        held += {"F": size[c], "B": left - size[c], "W": -left}[kind]
        peak = max(peak, held)
    return peak


def state_bytes_per_param(tcfg: TrainConfig) -> int:
    """Optimizer state per parameter: two Adam moments (4 B each, 2 B with --moments bf16), plus
    4 B of fp32 master weights only where they differ from the parameters' dtype (bf16-mixed);
    elsewhere the master weights are the parameters themselves (precision.py)."""
    master = master_dtype(tcfg.precision)
    return 2 * moment_dtype(tcfg.moments).itemsize + (master.itemsize if master != param_dtype(tcfg.precision) else 0)


def optimizer_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0,
                    dp_rank: int = 0) -> int:
    """Adam moments + separate master weights, if any, on one rank (1/dp of them with ZeRO-1)."""
    shards = dp if tcfg.zero else 1
    return sum(padded_size(n, shards) // shards
               for n in flat_groups(cfg, tp, pp, stage, tcfg.zero)) * state_bytes_per_param(tcfg)


def bytes_per_param_line(tcfg: TrainConfig) -> str:
    """What --precision and --moments keep per parameter, before any ZeRO-1 sharding."""
    s, m = dtype_bytes(tcfg.precision), moment_dtype(tcfg.moments).itemsize
    sep = state_bytes_per_param(tcfg) - 2 * m
    weights = f"weights {s} ({'fp32' if s == 4 else 'bf16'}" + (", also the master weights)" if not sep else ")")
    master = f" + fp32 master weights {sep}" if sep else ""
    moments = f"Adam moments 2 x {m} ({'fp32' if m == 4 else 'bf16, stochastically rounded'})"
    return (f"bytes per parameter: {weights}{master} + {moments} + fp32 gradient buffer 4 (micro-batches and "
            f"the dp sum added exactly) = {s + sep + 2 * m + 4}")


def weight_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0) -> int:
    """The parameters in their flat buffers (optim.FlatGroup.flat), padded to a multiple of dp under ZeRO;
    ZeRO-3 keeps only the 1/dp shard between uses (zero3.py)."""
    shards = dp if tcfg.zero else 1
    kept = shards if tcfg.zero == 3 else 1
    return dtype_bytes(tcfg.precision) * sum(padded_size(n, shards) // kept
                                             for n in flat_groups(cfg, tp, pp, stage, tcfg.zero))


# Eager backends (cpu, cuda) run FlatAdamW.step's AdamW one op at a time. The
# update works in place in the flat gradient buffer, so fp32 and bf16-mixed
# allocate almost nothing more (bf16-mixed: the bf16 copy of the new weights,
# half an fp32 copy); pure bf16 works on an fp32 copy of its bf16 master (1.5
# copies with the rounding); software stochastic rounding adds its int32 noise
# and bit buffers (4.5 copies). Counted in fp32-sized copies of the largest
# group's shard (measured on CUDA: tests/test_plan.py). --moments bf16 adds the
# fp32 copies of the two moments, alive beside the master's while each is
# rounded back: 2 more (derived from the above, not measured). XLA fuses the
# update into one kernel and needs none of them.
EAGER_STEP_COPIES = {"fp32": 0.0, "bf16-mixed": 0.5, "bf16": 1.5, "bf16-sr": 4.5}
EAGER_STEP_COPIES_BF16_MOMENTS = 2.0


def optimizer_step_bytes(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                         eager: bool) -> tuple[int, int]:
    """(flat fp32 gradient buffers kept between steps, extra bytes during FlatAdamW.step).

    One buffer per group (tp-sharded matrices, replicated norms), padded to a
    multiple of dp under ZeRO-1; ZeRO-2 keeps only its 1/dp shard. During the
    step ZeRO-1 also holds the reduce-scattered 1/dp gradient shards (ZeRO-2's
    are the buffers) and, one group at a time, the all-gathered new weights in
    the parameter dtype."""
    groups = flat_groups(cfg, tp, pp, stage, tcfg.zero)
    shards = dp if tcfg.zero else 1
    kept = shards if tcfg.zero >= 2 else 1
    buffers = 4 * sum(padded_size(n, shards) // kept for n in groups)
    largest_shard = max(padded_size(n, shards) // shards for n in groups)
    during = 0
    if shards > 1:
        during += 4 * sum(padded_size(n, shards) // shards for n in groups) if tcfg.zero == 1 else 0
        during += dtype_bytes(tcfg.precision) * max(padded_size(n, shards) for n in groups) if tcfg.zero < 3 else 0
    if eager:
        copies = EAGER_STEP_COPIES[tcfg.precision] + (EAGER_STEP_COPIES_BF16_MOMENTS if tcfg.moments == "bf16" else 0)
        during += int(4 * copies * largest_shard)
    return buffers, during


def memory_per_rank(cfg: ModelConfig, tcfg: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                    fused: bool = True, eager: bool = False) -> dict:
    """The per-rank breakdown of one stage, in bytes (module docstring). `fused`:
    the attention kernel keeps no T*T scores; `eager`: cpu/cuda, not xla."""
    params = stage_param_counts(cfg, tp, pp, stage)["total"]
    s = dtype_bytes(tcfg.precision)
    flight = microbatches_in_flight(tcfg.schedule, pp, tcfg.microbatches, stage, tcfg.virtual_stages)
    flat, temporaries = optimizer_step_bytes(cfg, tcfg, tp, pp, dp, stage, eager)
    out = {"params": params, "weights": weight_bytes(cfg, tcfg, tp, pp, dp, stage),
           "grads": 0,   # accumulated in the fp32 buffers
           "optimizer": optimizer_bytes(cfg, tcfg, tp, pp, dp, stage),
           "optimizer_zero1": optimizer_bytes(cfg, dataclasses.replace(tcfg, zero=1, zero1=False), tp, pp, dp, stage),
           "optimizer_replicated": optimizer_bytes(cfg, dataclasses.replace(tcfg, zero=0, zero1=False), tp, pp, dp, stage),
           "in_flight": flight,
           "activations": activations_in_flight_bytes(cfg, tcfg, tp, pp, dp, stage, fused=fused),
           # the loss's backward briefly holds two more (mb, T, V/tp) tensors, the
           # gradient of the fp32 logits and of the head's output (parameter
           # dtype), while most activations are still alive (measured on CUDA)
           "loss_backward": (4 + s) * micro_batch_size(tcfg, dp) * tcfg.seq_len * cfg.padded_vocab // tp
                            if stage == pp - 1 else 0,
           "flat_grads": flat, "step_temporaries": temporaries,
           # ZeRO-2: buckets staged in the backward until their reduce-scatter (ends), at most all of them
           "grad_staging": (4 * sum(padded_size(n, dp) for n in flat_groups(cfg, tp, pp, stage))
                            if tcfg.zero == 2 else 4 * zero3_gathered(cfg, tp, dp)) if tcfg.zero >= 2 and dp > 1 else 0,
           # ZeRO-3: the units whole at once (in the parameter dtype), and one group's all-gather result
           "gathered": s * (zero3_gathered(cfg, tp, dp)
                            + max(padded_size(n, dp) for n in flat_groups(cfg, tp, pp, 0, 3))) if tcfg.zero == 3 else 0}
    if out["grad_staging"] and tcfg.overlap_grad_reduce and eager:
        # overlapped: each started bucket also holds its 1/dp result until the micro-batch's backward ends
        out["grad_staging"] += out["grad_staging"] // dp
    out["forward_backward"] = out["activations"] + out["loss_backward"] + out["grad_staging"] + out["gathered"]
    out["optimizer_step"] = temporaries
    out["peak"] = (out["weights"] + out["grads"] + out["optimizer"] + flat
                   + max(out["forward_backward"], out["optimizer_step"]))
    return out


# ---------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------

def _add(out: dict, key: str, payload: int, calls: int, n: int) -> None:
    """`calls` collectives of `payload` bytes each over a group of n ranks."""
    if calls and payload:
        e = out.setdefault(key, dict.fromkeys(comm.FIGURES, 0))
        e["payload"] += payload * calls
        e["wire"] += comm.wire_bytes(key.split(".")[1], n, payload) * calls
        e["calls"] += calls


def _add_buckets(out: dict, key: str, elems: int, bucket: int, rows: int, size: int, n: int) -> None:
    """data_parallel's bucketed collectives: `elems` columns cut into buckets of
    at most `bucket` columns, each call moving rows x columns x size bytes."""
    bucket = max(1, bucket)
    full, rest = divmod(elems, bucket)
    _add(out, key, rows * bucket * size, full, n)
    _add(out, key, rows * rest * size, 1 if rest else 0, n)


@functools.lru_cache(maxsize=1024)
def exchanges_per_boundary(schedule: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Ticks in which something crosses boundary b|b+1: b runs a forward or b+1
    a backward; interleaved (v > 1) adds the wrap boundary, last | first stage,
    last in the tuple: the last stage runs a forward of a chunk c < v-1, or the
    first a backward of a chunk c > 0."""
    ticks = timetable(schedule, pp, m, v)
    out = [sum(1 for row in ticks if (row[b] and row[b][0] == "F") or (row[b + 1] and row[b + 1][0] == "B"))
           for b in range(pp - 1)]
    if v > 1:
        out.append(sum(1 for row in ticks if (row[-1] and row[-1][0] == "F" and row[-1][2] < v - 1)
                       or (row[0] and row[0][0] == "B" and row[0][2] > 0)))
    return tuple(out)


def comm_per_step(cfg: ModelConfig, tcfg: TrainConfig, mesh, whole_block_replay: bool | None = None) -> dict:
    """Per optimizer step on `mesh.rank`, keyed like the CommLedger ('tp.all_reduce',
    'pp.exchange', ...): {payload, wire, padding, calls}. See comm.py for what
    each figure counts.

    whole_block_replay: whether full activation checkpointing replays a whole
    block's forward in backward (torch_xla's reentrant checkpoint; default: on
    --device xla) or stops early (torch's non-reentrant one, cpu and cuda)."""
    if whole_block_replay is None:
        whole_block_replay = tcfg.device == "xla"
    tp, pp, dp = mesh.tp, mesh.pp, mesh.dp
    dp_rank, stage, _ = coords(mesh.rank, tp, pp, dp)
    s = dtype_bytes(tcfg.precision)
    m = tcfg.microbatches
    mb = tcfg.batch_size // (dp * m)
    T, C = tcfg.seq_len, cfg.d_model
    sp = tcfg.sequence_parallel and tp > 1
    act = mb * T * C * s                       # one full-sequence residual-stream tensor
    layers = cfg.n_layers // pp
    out: dict = {}
    if tp > 1:
        # Per block, attention and MLP each enter the tp region (fwd: sp all-gather
        # or nothing; bwd: reduce-scatter or all-reduce) and leave it (fwd:
        # reduce-scatter or all-reduce; bwd: all-gather or nothing). Full activation
        # checkpointing replays the forward ones in backward: torch's checkpoint
        # stops replaying once it has recomputed all that backward needs, i.e.
        # before the MLP's leave (nothing after it keeps a tensor); torch_xla's
        # replays the whole block.
        # With --sp-regather each enter all-gathers once more in backward.
        full = tcfg.activation_checkpointing == "full"
        enters_fwd = 2 * (1 + full)
        regathers = 2 if tcfg.sp_regather else 0
        leaves_fwd = 2 + full + (full and whole_block_replay)
        per_layer = m * layers                 # calls per collective per block
        if sp:
            _add(out, "tp.all_gather", act, per_layer * (enters_fwd + 2 + regathers), tp)   # + leaves' backward
            _add(out, "tp.reduce_scatter", act, per_layer * (leaves_fwd + 2), tp)  # + the enters' backward
        else:
            _add(out, "tp.all_reduce", act, per_layer * (leaves_fwd + 2), tp)
        if stage == 0:   # embedding leaves the tp region: fwd reduce, (sp: bwd all-gather)
            _add(out, "tp.reduce_scatter" if sp else "tp.all_reduce", act, m, tp)
            _add(out, "tp.all_gather", act, m if sp else 0, tp)
        if stage == pp - 1:
            # final norm -> head enters the region; the loss moves three (mb, T) fp32 tensors
            if sp:
                _add(out, "tp.all_gather", act, m * (1 + (regathers > 0)), tp)
                _add(out, "tp.reduce_scatter", act, m, tp)
            else:
                _add(out, "tp.all_reduce", act, m, tp)
            _add(out, "tp.all_gather", tp * mb * T * 4, m, tp)      # local maxima
            _add(out, "tp.all_reduce", mb * T * 4, 2 * m, tp)      # sum of exps, target logit
    if pp > 1:
        # Each boundary of this stage: one exchange per tick with traffic; this rank
        # sends m real tensors (activations right, or gradients left) and receives m,
        # and sends zeros in the other ticks (padding). Interleaved: m per chunk, v
        # chunks; the wrap boundary (last stage | first) carries v-1 of them.
        x = mb * (T // tp if sp else T) * C * s
        v = tcfg.virtual_stages
        ticks = exchanges_per_boundary(tcfg.schedule, pp, m, v)
        crossing = [(b, v * m) for b in (stage - 1, stage) if 0 <= b < pp - 1]
        if v > 1 and stage in (0, pp - 1):
            crossing.append((pp - 1, (v - 1) * m))                 # ticks[pp - 1]: the wrap boundary
        for b, n in crossing:
            e = out.setdefault("pp.exchange", dict.fromkeys(comm.FIGURES, 0))
            e["payload"] += 2 * n * x
            e["wire"] += n * x
            e["padding"] += (ticks[b] - n) * x
            e["calls"] += ticks[b]
        _add(out, "pp.all_reduce", 4, 2, pp)                      # loss sum, grad-norm square
    groups = group_kinds(cfg, tp, pp, stage, tcfg.zero)
    shards = dp if tcfg.zero else 1
    kept = shards if tcfg.zero >= 2 else 1     # ZeRO-2, 3 sum over tp on their shard (optim.py)
    for kind, n in groups:
        if sp and kind == "replicated":        # norm grads (ZeRO-3: one group per unit)
            _add(out, "tp.all_reduce", padded_size(n, shards) // kept * 4, 1, tp)
        if kind == "kv":   # kv heads held by tp/n_kv ranks: their fp32 flat buffer of wk, wv grads summed
            _add(out, "kv.all_reduce", padded_size(n, shards) // kept * 4, 1, tp // cfg.n_kv_heads)
    if tp > 1:
        _add(out, "tp.all_reduce", 4, 1, tp)                      # grad-norm square
    if dp > 1:
        _add(out, "dp.all_reduce", 4, 1, dp)                      # loss
        bucket = int(tcfg.bucket_mb * 2**20 / 4)                     # fp32 elements per bucket
        for _, n in groups:   # one flat buffer after the other (optim.FlatGroup)
            if tcfg.zero:   # buckets cut the (dp, shard) view by columns; ZeRO-2, 3: every micro-batch
                cols = padded_size(n, dp) // dp
                for _ in range(m if tcfg.zero >= 2 else 1):
                    _add_buckets(out, "dp.reduce_scatter", cols, bucket // dp, dp, 4, dp)
                # the new weights after the step; ZeRO-3: each micro-batch's forward and backward instead
                for _ in range(2 * m if tcfg.zero == 3 else 1):
                    _add_buckets(out, "dp.all_gather", cols, bucket // dp, dp, s, dp)
            else:
                _add_buckets(out, "dp.all_reduce", n, bucket, 1, 4, dp)
        if tcfg.zero:
            _add(out, "dp.all_reduce", 4, 1, dp)                  # grad-norm square
    return dict(sorted(out.items()))


def comm_bytes_per_step(cfg: ModelConfig, tcfg: TrainConfig, mesh, whole_block_replay: bool | None = None) -> dict:
    """Payload bytes per collective (comm_per_step's 'payload' figure)."""
    return {k: v["payload"] for k, v in comm_per_step(cfg, tcfg, mesh, whole_block_replay).items()}


# ---------------------------------------------------------------------------
# The printed plan
# ---------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    """A count in human units, 3 significant digits: 250k, 4.19M, 6.74B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def fmt_flop(f: float, unit: str = "FLOP") -> str:
    for prefix, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if f >= size:
            return f"{f / size:.4g} {prefix}{unit}"
    return f"{f:.3g} {unit}"


def fmt_seconds(s: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60), ("s", 1), ("ms", 1e-3)):
        if s >= size:
            return f"{s / size:.2f} {unit}"
    return f"{s * 1e6:.1f} us"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                      for i, (c, w) in enumerate(zip(r, widths)))
    return [line(header).rstrip()] + [line(r).rstrip() for r in rows]


def shown_stages(pp: int) -> list[int]:
    return list(range(pp)) if pp <= 16 else [0, 1, pp - 2, pp - 1]


def schedule_text(tcfg: TrainConfig) -> str:
    """'1f1b', or 'interleaved (v=2 chunks per stage)'."""
    v = tcfg.virtual_stages
    return tcfg.schedule + (f" (v={v} chunks per stage)" if v > 1 else "")


def validate_plan_layout(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> tuple[int, list[str]]:
    """mesh.validate_layout, and what to note about the layout. Returns dp and notes to print."""
    dp = validate_layout(cfg, tcfg, world)
    if tcfg.tp <= cfg.n_kv_heads:
        return dp, []
    return dp, [f"note: tp {tcfg.tp} > {cfg.n_kv_heads} kv heads, so each tp rank holds a replica of one kv head, the one "
                f"its query heads use (each shared by {tcfg.tp // cfg.n_kv_heads} ranks, as HLAT-70B ran); their wk and "
                f"wv gradients are summed over those ranks once per step, in fp32 (kv.all_reduce below)."]


def report(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> str:
    """Everything above as text: the answer to `train.py --plan`."""
    dp, notes = validate_plan_layout(cfg, tcfg, world)
    tp, pp, m = tcfg.tp, tcfg.pp, tcfg.microbatches
    sp = tcfg.sequence_parallel and tp > 1
    tokens = tcfg.batch_size * tcfg.seq_len
    L = [f"plan for preset {tcfg.preset}: {fmt_count(cfg.num_params())} parameters "
         f"(vocabulary {cfg.vocab_size}, padded {cfg.padded_vocab}), {world} ranks",
         f"  layout: dp {dp} x pp {pp} x tp {tp}; sequence parallel "
         f"{('on, ' + ('re-gathered in backward' if tcfg.sp_regather else 'gathers kept')) if sp else 'off'}; "
         f"activation checkpointing {tcfg.activation_checkpointing}; "
         f"{f'ZeRO-{tcfg.zero}' if tcfg.zero else 'replicated optimizer'}; precision {tcfg.precision}; schedule {schedule_text(tcfg)}",
         f"  batch: {tcfg.batch_size} sequences x {tcfg.seq_len} tokens = {tokens:,} tokens per step; per dp rank "
         f"{tcfg.batch_size // dp} = {m} micro-batch(es) of {micro_batch_size(tcfg, dp)}"]
    L.append("  " + bytes_per_param_line(tcfg))
    L += ["  " + n for n in notes]
    L += ["", "mesh (rank -> coordinates, and the layers each stage holds)",
          layout_table(tp, pp, dp, cfg.n_layers, max_rows=16, v=tcfg.virtual_stages)]
    L += _memory_section(cfg, tcfg, dp)
    L += _comm_section(cfg, tcfg, dp)
    L += _time_section(cfg, tcfg, world)
    L += _kv_cache_section(cfg, tcfg)
    return "\n".join(L)


def _memory_section(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    tp, pp, m = tcfg.tp, tcfg.pp, tcfg.microbatches
    eager = tcfg.device in ("cpu", "cuda")    # else plan for xla (trn1), also for --device auto
    mems = {s: memory_per_rank(cfg, tcfg, tp, pp, dp, s, fused=eager, eager=eager) for s in range(pp)}
    largest = max(range(pp), key=lambda s: mems[s]["peak"])
    L = ["", "parameters and memory per rank (every rank of a stage holds the same), assuming "
             + ("an eager backend (cpu/cuda): fused attention kernel, unfused AdamW" if eager else
                "xla (trn1): T*T attention scores kept, AdamW fused into one kernel; "
                "--device cpu or cuda for eager")]
    rows, staging = [], any(mems[s]["grad_staging"] for s in range(pp))   # (ZeRO-2's column)
    during = ({1: "ZeRO-1 shards and gathers", 2: "ZeRO-2 gathers"}.get(tcfg.zero),
              eager and "in-place AdamW temporaries")
    step_parts = " + ".join(x for x in during if x) or "nothing more"
    gathered = any(mems[s]["gathered"] for s in range(pp))                # (ZeRO-3's)
    for s in shown_stages(pp):
        r = mems[s]
        step = fmt_bytes(r["step_temporaries"])
        rows.append([s, stage_layer_text(cfg.n_layers, pp, s, tcfg.virtual_stages), fmt_count(r["params"]), fmt_bytes(r["weights"]),
                     fmt_bytes(r["grads"]), fmt_bytes(r["optimizer_replicated"]), fmt_bytes(r["optimizer_zero1"]),
                     (f"{r['in_flight']} x " if tcfg.schedule != "zb-h1" else f"{r['in_flight']} mb: ")
                     + fmt_bytes(r["activations"] / (r["in_flight"] if tcfg.schedule != "zb-h1" else 1)),
                     fmt_bytes(r["flat_grads"]), fmt_bytes(r["loss_backward"])]
                    + ([fmt_bytes(r["grad_staging"])] if staging else [])
                    + ([fmt_bytes(r["gathered"])] if gathered else []) + [step, fmt_bytes(r["peak"])])
    L += _table(["stage", "layers", "params", "weights", "grads", "Adam", "Adam ZeRO-1", "activations",
                 "fp32 grads", "loss bwd"] + (["grad staging"] if staging else []) + (["gathered"] if gathered else [])
                + ["optimizer step", "peak"], rows)
    L.append(f"  peak = weights + grads + Adam ({f'ZeRO-{tcfg.zero}' if tcfg.zero else 'no ZeRO'}, as configured) + "
             f"fp32 gradient buffers + the larger of (activations in flight + loss backward"
             + (f" + ZeRO-{tcfg.zero}'s grad staging" if staging else "")
             + (" + the layers gathered" if gathered else "") + ") and (optimizer step: " + step_parts + ")")
    biggest = mems[largest]["peak"]
    for dev in PLAN_DEVICES[tcfg.device]:
        if dev in DEVICE_MEMORY:
            cap = DEVICE_MEMORY[dev]
            L.append(f"  largest stage {largest}: {fmt_bytes(biggest)} of {fmt_bytes(cap)} on one {dev}: "
                     + ("fits" if biggest <= cap else f"does NOT fit ({biggest / cap:.1f}x)"))

    flight = mems[largest]["in_flight"]
    held = (f"{flight} chunk activations of {m} micro-batch(es), each 1/{tcfg.virtual_stages} of the stage,"
            if tcfg.virtual_stages > 1 else f"{flight} of {m} micro-batch(es)")
    L += ["", f"activations per rank of stage {largest}, by checkpointing mode ({held} "
              f"of {micro_batch_size(tcfg, dp)} x {tcfg.seq_len} tokens in flight):"]
    rows, sp_label = [], "on, re-gather" if tcfg.sp_regather else "on, kept"
    for mode in ("none", "selective", "full"):
        for sp in ((False, True) if tp > 1 else (False,)):
            kept = activation_bytes(cfg, tcfg, tp, pp, dp, largest, mode, sp, fused=False)
            fused = activation_bytes(cfg, tcfg, tp, pp, dp, largest, mode, sp, fused=True)
            this = (mode, sp) == (tcfg.activation_checkpointing, tcfg.sequence_parallel and tp > 1)
            rows.append([mode, sp_label if sp else "off", fmt_bytes(kept), fmt_bytes(flight * kept),
                         fmt_bytes(fused), fmt_bytes(flight * fused), "<- this run" if this else ""])
    L += _table(["checkpointing", "seq-parallel", "T*T kept: 1 mb", "in flight",
                 "fused attn: 1 mb", "in flight", ""], rows)
    L.append("  'T*T kept': softmax probabilities stored (Korthikanti et al.; torch_xla's matmul+softmax); "
             "'fused': a flash/efficient SDPA kernel (cpu, cuda)")
    if tcfg.schedule == "zb-h1":
        L.append(f"  zb-h1: 'in flight' counts each micro-batch whole; from its B to its W it keeps only its linears' "
                 f"inputs and output gradients, {fmt_bytes(weight_grad_bytes(cfg, tcfg, tp, pp, dp, largest))} "
                 f"(any checkpointing mode): {fmt_bytes(mems[largest]['activations'])} at most, walking its order")
    if tp > 1:
        L.append("  " + ("'re-gather' (--sp-regather): the matmuls after each norm keep its T/tp output and "
                         "all-gather it again in backward" if tcfg.sp_regather else
                         "'kept' (--no-sp-regather): the matmuls after each norm keep the all-gathered sequence"))
    return L


# ---------------------------------------------------------------------------
# Time: compute, communication and the bubble -> an estimated step
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Network:
    """How fast one process's device talks to the others: inside its node (one
    instance / server) and across nodes, in bytes/s sent per device in one
    direction, and a fixed cost per collective call."""
    node: str
    per_node: int            # devices (processes) in one node
    inside: float            # B/s a device sends to devices of its own node
    across: float            # B/s a device sends to other nodes: its share of the node's network
                             # (tp, pp); the dp ring instead divides the whole, across x per_node,
                             # by the hops that leave the node at once (dp_ring)
    latency_inside: float    # s per collective call, inside a node  (assumption)
    latency_across: float    # s per collective call, across nodes   (assumption)
    note: str                # printed with the estimate: what is stated and what is assumed


NETWORKS = {
    # trn1.32xlarge: 16 Trainium chips = 32 NeuronCore-v2, linked by NeuronLink-v2
    # (a 4D hypercube; 4 links per chip), and 800 Gbps of EFA to other instances
    # (AWS Neuron docs, "Trn1/Trn1n Architecture"; "Trainium/Inferentia2
    # Architecture Guide for NKI"). EFA: 800e9 / 8 B/s shared by the 32 cores.
    # The docs give no NeuronLink-v2 bandwidth: 100 GB/s per core is an assumption.
    "NeuronCore-v2": Network("trn1.32xlarge", 32, 100e9, 800e9 / 8 / 32, 10e-6, 30e-6,
                             "32 NeuronCores per trn1.32xlarge and 800 Gbps EFA per instance (Neuron docs); "
                             "NeuronLink-v2 at 100 GB/s per core is an ASSUMPTION (the docs give no figure; "
                             "measure with nccom-test)"),
    # DGX A100: 8 GPUs, NVLink 3 at 600 GB/s per GPU, both directions together
    # (A100 datasheet); 8 x 200 Gb/s HDR InfiniBand, one per GPU (DGX A100 datasheet).
    "A100": Network("DGX A100", 8, 300e9, 200e9 / 8, 10e-6, 20e-6,
                    "NVLink 600 GB/s per GPU (both directions), 200 Gb/s InfiniBand per GPU (NVIDIA datasheets)"),
    # DGX H100: 8 GPUs, NVLink 4 at 900 GB/s per GPU, both directions (H100
    # datasheet); 8 x 400 Gb/s ConnectX-7 InfiniBand, one per GPU (DGX H100 datasheet).
    "H100": Network("DGX H100", 8, 450e9, 400e9 / 8, 10e-6, 20e-6,
                    "NVLink 900 GB/s per GPU (both directions), 400 Gb/s InfiniBand per GPU (NVIDIA datasheets)"),
    # HGX H200: the same NVLink 900 GB/s per GPU (H200 datasheet); nodes built
    # like the DGX H100, one 400 Gb/s InfiniBand port per GPU (assumed).
    "H200": Network("HGX H200", 8, 450e9, 400e9 / 8, 10e-6, 20e-6,
                    "NVLink 900 GB/s per GPU (H200 datasheet); 400 Gb/s InfiniBand per GPU, as in a DGX H100 "
                    "(assumed)"),
    # gloo over the loopback of one machine: memory copies through the kernel.
    # On the 2-core development machine, busy with other work, a 16 MiB all-reduce
    # between 2 processes ran at 0.18 GB/s and a 4-byte one took ~6 ms; quiet, it
    # does several times better. Stated, not measured per run.
    "cpu": Network("one machine", 1 << 30, 1e9, 1e9, 50e-6, 50e-6,
                   "gloo over loopback: 1 GB/s per process and 50 us per call, STATED (a busy 2-core machine "
                   "measured 0.18 GB/s)"),
}
NETWORKS["NeuronCore-v2 (trn1n)"] = dataclasses.replace(          # trn1n.32xlarge: twice the EFA
    NETWORKS["NeuronCore-v2"], node="trn1n.32xlarge", across=1600e9 / 8 / 32,
    note="trn1n.32xlarge: the same, with 1600 Gbps EFA per instance (Neuron docs)")


def group_inside_node(ranks: list[int], per_node: int) -> bool:
    """Whether every rank of a group sits in the same node (ranks fill nodes in order)."""
    return len({r // per_node for r in ranks}) == 1


# ---------------------------------------------------------------------------
# The dp ring, hop by hop
#
# A ring collective over n ranks in rank order sends, at every one of its
# steps, one chunk from each rank to the next (the last to the first), all
# hops at once; the step ends when the slowest hop has delivered. With 4 dp
# ranks per node (hlat-7b: tp 8 on a 32-core trn1.32xlarge) the dp ring
# 0 -> 8 -> 16 -> 24 -> 32 -> ... stays on NeuronLink for 3 hops of 4 and
# leaves the node on the 4th. The hops that leave a node at the same time,
# one per ring that runs then (8 rings: one per tp rank), share its EFA.
# ---------------------------------------------------------------------------

def ring_hops(ranks: list[int], per_node: int) -> list[tuple[int, int, bool]]:
    """The hops of a ring over `ranks` in their order: (sender, receiver, leaves the node)."""
    n = len(ranks)
    return [(ranks[i], ranks[(i + 1) % n], ranks[i] // per_node != ranks[(i + 1) % n] // per_node)
            for i in range(n)] if n > 1 else []


def dp_groups(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every dp group, ranks in ring order: one per (stage, tp rank); all reduce at the same time."""
    return [[rank_of(d, s, t, tp, dp) for d in range(dp)] for s in range(pp) for t in range(tp)]


def rings_leaving_a_node(groups: list[list[int]], per_node: int) -> int:
    """The most hops, over all nodes, that leave one node at the same time when
    every ring in `groups` runs at once: the ways its network is shared."""
    leaving: dict[int, int] = {}
    for ranks in groups:
        for sender, _, off in ring_hops(ranks, per_node):
            if off:
                leaving[sender // per_node] = leaving.get(sender // per_node, 0) + 1
    return max(leaving.values(), default=0)


@dataclasses.dataclass(frozen=True)
class Ring:
    """Rank 0's dp ring on a network: its hops, and what sets its pace."""
    ranks_per_node: int      # ranks of the ring in rank 0's node
    on_node: int             # hops that stay inside a node (NeuronLink / NVLink)
    off_node: int            # hops over the network (EFA / InfiniBand)
    sharing: int             # hops leaving one node at once, all rings together
    off_node_bw: float       # B/s of one off-node hop: the node's network / sharing
    bandwidth: float         # B/s of the slowest hop: the ring's pace
    latency: float           # s per collective call (across, if any hop leaves the node)


@functools.lru_cache(maxsize=4096)
def dp_ring(tp: int, pp: int, dp: int, net: Network) -> Ring:
    """Rank 0's dp ring, hop by hop, on `net` (every dp ring has the same shape)."""
    hops = ring_hops(dp_groups(tp, 1, dp)[0], net.per_node)
    off = sum(1 for *_, o in hops if o)
    sharing = rings_leaving_a_node(dp_groups(tp, pp, dp), net.per_node) if off else 0
    off_bw = net.across * net.per_node / sharing if off else 0.0   # the node's whole network, shared
    on_node = len(hops) - off
    bandwidth = min([net.inside] * (on_node > 0) + [off_bw] * (off > 0), default=net.inside)
    per_node = sum(1 for d in range(dp) if rank_of(d, 0, 0, tp, dp) // net.per_node == 0)
    return Ring(per_node, on_node, off, sharing, off_bw, bandwidth,
                net.latency_across if off else net.latency_inside)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, mode: str) -> float:
    """FLOPs activation checkpointing repeats in backward, per token: the whole
    forward (a third of the training FLOPs) with full, the attention core's two
    matmuls (QK^T and softmax V, 4 x layers x d_model x seq_len) with selective."""
    if mode == "full":
        return flops_per_token(cfg, seq_len) / 3
    if mode == "selective":
        return 4.0 * cfg.n_layers * cfg.d_model * seq_len
    return 0.0


def estimate_step(cfg: ModelConfig, tcfg: TrainConfig, world: int, device: str, utilisation: float = DEFAULT_MFU,
                  network: Network | None = None) -> dict:
    """Seconds per step on `device`, part by part, for the layout in `t` (see
    `_time_section` for the assumptions). Slowest of the first and last stage."""
    tp, pp = tcfg.tp, tcfg.pp
    dp = world // (tp * pp)
    m = tcfg.microbatches
    net = network or NETWORKS[device]
    threads = max(1, tcfg.threads) if device == "cpu" else None
    peak = peak_flops(device.split(" ")[0], tcfg.precision, threads)
    tokens = tcfg.batch_size * tcfg.seq_len
    model_flops = flops_per_token(cfg, tcfg.seq_len) * tokens
    hardware_flops = model_flops + recompute_flops_per_token(cfg, tcfg.seq_len, tcfg.activation_checkpointing) * tokens
    compute = hardware_flops / world / (peak * utilisation)
    groups = {"tp": [rank_of(0, 0, r, tp, dp) for r in range(tp)],       # rank 0's groups
              "dp": [rank_of(d, 0, 0, tp, dp) for d in range(dp)],
              "pp": [rank_of(0, s, 0, tp, dp) for s in range(min(pp, 2))],
              "kv": [rank_of(0, 0, r, tp, dp) for r in range(kv_replicas(cfg, tp))]}   # copies of one kv head
    inside = {g: group_inside_node(r, net.per_node) for g, r in groups.items()}
    ring = dp_ring(tp, pp, dp, net)
    links = {g: (net.inside, net.latency_inside) if inside[g] else (net.across, net.latency_across) for g in groups}
    links["dp"] = (ring.bandwidth, ring.latency)     # the dp ring goes at its slowest hop's pace
    comm_s = dict.fromkeys(groups, 0.0)
    dp_wire, grad_s = 0, 0.0
    for stage in sorted({0, pp - 1}):
        per = dict.fromkeys(groups, 0.0)
        entries = comm_per_step(cfg, tcfg, Mesh(tp, pp, dp, rank_of(0, stage, 0, tp, dp)))
        dp_wire = max(dp_wire, sum(e["wire"] + e["padding"] for k, e in entries.items() if k.startswith("dp.")))
        for key, e in entries.items():
            g = key.split(".")[0]
            bw, lat = links[g]
            per[g] += (e["wire"] + e["padding"]) / bw + e["calls"] * lat   # nanohlat sends the padding too
        bw, lat = links["dp"]   # the gradients' dp collective, the one --overlap-grad-reduce starts in backward
        e = entries.get("dp.reduce_scatter" if tcfg.zero else "dp.all_reduce")
        loss = 0 if tcfg.zero else 1                       # (ZeRO-0: the loss's all-reduce, after the backward)
        grad_s = max(grad_s, ((e["wire"] - loss * comm.wire_bytes("all_reduce", dp, 4)) / bw
                              + (e["calls"] - loss) * lat) if e else 0.0)
        comm_s = {g: max(comm_s[g], per[g]) for g in groups}
    comm_s["tp"] += comm_s.pop("kv")   # the kv-head gradient sum, once per step: counted like the norm gains' tp one
    # each micro-batch's forward + backward, with its tp collectives and pp exchanges
    per_microbatch = (compute + comm_s["tp"] + comm_s["pp"]) / m
    # (p-1)/(m+p-1) of the pipeline's time; interleaved: its p-1 fill and drain ops are chunks,
    # 1/v of a stage's work each: (p-1)/(v*m+p-1); zb-h1: (p-1)/(3m+p-1), its p-1 are single
    # F, B or W ops, a third of a micro-batch's work each (F = B = W, as timeline.py's ideal)
    bubble = (pp - 1) * per_microbatch / (3 if tcfg.schedule == "zb-h1" else tcfg.virtual_stages)
    pipeline = m * per_microbatch + bubble
    # a framework that overlaps the dp reduction with the backward hides up to
    # the backward's time (two thirds of the compute)
    overlapped = pipeline + max(0.0, comm_s["dp"] - 2 / 3 * compute)
    # nanohlat's --overlap-grad-reduce (eager devices: cpu, cuda) hides the gradients' collective behind
    # the backward of the last micro-batch (ZeRO-0, 1), or of each micro-batch (ZeRO-2); on XLA, nothing
    eager = not device.startswith("NeuronCore")
    hidden = min(grad_s, 2 / 3 * compute / (1 if tcfg.zero >= 2 else m)) if tcfg.overlap_grad_reduce and eager else 0.0
    step = pipeline + comm_s["dp"] - hidden                 # the rest of the dp reduction after backward
    return {"device": device, "network": net, "peak": peak, "utilisation": utilisation, "dp_ring": ring,
            "dp_bytes": dp_wire,
            "model_flops": model_flops, "hardware_flops": hardware_flops, "compute": compute,
            "comm": comm_s, "inside": inside, "bubble": bubble, "pipeline": pipeline, "step": step,
            "step_overlapped": min(overlapped, step), "hidden": hidden, "tokens_per_s": tokens / step,
            "mfu": model_flops / (step * world * peak)}


def _time_section(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> list[str]:
    tokens = tcfg.batch_size * tcfg.seq_len
    f_tok = flops_per_token(cfg, tcfg.seq_len)
    L = ["", f"compute: {fmt_flop(f_tok)} per token (6 x matmul params + 12 x layers x d_model x seq_len, "
             f"metrics.flops_per_token) x {tokens:,} tokens = {fmt_flop(f_tok * tokens)} per step, "
             f"{fmt_flop(f_tok * tokens / world)} per rank",
         "", "estimated time per step (rank 0's groups; the slower of the first and last stage)"]
    rows = []
    devices = [d for d in PLAN_DEVICES[tcfg.device]] + (["NeuronCore-v2 (trn1n)"] if tcfg.device in ("xla", "auto") else [])
    for dev in devices:
        e = estimate_step(cfg, tcfg, world, dev)
        sizes = {"tp": tcfg.tp, "pp": tcfg.pp, "dp": world // (tcfg.tp * tcfg.pp)}
        comm_cells = [f"{fmt_seconds(e['comm'][g])} ({_where(e, g)})" if sizes[g] > 1 else "-"
                      for g in ("tp", "pp", "dp")]
        rows.append([dev, fmt_flop(e["peak"], "FLOP/s"), fmt_seconds(e["compute"])] + comm_cells
                    + [fmt_seconds(e["bubble"]) if tcfg.pp > 1 else "-", fmt_seconds(e["step"]),
                       f"{e['tokens_per_s']:,.0f}", f"{e['mfu']:.0%}", fmt_seconds(e["step_overlapped"]),
                       fmt_seconds(e["step"] * tcfg.steps)])
    L += _table(["device", "peak", "compute", "tp comm", "pp exchange", "dp comm", "bubble", "step", "tokens/s",
                 "MFU", "step, dp overlapped", f"{tcfg.steps:,} steps"], rows)
    net_notes = list(dict.fromkeys(NETWORKS[d].note for d in devices))
    L += ["  assumptions:",
          f"  - the matmuls run at {DEFAULT_MFU:.0%} of the device's peak, recomputation included (activation "
          f"checkpointing {tcfg.activation_checkpointing}: "
          f"+{recompute_flops_per_token(cfg, tcfg.seq_len, tcfg.activation_checkpointing) / f_tok:.0%} FLOPs); "
          f"MFU counts the model's FLOPs only",
          "  - communication time = (wire + padding bytes) / link bandwidth + calls x latency, on the links of "
          "the group: 'in' = all its ranks in one node, 'across' = over the network, 'mixed' = a ring with hops "
          "of both kinds; tp and pp: all devices of a node share its network equally; dp: hop by hop, at the "
          "pace of the ring's slowest hop (below)",
          "  - " + "\n  - ".join(net_notes),
          "  - per-call latency: 10 us inside a node, 20-30 us across (accelerators), 50 us (cpu): assumptions",
          "  - stages take equal time; the bubble is " + FORMULAS[tcfg.schedule] + " of the pipeline's time, an op "
          "starting as soon "
          "as its input exists (nanohlat's lock-step ticks lose more: timeline.py)",
          "  - overlap: the tp collectives sit between the matmuls, pipeline exchanges between ticks; on cpu and "
          "cuda --overlap-grad-reduce starts the gradients' dp collective in the backward of the last micro-batch "
          "(ZeRO-2: of each), hiding up to 2/3 of that backward's compute ('step' counts it), on XLA nanohlat "
          "overlaps none of it; 'dp overlapped' hides all the dp reduction behind the whole backward (2/3 of the "
          "compute), as Megatron-LM does (an XLA compiler may schedule it so inside one step graph)"]
    return L + _dp_ring_section(cfg, tcfg, world, devices)


def _where(e: dict, group: str) -> str:
    """'in', 'across' or (a dp ring with hops of both kinds) 'mixed'."""
    if group == "dp" and e["dp_ring"].on_node and e["dp_ring"].off_node:
        return "mixed"
    return "in" if e["inside"][group] else "across"


def _dp_ring_section(cfg: ModelConfig, tcfg: TrainConfig, world: int, devices: list[str]) -> list[str]:
    """"where the dp bytes go": rank 0's dp ring, hop by hop, on each device's network."""
    tp, pp = tcfg.tp, tcfg.pp
    dp = world // (tp * pp)
    if dp == 1:
        return []
    ranks = dp_groups(tp, 1, dp)[0]
    shown = " -> ".join(map(str, ranks[:4])) + (" -> ... -> " + str(ranks[-1]) if dp > 4 else "") + f" -> {ranks[0]}"
    L = ["", f"where the dp bytes go: rank 0's dp ring {shown} ({dp} hops); {tp * pp} such rings reduce at "
             f"once, one per (stage, tp rank)"]
    rows = []
    for dev in devices:
        e = estimate_step(cfg, tcfg, world, dev)
        r, b = e["dp_ring"], e["dp_bytes"]
        net = e["network"]
        rows.append([dev, r.ranks_per_node, r.on_node, r.off_node, r.sharing if r.off_node else "-",
                     f"{r.off_node_bw / 1e9:.3g} GB/s" if r.off_node else "-", fmt_bytes(b),
                     fmt_seconds(b / net.inside) if r.on_node else "-",
                     fmt_seconds(b / r.off_node_bw) if r.off_node else "-", fmt_seconds(e["comm"]["dp"])])
    L += _table(["device", "ring ranks per node", "hops on node", "off node", "hops leaving a node at once",
                 "off-node hop gets", "bytes per hop", "on-node hop", "off-node hop", "dp comm"], rows)
    L += ["  every hop carries the same bytes (each rank's wire bytes of the dp collectives); the ring moves at "
          "its slowest hop's pace, so dp comm = bytes / the slowest hop + calls x latency. An off-node hop gets "
          "the node's network divided by the hops that leave that node at the same time (all rings together)"]
    return L


# ---------------------------------------------------------------------------
# --plan --search: every layout that fits, fastest first
# ---------------------------------------------------------------------------

SEARCH_DEVICE = {"xla": "NeuronCore-v2", "auto": "NeuronCore-v2", "cuda": "H100", "cpu": "cpu"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, tcfg: TrainConfig, world: int):
    """Every valid (tp, pp, dp, micro-batches, ZeRO stage, sequence parallel,
    checkpointing, and on cpu and cuda overlapped gradient reduction or not)
    for this model, batch and world size, as TrainConfigs."""
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            # interleaved: only with pp > 1, its chunks splitting the layers equally, m a multiple of pp
            sched = (dict(schedule="1f1b", virtual_stages=1) if pp == 1 and tcfg.schedule == "interleaved"
                     else dict(schedule=tcfg.schedule, virtual_stages=tcfg.virtual_stages))
            if cfg.n_layers % (pp * sched["virtual_stages"]):
                continue
            try:
                dp, _ = validate_plan_layout(cfg, dataclasses.replace(tcfg, tp=tp, pp=pp, dp=0, microbatches=1,
                                                                      sequence_parallel=False, schedule="1f1b",
                                                                      virtual_stages=1), world)
            except UserError:
                continue
            for m in _divisors(tcfg.batch_size // dp):
                if sched["virtual_stages"] > 1 and m % pp or sched["schedule"] == "zb-h1" and m < pp:
                    continue                    # (zb-h1: at least one micro-batch per stage, mesh.py)
                for sp in ((False, True) if tp > 1 and tcfg.seq_len % tp == 0 else (False,)):
                    # (ZeRO-2 fills a bucket per micro-batch: not with interleaved chunks or zb-h1's B and W;
                    # ZeRO-3: pp 1 on cpu and cuda only, config.py)
                    split = sched["virtual_stages"] > 1 or sched["schedule"] == "zb-h1"
                    zeros = (0, 1) if split else (0, 1, 2)
                    zeros += (3,) if pp == 1 and not split and tcfg.device in ("cpu", "cuda") and not tcfg.compile else ()
                    for zero in (zeros if dp > 1 else (0,)):
                        for mode in ("none", "selective", "full"):
                            for ov in ((True, False) if dp > 1 and tcfg.device in ("cpu", "cuda")
                                       else (tcfg.overlap_grad_reduce,)):
                                yield dataclasses.replace(tcfg, tp=tp, pp=pp, dp=0, microbatches=m,
                                                          sequence_parallel=sp, zero=zero, zero1=False,
                                                          activation_checkpointing=mode, overlap_grad_reduce=ov,
                                                          **sched)


def peak_memory_per_rank(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> int:
    """The plan's peak over the first and last stage (the largest ones)."""
    dp, eager = world // (tcfg.tp * tcfg.pp), tcfg.device in ("cpu", "cuda")
    return max(memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, dp, s, fused=eager, eager=eager)["peak"]
               for s in sorted({0, tcfg.pp - 1}))


def search(cfg: ModelConfig, tcfg: TrainConfig, world: int, device: str) -> list[dict]:
    """Every candidate layout with its estimate and peak memory, fastest first."""
    cap = DEVICE_MEMORY.get(device)
    out = []
    for c in candidate_layouts(cfg, tcfg, world):
        peak = peak_memory_per_rank(cfg, c, world)
        out.append({"t": c, "peak_memory": peak, "fits": cap is None or peak <= cap,
                    "estimate": estimate_step(cfg, c, world, device)})
    out.sort(key=lambda r: (r["estimate"]["step"], r["peak_memory"]))
    return out


def _layout_name(c: TrainConfig) -> tuple:
    return (c.tp, c.pp, c.microbatches, c.zero, c.sequence_parallel and c.tp > 1, c.activation_checkpointing,
            c.overlap_grad_reduce)


def _search_row(i, r, world) -> list[str]:
    c, e = r["t"], r["estimate"]
    return [i, c.tp, c.pp, world // (c.tp * c.pp), c.microbatches, c.zero or "-",
            "yes" if c.sequence_parallel and c.tp > 1 else "-", c.activation_checkpointing,
            fmt_bytes(r["peak_memory"]), fmt_seconds(e["compute"]),
            fmt_seconds(e["comm"]["tp"] + e["comm"]["pp"] + e["comm"]["dp"]),
            fmt_seconds(e["bubble"]) if c.pp > 1 else "-",
            fmt_seconds(e["step"]), f"{e['tokens_per_s']:,.0f}", f"{e['mfu']:.0%}"] + (
            ["on" if c.overlap_grad_reduce and c.tp * c.pp < world else "-"] if c.device in ("cpu", "cuda") else [])


SEARCH_HEADER = ["#", "tp", "pp", "dp", "m", "ZeRO", "SP", "ckpt", "peak mem", "compute", "comm", "bubble",
                 "step", "tokens/s", "MFU"]   # + "overlap" on cpu and cuda


def search_report(cfg: ModelConfig, tcfg: TrainConfig, world: int, top: int = 10) -> str:
    """`train.py --plan --search`: the fastest layouts that fit, and where the
    preset's own layout ranks."""
    device = SEARCH_DEVICE[tcfg.device]
    rows = search(cfg, tcfg, world, device)
    fits = [r for r in rows if r["fits"]]
    cap = DEVICE_MEMORY.get(device)
    L = [f"layout search for preset {tcfg.preset} ({fmt_count(cfg.num_params())} parameters) on {world} x {device}: "
         f"{len(rows)} valid layouts, {len(fits)} fit "
         + (f"{fmt_bytes(cap)} per device" if cap else "(no memory limit known)"),
         f"  batch {tcfg.batch_size} x {tcfg.seq_len} tokens, precision {tcfg.precision}, schedule {schedule_text(tcfg)}; "
         f"ranked by the estimated step time (the assumptions of --plan: {DEFAULT_MFU:.0%} of peak, "
         f"{NETWORKS[device].node} links, "
         + ("the gradients' dp reduction overlapped with the backward where 'overlap' says on)"
            if tcfg.device in ("cpu", "cuda") else "nothing overlapped)")]
    header = SEARCH_HEADER + (["overlap"] if tcfg.device in ("cpu", "cuda") else [])
    L += _table(header, [_search_row(i + 1, r, world) for i, r in enumerate(fits[:top])])
    own = _layout_name(tcfg)
    mine = next((r for r in rows if _layout_name(r["t"]) == own), None)
    if mine is None:
        return "\n".join(L + ["", f"the preset's own layout is not valid for {world} ranks"])
    who = "HLAT's own layout" if tcfg.preset.startswith("hlat") else "the preset's own layout"
    L += ["", f"{who}:"] + _table(header, [_search_row("-", mine, world)])
    L += textwrap.wrap(_why(mine, fits, cap, who).strip(), 100, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(L)


def _why(mine: dict, fits: list[dict], cap, who: str) -> str:
    """Where `mine` ranks among the layouts that fit, and what separates it from the first."""
    best = fits[0] if fits else None
    e = mine["estimate"]
    parts = ("compute", "tp", "pp", "dp", "bubble")
    def costs(x):
        return {"compute": x["compute"], "tp": x["comm"]["tp"], "pp": x["comm"]["pp"], "dp": x["comm"]["dp"],
                "bubble": x["bubble"]}
    if not mine["fits"]:
        text = (f"  it does not fit: {fmt_bytes(mine['peak_memory'])} per device at its peak against "
                f"{fmt_bytes(cap)} (the memory table of --plan says where it goes).")
        zero = next((i for i, r in enumerate(fits) if _layout_name(r["t"]) == _layout_name(mine["t"])[:3]
                     + (True,) + _layout_name(mine["t"])[4:]), None)
        if zero is not None:
            text += f" With --zero1 added it fits and ranks {zero + 1} of {len(fits)}."
    else:
        rank = next(i for i, r in enumerate(fits) if r is mine) + 1
        text = f"  it ranks {rank} of {len(fits)} layouts that fit."
    if best is not None and best is not mine:
        diff = {k: costs(e)[k] - costs(best["estimate"])[k] for k in parts}
        big = sorted(diff, key=lambda k: -abs(diff[k]))[:3]
        names = {"compute": "compute", "tp": "tp comm", "pp": "pp exchange", "dp": "dp comm", "bubble": "bubble"}
        text += (" Against #1 it spends " + ", ".join(f"{'+' if diff[k] >= 0 else '-'}{fmt_seconds(abs(diff[k]))} "
                 f"on {names[k]}" for k in big) + f" per step ({fmt_seconds(e['step'])} vs "
                 f"{fmt_seconds(best['estimate']['step'])}).")
    if e["step_overlapped"] < 0.99 * e["step"]:
        text += (f" Overlapping all the dp reduction with the backward, which nanohlat does not do "
                 f"{'on XLA' if e['device'].startswith('NeuronCore') else 'beyond the last micro-batch'}, "
                 f"would bring it to {fmt_seconds(e['step_overlapped'])}.")
    return text


COMM_LEGEND = ["  payload: what the collective delivers; wire: what a ring implementation sends from the rank",
               "  (all-reduce 2(n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x payload, exchange: the",
               "  real tensor); padding: the zeros an exchange sends for an idle direction (comm.py)"]
COMM_LEGEND_SHORT = ("  (bytes; wire: what a ring sends from this rank, 2(n-1)/n x payload for an all-reduce, "
                     "(n-1)/n for the rest)")


def comm_table(entries: dict, predicted: dict | None = None) -> list[str]:
    """Rows of calls, payload, wire and padding per collective, and their total.
    With `predicted` (the plan beside a measured ledger) a last column says
    whether all four agree, or gives the prediction."""
    keys = sorted(set(entries) | set(predicted or {}))
    zero = dict.fromkeys(comm.FIGURES, 0)
    rows = []
    for k in keys + ["total"]:
        e = entries.get(k, zero) if k != "total" else {f: sum(v[f] for v in entries.values()) for f in comm.FIGURES}
        row = [k, f"{e['calls']:,}" if k != "total" else "", f"{e['payload']:,}", f"{e['wire']:,}", f"{e['padding']:,}"]
        if predicted is not None and k != "total":
            p = predicted.get(k, zero)
            row.append("same" if p == e else "predicted: " + " ".join(f"{f} {p[f]:,}" for f in comm.FIGURES))
        elif predicted is not None:
            row.append("")
        rows.append(row)
    header = ["collective", "calls", "payload", "wire", "padding"] + (["plan.py"] if predicted is not None else [])
    return _table(header, rows)


def _comm_section(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    tp, pp = tcfg.tp, tcfg.pp
    L = ["", "communication per step, bytes on one rank"] + COMM_LEGEND
    by_stage = {s: comm_per_step(cfg, tcfg, Mesh(tp, pp, dp, rank_of(0, s, 0, tp, dp))) for s in range(pp)}
    if not by_stage[0]:
        return L + ["  none: one process"]
    for s in sorted({0, pp - 1}):
        L.append(f"  rank {rank_of(0, s, 0, tp, dp)} (stage {s}):")
        L += comm_table(by_stage[s])
    everyone = sum(e["wire"] + e["padding"] for c in by_stage.values() for e in c.values()) * tp * dp
    L.append(f"  all {tp * pp * dp} ranks together: {fmt_bytes(everyone)} on the wire per step (padding included)")
    if tcfg.activation_checkpointing == "full" and tp > 1:
        L.append("  full checkpointing replays 3 of a block's 4 forward tp collectives with torch's checkpoint, "
                 "all 4 with torch_xla's (--device xla)")
    return L


def kv_cache_bytes(cfg: ModelConfig, tokens: int, e: int, kv_heads: int | None = None) -> int:
    """Keys and values of `tokens` cached tokens over all layers: per token and
    layer 2 (k and v) x kv heads x head dim x e bytes (generate.py's cache)."""
    kv = cfg.n_kv_heads if kv_heads is None else kv_heads
    return tokens * cfg.n_layers * 2 * kv * cfg.head_dim * e


def _kv_cache_section(cfg: ModelConfig, tcfg: TrainConfig) -> list[str]:
    """Serving with this model (sample.py, generate.py): the KV cache for a
    context of --seq-len tokens, per sequence and per batch, whole and per tp rank."""
    tp, e, T = tcfg.tp, dtype_bytes(tcfg.precision), tcfg.seq_len
    kv_local = local_kv_heads(cfg, tp)
    per_layer = kv_cache_bytes(cfg, 1, e) // cfg.n_layers
    L = ["", f"KV cache when serving (generate.py), {e}-byte values: per token per layer 2 (k, v) x "
             f"{cfg.n_kv_heads} kv heads x {cfg.head_dim} head dim x {e} B = {fmt_bytes(per_layer)}; x {cfg.n_layers} "
             f"layers = {fmt_bytes(kv_cache_bytes(cfg, 1, e))} per token",
         f"  a tp rank caches its {kv_local} kv head(s)" + (" (replicas: tp > kv heads)" if tp > cfg.n_kv_heads else "")
         + f"; weights per tp rank {fmt_bytes(stage_param_counts(cfg, tp, 1, 0)['total'] * e)}"]
    rows = []
    for batch in (1, 8, 64):
        whole = kv_cache_bytes(cfg, batch * T, e)
        rows.append([batch, f"{batch * T:,}", fmt_bytes(whole), fmt_bytes(kv_cache_bytes(cfg, batch * T, e, kv_local))])
    L += _table(["batch", f"tokens at context {T}", "whole model", f"per tp rank (tp {tp})"], rows)
    if cfg.n_kv_heads < cfg.n_heads:
        L.append(f"  grouped-query attention: {cfg.n_kv_heads} kv heads for {cfg.n_heads} query heads; with one kv "
                 f"head per query head the cache would be {cfg.n_heads // cfg.n_kv_heads}x larger "
                 f"({fmt_bytes(kv_cache_bytes(cfg, T, e, cfg.n_heads))} per sequence)")
    return L
