"""Before a run: what each rank holds, computes and sends (`train.py --plan`).

Everything here is arithmetic on the config: no devices, no tensors, so it
answers for hlat-70b on 2048 ranks in a moment. The same formulas are checked
against what small real runs measure (tests/test_plan.py: the comm ledger,
the optimizer's bytes, the bytes autograd keeps after a forward), so the plan
is a prediction you can trust, not a guess.

Memory per rank, at its peak, the larger of the step's two phases:

    weights + gradients + optimizer state + fp32 gradient buffers
        + max(activations + loss backward,              forward/backward
              ZeRO-1 shards and gathers (+ temporaries)) optimizer step

    weights       parameters x 2 B (bf16) or 4 B (fp32)
    gradients     none kept: FlatAdamW's hooks add each parameter's gradient into
                  the fp32 buffer (below) as autograd makes it, and free it
    optimizer     Adam moments (2 x 4 B) + master weights, a separate copy in fp32
                  (4 B; fp32, bf16-mixed) or bf16 (2 B); 1/dp of all that with ZeRO-1
    activations   what autograd keeps per micro-batch (below) x micro-batches in flight
    loss backward the loss's backward briefly holds the logits' gradients, (4 + e) mb*T*V/tp
    fp32 grads    FlatAdamW accumulates the gradients in one flat fp32 buffer per group, kept between
                  steps (4 B/param), also the update's scratch space; ZeRO-1 adds the
                  reduce-scattered 1/dp shards and the all-gathered new weights
    temporaries   eager backends only (cpu, cuda): what the in-place AdamW update
                  still allocates (EAGER_STEP_COPIES); XLA fuses them away

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, section 4, redone for this model:
RMSNorm, SwiGLU, rotary, grouped-query attention, no dropout, no biases).
Per layer and micro-batch of mb sequences of T tokens, e bytes per activation
(the parameter dtype), with N = mb*T*C, n = N/tp with sequence parallel else N:

    each RMSNorm (x2)  fp32 copy of its input 4n, normalised input e*n, and its output
                       as the input of the next matmuls: e*n; with sequence parallel
                       the all-gathered full sequence instead, once per matmul
                       (SP_SAVED_GATHERS e*N, shared by the matmuls). Megatron keeps N/tp, gathers again.
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
at once under 1F1B, all M under AFAB (pipeline.stage_order).
"""

from __future__ import annotations

import dataclasses
import functools

from .config import ModelConfig, TrainConfig
from .mesh import Mesh, coords, layout_table, rank_of, validate_layout
from .metrics import flops_per_token, peak_flops
from .pipeline import stage_layers, stage_order, timetable
from .zero1 import padded_size

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
    return 4 if precision == "fp32" else 2


def local_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """kv heads on one tp rank. With more tp ranks than kv heads (HLAT-70B: 8 kv
    heads, tp 32) each rank must hold a replica of one kv head."""
    return max(cfg.n_kv_heads // tp, 1)


def stage_param_counts(cfg: ModelConfig, tp: int, pp: int, stage: int) -> dict:
    """Parameters of one (stage, tp rank): tp-sharded matrices and tp-replicated norms."""
    d, kv = cfg.d_model, local_kv_heads(cfg, tp) * cfg.head_dim
    per_layer = (d * d * 2 + 3 * d * cfg.ffn_dim) // tp + d * kv * 2
    layers = cfg.n_layers // pp
    sharded = layers * per_layer
    norms = layers * 2 * d
    if stage == 0:
        sharded += cfg.padded_vocab * d // tp
    if stage == pp - 1:
        sharded += cfg.padded_vocab * d // tp
        norms += d
    return {"sharded": sharded, "replicated": norms, "total": sharded + norms}


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

def micro_batch_size(t: TrainConfig, dp: int) -> int:
    return t.batch_size // (dp * t.microbatches)


# With sequence parallel, comm.all_gather returns the gathered (mb, T, C)
# sequence as one contiguous tensor that the matmuls after each norm (wq, wk,
# wv; gate, up) all save for backward: 2 full-sequence tensors per layer.
# Megatron-LM keeps only the 1/tp shard and gathers again in backward.
SP_SAVED_GATHERS = 2


def layer_activation_bytes(cfg: ModelConfig, mb: int, T: int, tp: int, e: int, mode: str, sp: bool,
                           fused: bool) -> int:
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
    # output (one tensor for wq, wk, wv, another for gate, up), or the gathered sequence
    inputs = SP_SAVED_GATHERS * e * N if sp else 2 * e * n
    if mode == "selective":
        core = e * (q + 2 * kv) + e * q
    elif fused:
        core = 4 * e * q + 4 * mb * heads * T
    else:
        core = 4 * e * q + e * mb * heads * T * T
    mlp = 4 * e * mb * T * cfg.ffn_dim // tp
    return norms + inputs + core + mlp


def activation_bytes(cfg: ModelConfig, t: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                     mode: str | None = None, sp: bool | None = None, fused: bool = True) -> int:
    """Bytes autograd (and the pipeline runner) keep for ONE micro-batch on a rank
    of `stage`, at the end of its forward. mode/sp default to the config's."""
    mode = t.activation_checkpointing if mode is None else mode
    sp = (t.sequence_parallel if sp is None else sp) and tp > 1
    e, mb, T, C = dtype_bytes(t.precision), micro_batch_size(t, dp), t.seq_len, cfg.d_model
    n = mb * (T // tp if sp else T) * C
    total = cfg.n_layers // pp * layer_activation_bytes(cfg, mb, T, tp, e, mode, sp, fused)
    first, last = stage == 0, stage == pp - 1
    if first:       # token ids (int64) and the "my vocabulary shard" mask of the embedding
        total += 8 * mb * T + e * mb * T
    elif mode != "full" and e != 4:
        total += e * n  # the received input, kept for its gradient (fp32: it is the norm's input)
    if not last:
        total += e * n  # the stage's output, kept by the runner until its backward
    else:           # final norm, then the loss: masked fp32 logits and their exp, and per-token scalars
        V = cfg.padded_vocab // tp
        total += 4 * n + e * n + (e * mb * T * C if sp else e * n) + 4 * (n // C)
        total += 8 * mb * T * V + V + 13 * mb * T
    return total


def microbatches_in_flight(schedule: str, pp: int, m: int, stage: int) -> int:
    """Most micro-batches whose activations a stage holds at once (1F1B: min(pp - stage, m))."""
    held = peak = 0
    for kind, _ in stage_order(schedule, pp, m, stage):
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def optimizer_bytes(cfg: ModelConfig, t: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0,
                    dp_rank: int = 0) -> int:
    """Adam moments (fp32) + master weights, on one rank (1/dp of them with ZeRO-1)."""
    counts = stage_param_counts(cfg, tp, pp, stage)
    master = 4 if t.precision in ("fp32", "bf16-mixed") else 2
    shards = dp if t.zero1 else 1
    return sum(padded_size(n, shards) // shards * (8 + master) for n in (counts["sharded"], counts["replicated"]))


# Eager backends (cpu, cuda) run FlatAdamW.step's AdamW one op at a time. The
# update works in place in the flat gradient buffer, so fp32 and bf16-mixed
# allocate almost nothing more (bf16-mixed: the bf16 copy of the new weights,
# half an fp32 copy); pure bf16 works on an fp32 copy of its bf16 master (1.5
# copies with the rounding); software stochastic rounding adds its int32 noise
# and bit buffers (4.5 copies). Counted in fp32-sized copies of the largest
# group's shard. XLA fuses the update into one kernel and needs none of them.
EAGER_STEP_COPIES = {"fp32": 0.0, "bf16-mixed": 0.5, "bf16": 1.5, "bf16-sr": 4.5}


def optimizer_step_bytes(cfg: ModelConfig, t: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                         eager: bool) -> tuple[int, int]:
    """(flat fp32 gradient buffers kept between steps, extra bytes during FlatAdamW.step).

    One buffer per group (tp-sharded matrices, replicated norms), padded to a
    multiple of dp under ZeRO-1. During the step ZeRO-1 also holds the
    reduce-scattered 1/dp gradient shards and, one group at a time, the
    all-gathered new weights in the parameter dtype."""
    counts = stage_param_counts(cfg, tp, pp, stage)
    groups = [counts["sharded"], counts["replicated"]]
    shards = dp if t.zero1 else 1
    buffers = 4 * sum(padded_size(n, shards) for n in groups)
    largest_shard = max(padded_size(n, shards) // shards for n in groups)
    during = 0
    if shards > 1:
        during += 4 * sum(padded_size(n, shards) // shards for n in groups)
        during += dtype_bytes(t.precision) * max(padded_size(n, shards) for n in groups)
    if eager:
        during += int(4 * EAGER_STEP_COPIES[t.precision] * largest_shard)
    return buffers, during


def memory_per_rank(cfg: ModelConfig, t: TrainConfig, tp: int, pp: int, dp: int, stage: int,
                    fused: bool = True, eager: bool = False) -> dict:
    """The per-rank breakdown of one stage, in bytes (module docstring). `fused`:
    the attention kernel keeps no T*T scores; `eager`: cpu/cuda, not xla."""
    params = stage_param_counts(cfg, tp, pp, stage)["total"]
    s = dtype_bytes(t.precision)
    flight = microbatches_in_flight(t.schedule, pp, t.microbatches, stage)
    flat, temporaries = optimizer_step_bytes(cfg, t, tp, pp, dp, stage, eager)
    out = {"params": params, "weights": s * params, "grads": 0,   # accumulated in the fp32 buffers
           "optimizer": optimizer_bytes(cfg, t, tp, pp, dp, stage),
           "optimizer_zero1": optimizer_bytes(cfg, dataclasses.replace(t, zero1=True), tp, pp, dp, stage),
           "optimizer_replicated": optimizer_bytes(cfg, dataclasses.replace(t, zero1=False), tp, pp, dp, stage),
           "in_flight": flight,
           "activations": flight * activation_bytes(cfg, t, tp, pp, dp, stage, fused=fused),
           # the loss's backward briefly holds two more (mb, T, V/tp) tensors, the
           # gradient of the fp32 logits and of the head's output (parameter
           # dtype), while most activations are still alive (measured on CUDA)
           "loss_backward": (4 + s) * micro_batch_size(t, dp) * t.seq_len * cfg.padded_vocab // tp
                            if stage == pp - 1 else 0,
           "flat_grads": flat, "step_temporaries": temporaries}
    out["forward_backward"] = out["activations"] + out["loss_backward"]
    out["optimizer_step"] = temporaries
    out["peak"] = (out["weights"] + out["grads"] + out["optimizer"] + flat
                   + max(out["forward_backward"], out["optimizer_step"]))
    return out


# ---------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------

def _add(out: dict, key: str, nbytes: int) -> None:
    if nbytes:
        out[key] = out.get(key, 0) + nbytes


@functools.lru_cache(maxsize=16)
def exchanges_per_boundary(schedule: str, pp: int, m: int) -> tuple[int, ...]:
    """Ticks in which something crosses boundary b|b+1: b runs a forward or b+1 a backward."""
    ticks = timetable(schedule, pp, m)
    return tuple(sum(1 for row in ticks if (row[b] and row[b][0] == "F") or (row[b + 1] and row[b + 1][0] == "B"))
                 for b in range(pp - 1))


def comm_bytes_per_step(cfg: ModelConfig, t: TrainConfig, mesh, whole_block_replay: bool | None = None) -> dict:
    """Bytes per optimizer step on `mesh.rank`, keyed like the CommLedger
    ('tp.all_reduce', 'pp.exchange', ...). See comm.py for how bytes count.

    whole_block_replay: whether full activation checkpointing replays a whole
    block's forward in backward (torch_xla's reentrant checkpoint; default: on
    --device xla) or stops early (torch's non-reentrant one, cpu and cuda)."""
    if whole_block_replay is None:
        whole_block_replay = t.device == "xla"
    tp, pp, dp = mesh.tp, mesh.pp, mesh.dp
    dp_rank, stage, _ = coords(mesh.rank, tp, pp, dp)
    s = dtype_bytes(t.precision)
    m = t.microbatches
    mb = t.batch_size // (dp * m)
    T, C = t.seq_len, cfg.d_model
    sp = t.sequence_parallel and tp > 1
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
        full = t.activation_checkpointing == "full"
        enters_fwd = 2 * (1 + full)
        leaves_fwd = 2 + full + (full and whole_block_replay)
        per_mb = m * layers * act
        if sp:
            _add(out, "tp.all_gather", per_mb * (enters_fwd + 2))        # + the leaves' backward
            _add(out, "tp.reduce_scatter", per_mb * (leaves_fwd + 2))    # + the enters' backward
        else:
            _add(out, "tp.all_reduce", per_mb * (leaves_fwd + 2))
        if stage == 0:   # embedding leaves the tp region: fwd reduce, (sp: bwd all-gather)
            _add(out, "tp.reduce_scatter" if sp else "tp.all_reduce", m * act)
            _add(out, "tp.all_gather", m * act if sp else 0)
        if stage == pp - 1:
            # final norm -> head enters the region; the loss moves three (mb, T) fp32 tensors
            if sp:
                _add(out, "tp.all_gather", m * act)
                _add(out, "tp.reduce_scatter", m * act)
            else:
                _add(out, "tp.all_reduce", m * act)
            _add(out, "tp.all_gather", m * tp * mb * T * 4)      # local maxima
            _add(out, "tp.all_reduce", m * 2 * mb * T * 4)       # sum of exps, target logit
    if pp > 1:
        # an exchange moves 2 tensors of the residual stream per tick with traffic
        t_local = T // tp if sp else T
        ex = 2 * mb * t_local * C * s
        for b in (stage - 1, stage):
            if 0 <= b < pp - 1:
                _add(out, "pp.exchange", exchanges_per_boundary(t.schedule, pp, m)[b] * ex)
        _add(out, "pp.all_reduce", 4 * 2)                         # loss sum, grad-norm square
    counts = stage_param_counts(cfg, tp, pp, stage)
    groups = [counts["sharded"], counts["replicated"]]
    shards = dp if t.zero1 else 1
    if sp:
        _add(out, "tp.all_reduce", padded_size(counts["replicated"], shards) * 4)   # norm grads
    if tp > 1:
        _add(out, "tp.all_reduce", 4)                             # grad-norm square
    if dp > 1:
        _add(out, "dp.all_reduce", 4)                             # loss
        for n in groups:
            if t.zero1:
                _add(out, "dp.reduce_scatter", padded_size(n, dp) * 4)
                _add(out, "dp.all_gather", padded_size(n, dp) * s)
            else:
                _add(out, "dp.all_reduce", n * 4)
        if t.zero1:
            _add(out, "dp.all_reduce", 4)                         # grad-norm square
    return out


# ---------------------------------------------------------------------------
# The printed plan
# ---------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
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


def validate_plan_layout(cfg: ModelConfig, t: TrainConfig, world: int) -> tuple[int, list[str]]:
    """mesh.validate_layout, except that tp may be a multiple of n_kv_heads larger
    than it (HLAT-70B's tp 32 with 8 kv heads). Returns dp and notes to print."""
    if t.tp <= cfg.n_kv_heads or t.tp % cfg.n_kv_heads:
        return validate_layout(cfg, t, world), []
    dp = validate_layout(dataclasses.replace(cfg, n_kv_heads=t.tp), t, world)
    return dp, [f"note: tp {t.tp} > {cfg.n_kv_heads} kv heads, so each tp rank must hold a replica of one kv "
                f"head (shared by {t.tp // cfg.n_kv_heads} ranks; HLAT-70B ran so). model.py does not replicate "
                f"kv heads yet and train.py refuses this layout; the plan counts the replicas' weights and "
                f"activations, not the all-reduce their gradients would need."]


def report(cfg: ModelConfig, t: TrainConfig, world: int) -> str:
    """Everything above as text: the answer to `train.py --plan`."""
    dp, notes = validate_plan_layout(cfg, t, world)
    tp, pp, m = t.tp, t.pp, t.microbatches
    sp = t.sequence_parallel and tp > 1
    tokens = t.batch_size * t.seq_len
    L = [f"plan for preset {t.preset}: {cfg.num_params() / 1e9:.3f}B parameters "
         f"(vocabulary {cfg.vocab_size}, padded {cfg.padded_vocab}), {world} ranks",
         f"  layout: dp {dp} x pp {pp} x tp {tp}; sequence parallel {'on' if sp else 'off'}; "
         f"activation checkpointing {t.activation_checkpointing}; "
         f"{'ZeRO-1' if t.zero1 else 'replicated optimizer'}; precision {t.precision}; schedule {t.schedule}",
         f"  batch: {t.batch_size} sequences x {t.seq_len} tokens = {tokens:,} tokens per step; per dp rank "
         f"{t.batch_size // dp} = {m} micro-batch(es) of {micro_batch_size(t, dp)}"]
    L += ["  " + n for n in notes]
    L += ["", "mesh (rank -> coordinates, and the layers each stage holds)",
          layout_table(tp, pp, dp, cfg.n_layers, max_rows=16)]
    L += _memory_section(cfg, t, dp)
    L += _compute_section(cfg, t, world)
    L += _comm_section(cfg, t, dp)
    return "\n".join(L)


def _memory_section(cfg: ModelConfig, t: TrainConfig, dp: int) -> list[str]:
    tp, pp, m = t.tp, t.pp, t.microbatches
    eager = t.device in ("cpu", "cuda")    # else plan for xla (trn1), also for --device auto
    mems = {s: memory_per_rank(cfg, t, tp, pp, dp, s, fused=eager, eager=eager) for s in range(pp)}
    largest = max(range(pp), key=lambda s: mems[s]["peak"])
    L = ["", "parameters and memory per rank (every rank of a stage holds the same), assuming "
             + ("an eager backend (cpu/cuda): fused attention kernel, unfused AdamW" if eager else
                "xla (trn1): T*T attention scores kept, AdamW fused into one kernel; "
                "--device cpu or cuda for eager")]
    rows = []
    for s in shown_stages(pp):
        r = mems[s]
        lay = stage_layers(cfg.n_layers, pp, s)
        step = fmt_bytes(r["step_temporaries"])
        rows.append([s, f"{lay.start}-{lay.stop - 1}", fmt_count(r["params"]), fmt_bytes(r["weights"]),
                     fmt_bytes(r["grads"]), fmt_bytes(r["optimizer_replicated"]), fmt_bytes(r["optimizer_zero1"]),
                     f"{r['in_flight']} x " + fmt_bytes(r["activations"] / r["in_flight"]),
                     fmt_bytes(r["flat_grads"]), fmt_bytes(r["loss_backward"]), step, fmt_bytes(r["peak"])])
    L += _table(["stage", "layers", "params", "weights", "grads", "Adam", "Adam ZeRO-1", "activations",
                 "fp32 grads", "loss bwd", "optimizer step", "peak"], rows)
    L.append(f"  peak = weights + grads + Adam ({'ZeRO-1' if t.zero1 else 'no ZeRO'}, as configured) + fp32 gradient "
             f"buffers + the larger of (activations in flight + loss backward) and (optimizer step: "
             + ("ZeRO-1 shards and gathers" if t.zero1 else "") + (" + " if t.zero1 and eager else "")
             + ("in-place AdamW temporaries" if eager else "") + ("nothing more" if not (t.zero1 or eager) else "")
             + ")")
    biggest = mems[largest]["peak"]
    for dev in PLAN_DEVICES[t.device]:
        if dev in DEVICE_MEMORY:
            cap = DEVICE_MEMORY[dev]
            L.append(f"  largest stage {largest}: {fmt_bytes(biggest)} of {fmt_bytes(cap)} on one {dev}: "
                     + ("fits" if biggest <= cap else f"does NOT fit ({biggest / cap:.1f}x)"))

    flight = mems[largest]["in_flight"]
    L += ["", f"activations per rank of stage {largest}, by checkpointing mode ({flight} of {m} micro-batch(es) "
              f"of {micro_batch_size(t, dp)} x {t.seq_len} tokens in flight):"]
    rows = []
    for mode in ("none", "selective", "full"):
        for sp in ((False, True) if tp > 1 else (False,)):
            kept = activation_bytes(cfg, t, tp, pp, dp, largest, mode, sp, fused=False)
            fused = activation_bytes(cfg, t, tp, pp, dp, largest, mode, sp, fused=True)
            this = (mode, sp) == (t.activation_checkpointing, t.sequence_parallel and tp > 1)
            rows.append([mode, "on" if sp else "off", fmt_bytes(kept), fmt_bytes(flight * kept),
                         fmt_bytes(fused), fmt_bytes(flight * fused), "<- this run" if this else ""])
    L += _table(["checkpointing", "seq-parallel", "T*T kept: 1 mb", "in flight",
                 "fused attn: 1 mb", "in flight", ""], rows)
    L.append("  'T*T kept': softmax probabilities stored (Korthikanti et al.; torch_xla's matmul+softmax); "
             "'fused': a flash/efficient SDPA kernel (cpu, cuda)")
    return L


def _compute_section(cfg: ModelConfig, t: TrainConfig, world: int) -> list[str]:
    tokens = t.batch_size * t.seq_len
    f_tok = flops_per_token(cfg, t.seq_len)
    f_step = f_tok * tokens
    L = ["", f"compute: {fmt_flop(f_tok)} per token (6 x matmul params + 12 x layers x d_model x seq_len, "
             f"metrics.flops_per_token) x {tokens:,} tokens = {fmt_flop(f_step)} per step, {fmt_flop(f_step / world)} "
             f"per rank; time at {DEFAULT_MFU:.0%} MFU:"]
    rows = []
    for dev in PLAN_DEVICES[t.device]:
        threads = max(1, t.threads) if dev == "cpu" else None
        peak = peak_flops(dev, t.precision, threads)
        step_s = f_step / (world * peak * DEFAULT_MFU)
        rows.append([dev, fmt_flop(peak, "FLOP/s") + (f" ({threads} core)" if dev == "cpu" else ""),
                     fmt_seconds(step_s), f"{tokens / step_s:,.0f}", fmt_seconds(step_s * t.steps)])
    return L + _table(["device", "peak per rank", f"step at {DEFAULT_MFU:.0%} MFU", "tokens/s",
                       f"{t.steps:,} steps"], rows)


def _comm_section(cfg: ModelConfig, t: TrainConfig, dp: int) -> list[str]:
    tp, pp = t.tp, t.pp
    L = ["", "communication per step (bytes in each collective's full buffer on one rank, as the comm ledger counts)"]
    by_stage = {s: comm_bytes_per_step(cfg, t, Mesh(tp, pp, dp, rank_of(0, s, 0, tp, dp))) for s in range(pp)}
    shown = sorted({0, pp - 1})
    keys = sorted(set().union(*(by_stage[s] for s in shown)))
    if not keys:
        return L + ["  none: one process"]
    rows = [[k] + [f"{by_stage[s].get(k, 0):,}" for s in shown] for k in keys]
    rows.append(["total"] + [f"{sum(by_stage[s].values()):,} ({fmt_bytes(sum(by_stage[s].values()))})"
                             for s in shown])
    L += _table(["collective"] + [f"rank {rank_of(0, s, 0, tp, dp)} (stage {s})" for s in shown], rows)
    everyone = sum(sum(c.values()) for c in by_stage.values()) * tp * dp
    L.append(f"  all {tp * pp * dp} ranks together: {fmt_bytes(everyone)} per step")
    if t.activation_checkpointing == "full" and tp > 1:
        L.append("  full checkpointing replays 3 of a block's 4 forward tp collectives with torch's checkpoint, "
                 "all 4 with torch_xla's (--device xla)")
    return L
