"""The parameters one rank holds: per pipeline stage and tp rank, and in the
flat buffers of optim.FlatAdamW (one per kind: tp-sharded matrices, replicated
kv heads, replicated norms; a mixture of experts adds its routers and experts,
and with --ep its E/ep experts apart), which ZeRO pads to a multiple of dp."""

from __future__ import annotations

from nanohlat.system.recipe import ModelConfig
from nanohlat.precision import param_dtype
from nanohlat.zero1 import padded_size


def dtype_bytes(precision: str) -> int:
    return param_dtype(precision).itemsize


def moe_counts(cfg: ModelConfig, ep: int = 1) -> dict:
    """A mixture of experts (tp 1, pp 1: recipe.check_moe_layout) on one rank, by flat buffer (moe.py's
    Weight): "moe", replicated on every rank: each sparse layer's router (E x d_model) and shared
    experts, and at ep 1 its E experts too; "experts", with --ep N: the rank's E/N experts of each
    sparse layer (gate, up, down: 3 x d_model x ffn_dim each), summed over the dp/N ranks holding
    the same ones; "dense_mlp": the dense MLPs the sparse layers do not have."""
    if not cfg.moe_experts:
        return {"moe": 0, "experts": 0, "dense_mlp": 0}
    sparse = cfg.sparse_layers()
    mlp, E = 3 * cfg.d_model * cfg.ffn_dim, cfg.moe_experts
    experts = sparse * E // ep * mlp
    moe = sparse * (E * cfg.d_model + cfg.moe_shared_experts * mlp) + (experts if ep == 1 else 0)
    return {"moe": moe, "experts": experts if ep > 1 else 0, "dense_mlp": sparse * mlp}


def stage_param_counts(cfg: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> dict:
    """Parameters of one (stage, tp rank): tp-sharded matrices and tp-replicated norms;
    "kv": of the matrices, the wk and wv rows replicated over a kv group (tp > n_kv_heads);
    "moe", "experts": a mixture's routers and experts (moe_counts; "sharded" then
    leaves out the dense MLPs its sparse layers do not have)."""
    d, layers = cfg.d_model, cfg.n_layers // pp
    sharded = layers * cfg.layer_matrix_params(tp)
    norms = layers * 2 * d
    kv = layers * 2 * d * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
    if stage == 0:
        sharded += cfg.padded_vocab * d // tp
    if stage == pp - 1:
        sharded += cfg.padded_vocab * d // tp
        norms += d
    moe = moe_counts(cfg, ep)
    sharded -= moe["dense_mlp"]
    return {"sharded": sharded, "replicated": norms, "kv": kv, "moe": moe["moe"], "experts": moe["experts"],
            "total": sharded + norms + moe["moe"] + moe["experts"]}


def group_kinds(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0,
                ep: int = 1) -> list[tuple[str, int]]:
    """(kind, elements) of each of optim.FlatAdamW's flat buffers on one rank: the tp-split
    matrices ("sharded"), the replicated kv heads' ("kv", if any: summed over their kv group), the
    norms ("replicated": summed over tp under SP). Each is padded to a multiple of dp under ZeRO,
    so the plan sums them group by group. ZeRO-3 (pp 1): the same kinds per unit (zero3.py), each
    layer's, then the rest's (embedding and head; final norm). A mixture of experts adds "moe"
    and, with --ep, "experts" (moe_counts; its plan refuses ZeRO-3, and with --ep ZeRO-2: zero_groups)."""
    if zero == 3:
        d, kv = cfg.d_model, 2 * cfg.d_model * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
        layer = [("sharded", cfg.layer_matrix_params(tp) - kv), ("kv", kv), ("replicated", 2 * d)]
        groups = layer * cfg.n_layers + [("sharded", 2 * cfg.padded_vocab * d // tp), ("replicated", d)]
    else:
        c = stage_param_counts(cfg, tp, pp, stage, ep)
        groups = [("sharded", c["sharded"] - c["kv"]), ("kv", c["kv"]), ("moe", c["moe"]), ("experts", c["experts"]),
                  ("replicated", c["replicated"])]
    return [(kind, n) for kind, n in groups if n]


def zero_groups(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int, ep: int, ranks: int) -> list[tuple[int, int]]:
    """(elements, ranks its ZeRO shards go over) of each flat buffer (group_kinds), for `ranks` = dp (x cp)
    under ZeRO, 1 without: all of them over those ranks but --ep's experts, sharded over the ranks holding
    the same experts (ranks / ep: optim.FlatAdamW's strategy over the mesh's ep_dp, moe.add_groups)."""
    return [(n, ranks // ep if kind == "experts" and ranks > 1 else ranks)
            for kind, n in group_kinds(cfg, tp, pp, stage, zero, ep)]


def flat_groups(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0, ep: int = 1) -> list[int]:
    """Elements of each flat buffer on one rank (group_kinds)."""
    return [n for _, n in group_kinds(cfg, tp, pp, stage, zero, ep)]


def zero3_gathered(cfg: ModelConfig, tp: int, dp: int) -> int:
    """ZeRO-3: elements of the flat buffers whole at once in a backward, at most: the rest's unit
    (whole through a micro-batch's forward and backward) and one layer's (zero3.py)."""
    groups = [padded_size(n, dp) for n in flat_groups(cfg, tp, 1, 0, 3)]
    rest = sum(groups[-2:])                           # (the last unit's two groups: embedding + head, final norm)
    return rest + sum(groups[:len(groups) - 2]) // cfg.n_layers
