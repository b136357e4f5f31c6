"""What one rank sends per optimizer step, collective by collective, keyed
and counted like comm.py's CommLedger (payload, wire, padding, calls), from
the model's shape and the layout alone."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from nanohlat import comm
from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.mesh import kv_replicas
from nanohlat.pipeline import PipelineRunner
from nanohlat.plan.context import attention_collectives, local_tokens
from nanohlat.plan.params import dtype_bytes, group_kinds, mesh_at, stage_sparse_layers
from nanohlat.tools.orders import timetable
from nanohlat.zero1 import padded_size


def _add(out: dict, key: str, payload: int, calls: int, n: int) -> None:
    """`calls` collectives of `payload` bytes each over a group of n ranks."""
    if calls and payload:
        entry = out.setdefault(key, dict.fromkeys(comm.FIGURES, 0))
        entry["payload"] += payload * calls
        entry["wire"] += comm.wire_bytes(key.split(".")[1], n, payload) * calls
        entry["calls"] += calls


def _add_buckets(out: dict, key: str, elems: int, bucket: int, rows: int, size: int, n: int) -> None:
    """data_parallel's bucketed collectives: `elems` columns cut into buckets of
    at most `bucket` columns, each call moving rows x columns x size bytes."""
    bucket = max(1, bucket)
    full, rest = divmod(elems, bucket)
    _add(out, key, rows * bucket * size, full, n)
    _add(out, key, rows * rest * size, 1 if rest else 0, n)


@functools.lru_cache(maxsize=1024)
def exchanges_per_boundary(schedule: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Ticks in which something crosses boundary b|b+1, by the pipeline runner's
    own rule (PipelineRunner._exchange_plan: b ran a forward or b+1 a backward);
    interleaved (v > 1) adds the wrap boundary, last | first stage, last in the
    tuple (schedules.InterleavedRunner._wrap_plan: the last stage ran a forward of a chunk
    c < v-1, or the first a backward of a chunk c > 0)."""
    # the two rules read only the runner's timetable and v: a stand-in holding those is enough
    runner = SimpleNamespace(ticks=timetable(schedule, pp, m, v), v=v)
    ticks = range(len(runner.ticks))
    moves = lambda pair: pair != (None, None)      # (activation, gradient) micro-batches, None where nothing moves
    out = [sum(moves(PipelineRunner._exchange_plan(runner, t, b)) for t in ticks) for b in range(pp - 1)]
    if v > 1:
        from nanohlat.beyond.schedules import InterleavedRunner   # (interleaved only)
        out.append(sum(moves(InterleavedRunner._wrap_plan(runner, t)) for t in ticks))
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
    tp, pp, dp, cp = mesh.tp, mesh.pp, mesh.dp, tcfg.cp
    stage = mesh_at(tp, pp, dp, mesh.rank, cp).pp_rank
    itemsize = dtype_bytes(tcfg.precision)
    m = tcfg.microbatches
    mb = tcfg.batch_size // (dp * m)
    T, C = local_tokens(tcfg), cfg.d_model     # (--cp: the T/cp tokens of each sequence on this rank)
    sp = tcfg.sequence_parallel and tp > 1
    act = mb * T * C * itemsize                # one full-sequence residual-stream tensor
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
        # a mixture's sparse layer (moe.py, replicated over tp) has no MLP to enter or leave: one enter
        # (its replay under full checkpointing, its regather) and one leave (its whole-block replay) less
        sparse = m * stage_sparse_layers(cfg, pp, stage, tcfg.virtual_stages)
        mlp_enter, mlp_leave = 1 + full + (regathers > 0), 1 + (full and whole_block_replay)
        if sp:
            _add(out, "tp.all_gather", act, per_layer * (enters_fwd + 2 + regathers) - sparse * (mlp_enter + 1), tp)
            _add(out, "tp.reduce_scatter", act, per_layer * (leaves_fwd + 2) - sparse * (mlp_leave + 1), tp)
            # and its router's per-sequence sums f_e, P_e (mb x E each) and z (mb), fp32, add up over the
            # tp ranks' T/tp tokens (moe.route's seq_group: all-reduced in the forward and its replay)
            for n in (mb * cfg.moe_experts, mb * cfg.moe_experts, mb):
                _add(out, "tp.all_reduce", 4 * n, sparse * (1 + full), tp)
        else:
            _add(out, "tp.all_reduce", act, per_layer * (leaves_fwd + 2) - sparse * (mlp_leave + 1), tp)
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
        x = mb * (T // tp if sp else T) * C * itemsize
        v = tcfg.virtual_stages
        ticks = exchanges_per_boundary(tcfg.schedule, pp, m, v)
        crossing = [(b, v * m) for b in (stage - 1, stage) if 0 <= b < pp - 1]
        if v > 1 and stage in (0, pp - 1):
            crossing.append((pp - 1, (v - 1) * m))                 # ticks[pp - 1]: the wrap boundary
        for b, n in crossing:
            entry = out.setdefault("pp.exchange", dict.fromkeys(comm.FIGURES, 0))
            entry["payload"] += 2 * n * x
            entry["wire"] += n * x
            entry["padding"] += (ticks[b] - n) * x
            entry["calls"] += ticks[b]
        _add(out, "pp.all_reduce", 4, 2, pp)                      # loss sum, grad-norm square
    if cp > 1:   # each layer's attention over the cp ranks (context.py: its collectives per layer and micro-batch)
        for _, op, payload, calls in attention_collectives(cfg, mb, T, tp, cp, itemsize, tcfg.cp_attention,
                                                           tcfg.activation_checkpointing):
            _add(out, f"cp.{op}", payload, calls * m * layers, cp)
        # a mixture's router sums its per-sequence f_e, P_e (mb x E each) and z (mb), fp32, over the cp
        # ranks' T/cp tokens too (moe.route's seq_group: in the forward and its replay under full checkpointing)
        sparse = m * stage_sparse_layers(cfg, pp, stage, tcfg.virtual_stages)
        for n in (mb * cfg.moe_experts, mb * cfg.moe_experts, mb):
            _add(out, "cp.all_reduce", 4 * n, sparse * (1 + (tcfg.activation_checkpointing == "full")), cp)
    ep = tcfg.ep
    if ep > 1:
        _add_expert_parallel(out, cfg, tcfg, mb, ep, itemsize, stage_sparse_layers(cfg, pp, stage, tcfg.virtual_stages))
    groups = group_kinds(cfg, tp, pp, stage, tcfg.zero, ep, tcfg.virtual_stages)
    # the gradients (and ZeRO's shards, the loss) go over the ranks holding the same weights:
    # dp, with --cp dp x cp (mesh.grad_group, the ledger's 'dp_cp')
    g, dp = ("dp_cp", dp * cp) if cp > 1 else ("dp", dp)
    shards = dp if tcfg.zero else 1
    kept = shards if tcfg.zero >= 2 else 1     # ZeRO-2, 3 sum over tp on their shard (optim.py)
    for kind, n in groups:
        if sp and kind in ("replicated", "moe", "experts"):   # norm (and a mixture's) grads (ZeRO-3: per unit)
            s = shards // ep if kind == "experts" and shards > 1 else shards   # (--ep's over dp/ep: zero_groups)
            _add(out, "tp.all_reduce", padded_size(n, s) // (s if tcfg.zero >= 2 else 1) * 4, 1, tp)
        if kind == "kv":   # kv heads held by tp/n_kv ranks: their fp32 flat buffer of wk, wv grads summed
            _add(out, "kv.all_reduce", padded_size(n, shards) // kept * 4, 1, kv_replicas(cfg, tp))
    if tp > 1:
        _add(out, "tp.all_reduce", 4, 1, tp)                      # grad-norm square
    if dp > 1:
        _add(out, f"{g}.all_reduce", 4, 1, dp)                      # loss
        bucket = int(tcfg.bucket_mb * 2**20 / 4)                     # fp32 elements per bucket
        for kind, n in groups:   # one flat buffer after the other (optim.FlatGroup)
            if kind == "experts":   # --ep: summed over the dp/ep ranks holding the same experts (moe.add_groups' ep_dp)
                e = dp // ep        # (ZeRO-1: reduce-scattered over them, the new weights all-gathered)
                if e > 1 and tcfg.zero:   # (ZeRO-2, 3: every micro-batch; ZeRO-3 gathers in forward and backward)
                    cols = padded_size(n, e) // e
                    for _ in range(m if tcfg.zero >= 2 else 1):
                        _add_buckets(out, "ep_dp.reduce_scatter", cols, bucket // e, e, 4, e)
                    for _ in range(2 * m if tcfg.zero == 3 else 1):
                        _add_buckets(out, "ep_dp.all_gather", cols, bucket // e, e, itemsize, e)
                elif e > 1:
                    _add_buckets(out, "ep_dp.all_reduce", n, bucket, 1, 4, dp // ep)
            elif tcfg.zero:   # buckets cut the (dp, shard) view by columns; ZeRO-2, 3: every micro-batch
                cols = padded_size(n, dp) // dp
                for _ in range(m if tcfg.zero >= 2 else 1):
                    _add_buckets(out, f"{g}.reduce_scatter", cols, bucket // dp, dp, 4, dp)
                # the new weights after the step; ZeRO-3: each micro-batch's forward and backward instead
                for _ in range(2 * m if tcfg.zero == 3 else 1):
                    _add_buckets(out, f"{g}.all_gather", cols, bucket // dp, dp, itemsize, dp)
            else:
                _add_buckets(out, f"{g}.all_reduce", n, bucket, 1, 4, dp)
        if tcfg.zero:
            _add(out, f"{g}.all_reduce", 4, 1, dp)                  # grad-norm square
    if tcfg.fp8 != "none":   # --fp8: the amax tables of cut tensors, delayed scaling's history (plan/fp8_costs.py)
        from nanohlat.plan import fp8_costs as fp8_plan
        fp8_plan.add_collectives(out, _add, cfg, tcfg, mesh, stage)
    return dict(sorted(out.items()))


def _add_expert_parallel(out: dict, cfg: ModelConfig, tcfg: TrainConfig, mb: int, ep: int, itemsize: int,
                         sparse: int) -> None:
    """--ep N (moe.dispatch_expert_parallel): per sparse layer of the stage (`sparse` of them) and
    micro-batch, over the ep group,
    5 all-to-alls: the counts (E/N int64 to each rank), the dispatch (this rank's N*k rows of
    d_model, N = mb x seq_len tokens, with sequence parallelism the tp rank's 1/tp of them), the
    return trip (the rows this rank RECEIVED), and in backward the return trip's gradient (N*k rows
    again) and the dispatch's (the rows received).
    What a rank receives depends on the routing: the plan predicts it for balanced routing, N*k
    rows, N*k/N of them from each rank (its own included); summed over the ep group it is exact
    whatever the routing. Capacity mode (moe.capacity_expert_parallel) sends no counts, and its
    four carry E x C rows each, C = moe.capacity(N, k, E, factor), exact whatever the routing.
    Full checkpointing replays the forward ones. Then, once per step
    without ZeRO, the experts' share of the grad norm's square (4 bytes over the ep group; ZeRO-1's
    sum over dp adds every expert's shard once)."""
    calls = sparse * tcfg.microbatches
    replays = 1 + (tcfg.activation_checkpointing == "full")
    sp = tcfg.sequence_parallel and tcfg.tp > 1   # (each tp rank routes its T/tp tokens)
    N, E, k = mb * local_tokens(tcfg) // (tcfg.tp if sp else 1), cfg.moe_experts, cfg.moe_top_k
    if cfg.moe_capacity_factor:   # static queues: E x C rows to and fro
        from nanohlat.beyond import moe
        rows = E * moe.capacity(N, k, E, cfg.moe_capacity_factor)
    else:
        rows = N * k
        _add(out, "ep.all_to_all", 8 * E, calls * replays, ep)                              # counts
    _add(out, "ep.all_to_all", rows * cfg.d_model * itemsize, calls * (2 * replays + 2), ep)  # the rows, both ways
    _add(out, "ep.all_reduce", 4, 0 if tcfg.zero else 1, ep)


def comm_bytes_per_step(cfg: ModelConfig, tcfg: TrainConfig, mesh, whole_block_replay: bool | None = None) -> dict:
    """Payload bytes per collective (comm_per_step's 'payload' figure)."""
    return {k: v["payload"] for k, v in comm_per_step(cfg, tcfg, mesh, whole_block_replay).items()}
