"""The parameters one rank holds: per pipeline stage and tp rank, and in the
flat buffers of optim.FlatAdamW (one per kind: tp-sharded matrices, replicated
kv heads, replicated norms; a mixture of experts adds its routers and experts,
and with --ep its E/ep experts apart), which ZeRO pads to a multiple of dp."""

from __future__ import annotations

from nanohlat.mesh import Mesh
from nanohlat.recipe import ModelConfig
from nanohlat.precision import param_dtype
from nanohlat.tools.orders import chunk_layers
from nanohlat.zero1 import padded_size


def dtype_bytes(precision: str) -> int:
    return param_dtype(precision).itemsize


def mesh_at(tp: int, pp: int, dp: int, rank: int, cp: int = 1) -> Mesh:
    """The mesh of `rank`, its groups not built: mesh.Mesh, or with --cp context_parallel.ContextMesh
    (imported only then: the plan of HLAT's recipe loads nothing of nanohlat/beyond/)."""
    if cp == 1:
        return Mesh(tp, pp, dp, rank)
    from nanohlat.beyond.context_parallel import ContextMesh
    return ContextMesh(tp, pp, dp, rank, cp=cp)


def sparse_in(cfg: ModelConfig, layers: range) -> int:
    """How many of a contiguous run of layers are sparse (cfg.is_moe_layer), by arithmetic, not counting."""
    every = cfg.moe_every
    return (layers.stop // every - layers.start // every) if cfg.moe_experts and len(layers) else 0


def stage_sparse_layers(cfg: ModelConfig, pp: int, stage: int, v: int = 1) -> int:
    """How many of the layers stage `stage` holds (its v chunks: orders.chunk_layers) are sparse."""
    return sum(sparse_in(cfg, chunk_layers(cfg.n_layers, pp, stage, c, v)) for c in range(v))


def moe_counts(cfg: ModelConfig, ep: int = 1, tp: int = 1, sparse: int | None = None) -> dict:
    """A mixture of experts' `sparse` layers (default: all of them) on one rank, by flat buffer (moe.py's
    Weight): "moe", replicated on every rank (over tp too, like the norms): each sparse layer's router
    (E x d_model) and shared experts, and at ep 1 its E experts too; "experts", with --ep N: the rank's
    E/N experts of each sparse layer (gate, up, down: 3 x d_model x ffn_dim each), summed over the dp/N
    ranks holding the same ones; "dense_mlp": the tp rank's share of the dense MLPs they do not have."""
    if not cfg.moe_experts:
        return {"moe": 0, "experts": 0, "dense_mlp": 0}
    sparse = cfg.sparse_layers() if sparse is None else sparse
    mlp, E = 3 * cfg.d_model * cfg.ffn_dim, cfg.moe_experts
    experts = sparse * E // ep * mlp
    moe = sparse * (E * cfg.d_model + cfg.moe_shared_experts * mlp) + (experts if ep == 1 else 0)
    return {"moe": moe, "experts": experts if ep > 1 else 0, "dense_mlp": sparse * (mlp // tp)}


def stage_param_counts(cfg: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1, v: int = 1) -> dict:
    """Parameters of one (stage, tp rank): tp-sharded matrices and tp-replicated norms;
    "kv": of the matrices, the wk and wv rows replicated over a kv group (tp > n_kv_heads);
    "moe", "experts": a mixture's routers and experts on the stage's sparse layers (moe_counts;
    "sharded" then leaves out the dense MLPs they do not have). v: --virtual-stages."""
    d, layers = cfg.d_model, cfg.n_layers // pp
    sharded = layers * cfg.layer_matrix_params(tp)
    norms = layers * 2 * d
    kv = layers * 2 * d * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
    if stage == 0:
        sharded += cfg.padded_vocab * d // tp
    if stage == pp - 1:
        sharded += cfg.padded_vocab * d // tp
        norms += d
    moe = moe_counts(cfg, ep, tp, stage_sparse_layers(cfg, pp, stage, v))
    sharded -= moe["dense_mlp"]
    return {"sharded": sharded, "replicated": norms, "kv": kv, "moe": moe["moe"], "experts": moe["experts"],
            "total": sharded + norms + moe["moe"] + moe["experts"]}


def layer_kinds(cfg: ModelConfig, tp: int, i: int, ep: int = 1) -> list[tuple[str, int]]:
    """(kind, elements) of layer i's own flat buffers under ZeRO-3 (one unit a layer: zero3.py)."""
    d, kv = cfg.d_model, 2 * cfg.d_model * cfg.kv_heads_per_rank(tp) * cfg.head_dim if tp > cfg.n_kv_heads else 0
    moe = moe_counts(cfg, ep, tp, int(cfg.is_moe_layer(i)))
    return [("sharded", cfg.layer_matrix_params(tp) - kv - moe["dense_mlp"]), ("kv", kv), ("moe", moe["moe"]),
            ("experts", moe["experts"]), ("replicated", 2 * d)]


def group_kinds(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0,
                ep: int = 1, v: int = 1) -> list[tuple[str, int]]:
    """(kind, elements) of each of optim.FlatAdamW's flat buffers on one rank: the tp-split
    matrices ("sharded"), the replicated kv heads' ("kv", if any: summed over their kv group), the
    norms ("replicated": summed over tp under SP). Each is padded to a multiple of dp under ZeRO,
    so the plan sums them group by group. ZeRO-3 (pp 1): the same kinds per unit (zero3.py), each
    layer's (layer_kinds), then the rest's (embedding and head; final norm). A mixture of experts
    adds "moe" (summed over tp under SP, like the norms) and, with --ep, "experts" (moe_counts)."""
    if zero == 3:
        groups = [g for i in range(cfg.n_layers) for g in layer_kinds(cfg, tp, i, ep)]
        groups += [("sharded", 2 * cfg.padded_vocab * cfg.d_model // tp), ("replicated", cfg.d_model)]
    else:
        c = stage_param_counts(cfg, tp, pp, stage, ep, v)
        groups = [("sharded", c["sharded"] - c["kv"]), ("kv", c["kv"]), ("moe", c["moe"]), ("experts", c["experts"]),
                  ("replicated", c["replicated"])]
    return [(kind, n) for kind, n in groups if n]


def zero_groups(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int, ep: int, ranks: int,
                v: int = 1) -> list[tuple[int, int]]:
    """(elements, ranks its ZeRO shards go over) of each flat buffer (group_kinds), for `ranks` = dp (x cp)
    under ZeRO, 1 without: all of them over those ranks but --ep's experts, sharded over the ranks holding
    the same experts (ranks / ep: optim.FlatAdamW's strategy over the mesh's ep_dp, moe.add_groups)."""
    return [(n, ranks // ep if kind == "experts" and ranks > 1 else ranks)
            for kind, n in group_kinds(cfg, tp, pp, stage, zero, ep, v)]


def flat_groups(cfg: ModelConfig, tp: int, pp: int, stage: int, zero: int = 0, ep: int = 1, v: int = 1) -> list[int]:
    """Elements of each flat buffer on one rank (group_kinds)."""
    return [n for _, n in group_kinds(cfg, tp, pp, stage, zero, ep, v)]


def zero3_gathered(cfg: ModelConfig, tp: int, dp: int, ep: int = 1) -> int:
    """ZeRO-3: elements of the flat buffers whole at once in a backward, at most: the rest's unit
    (whole through a micro-batch's forward and backward) and the largest layer's (zero3.py; a
    mixture's sparse layers are larger than its dense ones)."""
    rest = padded_size(2 * cfg.padded_vocab * cfg.d_model // tp, dp) + padded_size(cfg.d_model, dp)
    kinds = {cfg.is_moe_layer(i): i for i in (0, cfg.moe_every - 1)}   # a dense layer and a sparse one, if any
    return rest + max(sum(padded_size(n, dp // ep if kind == "experts" else dp)
                          for kind, n in layer_kinds(cfg, tp, i, ep) if n) for i in kinds.values())
