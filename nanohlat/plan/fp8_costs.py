"""--fp8 in the plan: what FP8 sends, keeps and buys.

Sends (`add_collectives`, into comm_per_step, counted like the comm ledger): the amax tables of the
casts whose blocks straddle a cut (beyond/fp8_scaling.py: one all-gather of the table per group that
cuts it), cast by cast as beyond/fp8.py makes them (a forward casts x and W; a backward dY and W for
dx, dY and x for dW, a cast with the same blocks made once), per micro-batch, again in the forward
that full activation checkpointing replays; the experts' per expert and projection; and delayed
scaling's one all-gather a step of every operand's amax over tp and dp (x cp), for the history. The
counting rule is the code's own (fp8_scaling.block_count), not a copy of it.

Keeps: what bf16 keeps. An FP8 linear saves its input and weight in the step's dtype, as F.linear
does, and casts them again in the backward (torchao's Float8Linear does the same); its casts and the
dequantised fp32 operands of the emulation are transients of one matmul. Delayed scaling adds its
history and scales (`state_bytes`), fp32 on every rank. (A kernel that keeps the FP8 copy of x for dW
saves a byte an element where rowwise or tensor-wise scales allow; nanohlat's emulation does not.)

Buys (`time_ratio`): the decoder's linears at the device's FP8 rate (tools/metrics.py:FP8_FLOPS,
from the datasheets), the rest (attention's scores, the head, the embedding's backward) at its bf16
rate. Where the table has no FP8 rate (the A100, the CPU, where nanohlat only emulates) there is
nothing to buy, and the plan says so.
"""

from __future__ import annotations

from types import SimpleNamespace

from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.mesh import kv_replicas
from nanohlat.plan.context import local_tokens
from nanohlat.plan.params import stage_sparse_layers
from nanohlat.tools.metrics import FP8_FLOPS, flops_per_token, peak_flops

ROLES_OF_MATMULS = (("x", 1), ("w", 1)), (("dy", 1), ("w", 0), ("dy", 0), ("x", 0))   # forward, backward


def _casts(recipe: str, tokens, out_axis, in_axis, forwards: int):
    """The (rows, cols, blocks) of every cast one linear makes in a micro-batch (fp8.Operands.cast)."""
    from nanohlat.beyond.fp8_scaling import block_sizes
    axes = {"x": (tokens, in_axis), "w": (out_axis, in_axis), "dy": (tokens, out_axis)}
    out = []
    for times, matmuls in ((forwards, ROLES_OF_MATMULS[0]), (1, ROLES_OF_MATMULS[1])):
        made = set()
        for role, along in matmuls:
            across, length = block_sizes(recipe, role)
            blocks = (length, across) if along == 0 else (across, length)
            if (role, blocks) not in made:
                made.add((role, blocks))
                out += [(*axes[role], blocks)] * times
    return out


def _gathers(out: dict, add, casts, calls: int) -> None:
    """Each cast's amax-table all-gathers (fp8_scaling.block_amax), `calls` times."""
    from nanohlat.beyond.fp8_scaling import block_count
    for rows, cols, blocks in casts:
        r_n, r_groups = block_count(rows, blocks[0])
        c_n, c_groups = block_count(cols, blocks[1])
        groups = r_groups + tuple(g for g in c_groups if not any(g is h for h in r_groups))
        for g in groups:
            add(out, f"{g.name}.all_gather", g.size * r_n * c_n * 4, calls, g.size)


def add_collectives(out: dict, add, cfg: ModelConfig, tcfg: TrainConfig, mesh, stage: int) -> None:
    """FP8's collectives per step on `mesh`'s rank at pipeline `stage`, into comm_per_step's `out`
    (`add`: its _add). Delayed scaling casts with known scales: only its history's gather."""
    from nanohlat.beyond.fp8_scaling import Axis
    tp, cp, m = mesh.tp, tcfg.cp, tcfg.microbatches
    dp = mesh.dp
    mb, T = tcfg.batch_size // (dp * m), local_tokens(tcfg)
    tp_g, cp_g = SimpleNamespace(name="tp", size=tp), SimpleNamespace(name="cp", size=cp)
    layers = cfg.n_layers // tcfg.pp
    sparse = stage_sparse_layers(cfg, tcfg.pp, stage, tcfg.virtual_stages)
    dense = layers - sparse
    if tcfg.fp8 == "delayed":
        n = 3 * (4 * layers + 3 * dense) + 9 * (cfg.moe_experts + 1) * sparse
        for g, size in (("tp", tp), ("dp_cp" if cp > 1 else "dp", dp * cp)):
            if size > 1:   # (a group of one rank: comm.py does nothing)
                add(out, f"{g}.all_gather", size * n * 4, 1, size)
        return
    forwards = 1 + (tcfg.activation_checkpointing == "full")   # (full: each block's forward replayed)
    tokens = Axis(mb * T, mb * T * cp, piece=T * cp // (2 * cp), groups=(cp_g,)) if cp > 1 else Axis(mb * T)
    hd, r = cfg.head_dim, kv_replicas(cfg, tp)

    def cut(n: int, parts: int) -> Axis:
        return Axis(n // parts, n, piece=n // parts, groups=(tp_g,)) if parts > 1 else Axis(n)

    C, F = cfg.d_model, cfg.ffn_dim
    column = [(cfg.n_heads * hd, tp), (cfg.n_kv_heads * hd, tp // r), (cfg.n_kv_heads * hd, tp // r)]   # wq, wk, wv
    row = [(C, cfg.n_heads * hd)]                                                                        # wo
    for count, cols, rows in ((layers, column, row), (dense, [(F, tp), (F, tp)], [(C, F)])):             # gate, up; down
        for o, parts in cols:
            _gathers(out, add, _casts(tcfg.fp8, tokens, cut(o, parts), Axis(C), forwards), count * m)
        for o, i in rows:
            _gathers(out, add, _casts(tcfg.fp8, tokens, Axis(o), cut(i, tp), forwards), count * m)
    if sparse:   # the experts: each one's rows of each source a tensor, cut over the ranks routing a share
        seq = tuple(g for g in (cp_g, tp_g) if g.size > 1 and (g is cp_g or tcfg.sequence_parallel))
        sources = tcfg.ep if tcfg.ep > 1 else 1
        rows = Axis(0, segments=[0] * sources, groups=seq)
        shared = Axis(0, segments=[0], groups=seq)
        experts = cfg.moe_experts // tcfg.ep
        for axis, how_many in ((rows, experts), (shared, 1 if cfg.moe_shared_experts else 0)):
            for o, i in ((F, C), (F, C), (C, F)):
                _gathers(out, add, _casts(tcfg.fp8, axis, Axis(o), Axis(i), forwards), sparse * m * how_many)


def state_bytes(cfg: ModelConfig, tcfg: TrainConfig, stage_layers: int, sparse: int) -> int:
    """delayed scaling's history and scales on a rank (fp32): per linear 3 operands x (length + 1)."""
    if tcfg.fp8 != "delayed":
        return 0
    operands = 3 * (4 * stage_layers + 3 * (stage_layers - sparse)) + 9 * (cfg.moe_experts + 1) * sparse
    return 4 * operands * (tcfg.fp8_history + 1)


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the decoder's linears (6 per weight a token meets: the forward's 2, the
    backward's 4), the experts' k of E (and the shared ones): what FP8 computes."""
    hd = cfg.head_dim
    attn = cfg.d_model * (2 * cfg.n_heads * hd + 2 * cfg.n_kv_heads * hd)
    mlp = 3 * cfg.d_model * cfg.ffn_dim
    sparse = cfg.sparse_layers()
    experts = (cfg.moe_top_k + cfg.moe_shared_experts) * mlp
    return 6.0 * (cfg.n_layers * attn + (cfg.n_layers - sparse) * mlp + sparse * experts)


def time_ratio(cfg: ModelConfig, tcfg: TrainConfig, device: str, threads=None) -> float | None:
    """A step's arithmetic time with the linears at `device`'s FP8 rate over its time at the bf16 rate, at
    the same share of each peak; None where the device has no FP8 rate (nothing to buy)."""
    fp8, bf16 = FP8_FLOPS.get(device), peak_flops(device, "bf16-mixed", threads)
    if fp8 is None or not bf16:
        return None
    total = flops_per_token(cfg, tcfg.seq_len)
    linear = linear_flops_per_token(cfg)
    return (linear / fp8 + (total - linear) / bf16) / (total / bf16)


def plan_lines(cfg: ModelConfig, tcfg: TrainConfig, devices: list[str]) -> list[str]:
    """The plan's words on --fp8: the share of the FLOPs that FP8 computes, and what each device's rate
    makes of a step's arithmetic."""
    share = linear_flops_per_token(cfg) / flops_per_token(cfg, tcfg.seq_len)
    said = []
    for dev in dict.fromkeys(d.split(" ")[0] for d in devices):
        ratio = time_ratio(cfg, tcfg, dev, max(1, tcfg.threads))
        said.append(f"{dev} " + (f"{FP8_FLOPS[dev] / 1e12:,.0f} TFLOP/s: arithmetic x{ratio:.2f}" if ratio is not None
                                 else "no FP8 rate: nothing to buy" + (" (nanohlat emulates it)" if dev == "cpu" else "")))
    state = state_bytes(cfg, tcfg, cfg.n_layers // tcfg.pp, stage_sparse_layers(cfg, tcfg.pp, 0, tcfg.virtual_stages))
    return [f"  - --fp8 {tcfg.fp8}: the decoder's linears, {share:.0%} of the FLOPs, at the device's FP8 rate, the "
            f"rest at its bf16 rate (tools/metrics.py:FP8_FLOPS): " + "; ".join(said)
            + f"; it keeps what bf16 keeps (each linear's input and weight, cast again in backward)"
            + (f", and {state:,} bytes of amax history and scales on rank 0" if state else "")
            + "; its amax gathers are in the communication table ('tp.all_gather', 'cp.all_gather')"]
