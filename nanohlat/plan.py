"""Before a run: what each rank holds, computes and sends (`train.py --plan`).

Everything here is arithmetic on the config: no devices, no tensors, so it
answers for hlat-70b on 2048 ranks in a moment. The same formulas are checked
against what small real runs measure (the comm ledger, the optimizer's bytes),
so the plan is a prediction you can trust, not a guess.
"""

from __future__ import annotations

from .config import ModelConfig, TrainConfig
from .mesh import coords, layout_table, validate_layout
from .pipeline import timetable
from .zero1 import padded_size


def dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def stage_param_counts(cfg: ModelConfig, tp: int, pp: int, stage: int) -> dict:
    """Parameters of one (stage, tp rank): tp-sharded matrices and tp-replicated norms."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = (d * d * 2 + d * kv * 2 + 3 * d * cfg.ffn_dim) // tp
    layers = cfg.n_layers // pp
    sharded = layers * per_layer
    norms = layers * 2 * d
    if stage == 0:
        sharded += cfg.padded_vocab * d // tp
    if stage == pp - 1:
        sharded += cfg.padded_vocab * d // tp
        norms += d
    return {"sharded": sharded, "replicated": norms, "total": sharded + norms}


def _add(out: dict, key: str, nbytes: int) -> None:
    if nbytes:
        out[key] = out.get(key, 0) + nbytes


def comm_bytes_per_step(cfg: ModelConfig, t: TrainConfig, mesh) -> dict:
    """Bytes per optimizer step on `mesh.rank`, keyed like the CommLedger
    ('tp.all_reduce', 'pp.exchange', ...). See comm.py for how bytes count."""
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
        # per block: attention and MLP each enter (bwd) and leave (fwd) the tp region;
        # full activation checkpointing replays the forward ones during backward
        fwd_replay = 2 if t.activation_checkpointing == "full" else 1
        if sp:
            _add(out, "tp.all_gather", m * layers * 2 * act * (fwd_replay + 1))      # enter fwd (+replay), leave bwd
            _add(out, "tp.reduce_scatter", m * layers * 2 * act * (fwd_replay + 1))  # leave fwd (+replay), enter bwd
        else:
            _add(out, "tp.all_reduce", m * layers * 2 * act * (fwd_replay + 1))
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
        ticks = timetable(t.schedule, pp, m)
        t_local = T // tp if sp else T
        ex = 2 * mb * t_local * C * s
        for b in (stage - 1, stage):
            if 0 <= b < pp - 1:
                n = sum(1 for row in ticks if (row[b] and row[b][0] == "F") or (row[b + 1] and row[b + 1][0] == "B"))
                _add(out, "pp.exchange", n * ex)
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


def optimizer_bytes(cfg: ModelConfig, t: TrainConfig, tp: int, pp: int, dp: int, stage: int = 0,
                    dp_rank: int = 0) -> int:
    """Adam moments (fp32) + master weights, on one rank (1/dp of them with ZeRO-1)."""
    counts = stage_param_counts(cfg, tp, pp, stage)
    master = 4 if t.precision in ("fp32", "bf16-mixed") else 2
    shards = dp if t.zero1 else 1
    return sum(padded_size(n, shards) // shards * (8 + master) for n in (counts["sharded"], counts["replicated"]))


def report(cfg: ModelConfig, t: TrainConfig, world: int) -> str:
    dp = validate_layout(cfg, t, world)
    lines = [f"plan for preset {t.preset}: {cfg.num_params() / 1e9:.3f}B parameters",
             layout_table(t.tp, t.pp, dp, cfg.n_layers, max_rows=16)]
    counts = stage_param_counts(cfg, t.tp, t.pp, 0)
    lines.append(f"parameters on rank 0: {counts['total'] / 1e6:.1f}M; optimizer state: "
                 f"{optimizer_bytes(cfg, t, t.tp, t.pp, dp) / 2**30:.2f} GiB")
    return "\n".join(lines)
