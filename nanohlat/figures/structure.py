"""The figures drawn from nanohlat's structure alone: the model's parts, the mesh, a tp block's slices,
the pipeline schedules, ZeRO's bytes, context parallelism's chunks and a resharding's map. Nothing
here trains, so each figure's numbers are the same on every machine and the test compares them exactly.

Each figure is two functions: `NAME_data()`, the numbers drawn, read from the objects that train (a
model built on the meta device, the mesh's own groups, the schedules' own orders, the planner, the
checkpoint loader), and `NAME_svg(data)`, the drawing of exactly those numbers.
"""

from __future__ import annotations

import torch

from nanohlat import recipe
from nanohlat.comm import Group
from nanohlat.tools import svg
from nanohlat.tools.metrics import flops_per_token


def _configs(*flags: str):
    """(model config, train config) as train.py would parse these flags."""
    return recipe.parse_args(list(flags))


# ---------------------------------------------------------------------------
# Chapter 1: where a transformer's parameters and FLOPs are
# ---------------------------------------------------------------------------

PARTS = ("embedding", "attention", "MLP", "norms", "head")


def _part(name: str) -> str:
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("head."):
        return "head"
    if "norm" in name:
        return "norms"
    return "attention" if ".attn." in name else "MLP"


def model_parts_data() -> dict:
    """Each preset's parameters by part, counted on the model itself (model.Transformer built on the
    meta device: shapes, no memory), and its training FLOPs per token by part (6 per matmul weight,
    the embedding a lookup, plus attention's scores: tools/metrics.py's count, which the parts sum to)."""
    from nanohlat.model import Transformer
    out = {}
    for preset in ("tiny", "hlat-7b"):
        cfg, tcfg = _configs("--preset", preset)
        with torch.device("meta"):
            model = Transformer(cfg)
        params = dict.fromkeys(PARTS, 0)
        for name, p in model.named_parameters():
            params[_part(name)] += p.numel()
        flops = {part: 0 if part in ("embedding", "norms") else 6 * n for part, n in params.items()}
        flops["attention scores"] = 12 * cfg.n_layers * cfg.d_model * tcfg.seq_len
        assert sum(flops.values()) == flops_per_token(cfg, tcfg.seq_len), "the parts miss some FLOPs"
        assert sum(params.values()) == cfg.num_params()
        out[preset] = {"seq_len": tcfg.seq_len, "params": params, "flops_per_token": flops}
    return out


def model_parts_svg(data: dict) -> str:
    bars = []
    for preset, d in data.items():
        for what, unit in (("params", "parameters"), ("flops_per_token", "FLOPs/token")):
            total = sum(d[what].values())
            bars.append((f"{preset} {unit}", [(k, 100 * v / total) for k, v in d[what].items()]))
    return svg.stacked_bars(bars, "% of the model's total", width=620,
                            title="Where a transformer's parameters and training FLOPs are")


# ---------------------------------------------------------------------------
# Chapter 4: a tensor-parallel block's slices and its f / g
# ---------------------------------------------------------------------------

def tp_block_data(tp: int = 2) -> dict:
    """One Block of the tiny preset at tp 2, as each tp rank builds it (on the meta device): every
    parameter's full shape and which slice each rank holds (its ShardSpec), in the order the block
    uses them; and where the block enters (f) and leaves (g) a tp region: before a run of
    column-parallel linears (cut along their outputs, dim 0) and after a row-parallel one (cut along
    its inputs, dim 1), tensor_parallel.py's enter and leave."""
    from nanohlat.model import Block
    cfg, _ = _configs("--preset", "tiny")
    ranks = []
    for r in range(tp):
        with torch.device("meta"):
            block = Block(cfg, Group("tp", list(range(tp)), r, None), False, None, True)
        ranks.append({n: p.shard for n, p in block.named_parameters()})
    steps, column = [], False
    for name, spec in ranks[0].items():
        kind = "replicated" if spec.dim is None else "column" if spec.dim == 0 else "row"
        if kind == "column" and not column:
            steps.append({"collective": "f"})
        column = kind == "column"
        steps.append({"param": name, "kind": kind, "full_shape": list(spec.full_shape),
                      "slices": [[s[name].part, s[name].parts] for s in ranks]})
        if kind == "row":
            steps.append({"collective": "g"})
    return {"preset": "tiny", "tp": tp, "steps": steps}


def tp_block_svg(data: dict) -> str:
    scale, x, top = 0.9, 10, 40
    tallest = max(st["full_shape"][0] for st in data["steps"] if "param" in st)
    s = svg.Svg(0, 0, f"One block at tp {data['tp']}: each rank's slice of every weight, f and g")
    s.text(10, 16, f"One {data['preset']} block at tp {data['tp']}: the slice of each weight that each tp rank "
                   f"holds (colour: the rank), and the block's f and g", size=12, bold=True)
    for st in data["steps"]:
        if "collective" in st:
            f = st["collective"] == "f"
            s.rect(x, top, 26, tallest * scale, "#eee", stroke="#888")
            s.text(x + 13, top + 16, st["collective"], size=14, anchor="middle", bold=True)
            s.text(x + 13, top + tallest * scale + 14, "fwd: id" if f else "fwd: AR", size=9, anchor="middle")
            s.text(x + 13, top + tallest * scale + 26, "bwd: AR" if f else "bwd: id", size=9, anchor="middle")
            x += 40
            continue
        rows, cols = st["full_shape"] if len(st["full_shape"]) == 2 else (st["full_shape"][0], 8)
        w, h = cols * scale, rows * scale
        slot = max(w, 50)                  # a narrow box (a norm's gain) is centred in a slot its label fits
        x0 = x + (slot - w) / 2
        if st["kind"] == "replicated":
            s.rect(x0, top, w, h, "#fff", tip=f"{st['param']}: {rows}, on every rank", stroke="#888")
        for rank, (part, parts) in enumerate(st["slices"]):
            if st["kind"] == "replicated":
                continue
            dim = 0 if st["kind"] == "column" else 1
            size = (rows if dim == 0 else cols) / parts
            rx, ry = (x0, top + part * size * scale) if dim == 0 else (x0 + part * size * scale, top)
            s.rect(rx, ry, w if dim == 0 else size * scale, size * scale if dim == 0 else h, svg.colour(rank),
                   stroke="#fff", tip=f"{st['param']} {rows}x{cols}: tp rank {rank} holds part {part} of {parts}")
        label = st["param"].split(".")[-2].replace("attn_", "").replace("mlp_", "")
        s.text(x + slot / 2, top + tallest * scale + 14, label, size=10, anchor="middle")
        s.text(x + slot / 2, top + tallest * scale + 26, st["kind"], size=9, anchor="middle", fill="#555")
        x += slot + 10
    for rank in range(data["tp"]):
        s.rect(10 + 90 * rank, top + tallest * scale + 36, 10, 10, svg.colour(rank))
        s.text(24 + 90 * rank, top + tallest * scale + 45, f"tp rank {rank}", size=10)
    s.text(10 + 90 * data["tp"], top + tallest * scale + 45,
           "AR: all-reduce over the tp group; id: identity; each box drawn to its weight's shape (out x in)", size=10)
    s.width, s.height = max(x, 620), top + tallest * scale + 56
    return str(s)


# ---------------------------------------------------------------------------
# Chapter 5: the pipeline schedules, as their runners lay them out
# ---------------------------------------------------------------------------

KINDS = {"F": 0, "B": 1, "W": 2}


def _kind(op: str) -> int:
    """An op's colour: F, B, W; an op on chunk 1 (interleaved: 'F3.1') in its own pair of colours."""
    return KINDS[op[0]] + (4 if "." in op else 0)


def schedule_data(schedule: str, pp: int = 4, m: int = 8, v: int = 1) -> dict:
    """One schedule's ticks (schedules.timetable: what the runner runs, stage by stage, tick by tick)
    and its ideal timeline (tools/timeline.py:ideal_timeline: the same orders with a forward of 1
    unit, a backward of 2, no communication), with the bubble of each and the formula's."""
    from nanohlat.beyond import schedules
    from nanohlat.tools import timeline as tl
    ticks = schedules.timetable(schedule, pp, m, v)
    rows, span = tl.ideal_timeline(schedule, pp, m, v)
    return {"schedule": schedule, "pp": pp, "m": m, "v": v,
            "ticks": [[tl.op_name(t[s]) if t[s] else "" for t in ticks] for s in range(pp)],
            "ideal": [[[tl.op_name((k, i, c)), a, b] for k, i, a, b, c in row] for row in rows],
            "ideal_span": span, "bubble_ideal": round(tl.ideal_bubble(schedule, pp, m, v), 6),
            "bubble_lockstep": round(tl.lockstep_bubble(ticks, m, v), 6),
            "bubble_formula": round(tl.formula_bubble(pp, m, schedule, v), 6)}


def schedule_svg(data: dict) -> str:
    name = data["schedule"] + (f", v {data['v']}" if data["v"] > 1 else "")
    ticks = [(f"stage {s}", [(t, t + 1, op, _kind(op)) for t, op in enumerate(row) if op])
             for s, row in enumerate(data["ticks"])]
    ideal = [(f"stage {s}", [(a, b, op, _kind(op)) for op, a, b in row]) for s, row in enumerate(data["ideal"])]
    return svg.panels([
        svg.gantt(ticks, "tick (each stage runs at most one op a tick, then neighbours exchange)", width=720,
                  title=f"{name}: the runner's timetable, lock-step bubble {data['bubble_lockstep']:.2f}"),
        svg.gantt(ideal, "time: forward 1 unit, backward 2" + (" (B 1 and W 1)" if data["schedule"] == "zb-h1"
                  else "") + (f", each a chunk's 1/{data['v']}" if data["v"] > 1 else ""), width=720,
                  title=f"{name}: ideal, bubble {data['bubble_ideal']:.2f} (formula {data['bubble_formula']:.2f})")],
        title=f"{name}, pp {data['pp']}, m {data['m']}: F forward, B backward"
              + (", W weight gradient" if data["schedule"] == "zb-h1" else "")
              + ("; chunk 1's in sky blue and red" if data["v"] > 1 else ""))


# ---------------------------------------------------------------------------
# Chapter 3: ZeRO 0-3, bytes per rank from the planner
# ---------------------------------------------------------------------------

ZERO_CASES = (("--preset", "tiny", "--nproc", "2", "--dp", "2"),
              ("--preset", "hlat-7b", "--nproc", "512", "--tp", "8", "--dp", "64"))


def zero_bytes_data() -> dict:
    """What one rank keeps between steps at ZeRO 0, 1, 2 and 3 (plan/memory.py:memory_per_rank: the
    weights, the fp32 gradient buffer, the optimizer state), for the chapter's tiny run and for
    HLAT-7B's recipe (pure bf16, tp 8) over 64 data-parallel ranks."""
    from nanohlat.plan.memory import memory_per_rank
    out = {}
    for flags in ZERO_CASES:
        rows = {}
        for zero in range(4):
            cfg, tcfg = _configs(*flags, "--zero", str(zero))
            mem = memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, tcfg.dp, 0, fused=True, eager=True)
            rows[f"ZeRO-{zero}"] = {"weights": mem["weights"], "fp32 grads": mem["flat_grads"],
                                    "optimizer state": mem["optimizer"]}
        out[f"{flags[1]}, {tcfg.precision}, tp {tcfg.tp} x pp {tcfg.pp} x dp {tcfg.dp}"] = rows
    return out


def zero_bytes_svg(data: dict) -> str:
    return svg.panels([svg.stacked_bars([(z, list(terms.items())) for z, terms in rows.items()], "bytes per rank",
                                        width=560, title=label) for label, rows in data.items()],
                      title="What a rank keeps between steps, ZeRO 0-3 (the plan)")


# ---------------------------------------------------------------------------
# Chapter 6: the mesh's ranks and groups
# ---------------------------------------------------------------------------

MESH_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "ep_dp")


def mesh_data(tp: int = 2, cp: int = 2, pp: int = 2, dp: int = 2, ep: int = 2) -> dict:
    """Every rank's coordinates and every group of each kind, as the mesh itself lists them
    (plan/params.py:mesh_at, context_parallel.ContextMesh with cp, moe.add_groups for ep)."""
    from nanohlat.beyond.moe import add_groups
    from nanohlat.plan.params import mesh_at
    mesh = add_groups(mesh_at(tp, pp, dp, 0, cp), ep)
    coords = []
    for r in range(mesh.world):
        m = mesh_at(tp, pp, dp, r, cp)
        coords.append([m.pp_rank, m.dp_rank, m.cp_rank, m.tp_rank])
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "coords [pp, dp, cp, tp]": coords,
            "groups": {kind: mesh._all(kind) for kind in MESH_KINDS}}


def mesh_svg(data: dict) -> str:
    coords = data["coords [pp, dp, cp, tp]"]
    rows = sorted({(p, d) for p, d, _, _ in coords})
    cols = sorted({(c, t) for _, _, c, t in coords})
    parts = []
    for kind, groups in data["groups"].items():
        which = {r: i for i, g in enumerate(groups) for r in g}
        cells = [[("", None)] * len(cols) for _ in rows]
        for r, (p, d, c, t) in enumerate(coords):
            cells[rows.index((p, d))][cols.index((c, t))] = (str(r), which.get(r))
        parts.append(svg.grid(cells, [f"pp{p} dp{d}" for p, d in rows], [f"c{c}t{t}" for c, t in cols],
                              cell=30, title=f"{kind}: {len(groups)} groups of {len(groups[0])}"))
    return svg.panels(parts, columns=4, title=(
        f"tp {data['tp']} x cp {data['cp']} x dp {data['dp']} x pp {data['pp']} = {len(coords)} ranks, ep "
        f"{data['ep']}: the ranks by coordinates (c cp, t tp), one colour per group"))


# ---------------------------------------------------------------------------
# Chapter 11: context parallelism's zigzag chunks and the pairs each rank computes
# ---------------------------------------------------------------------------

def cp_pairs_data(cp: int = 4, T: int = 16) -> dict:
    """The zigzag split (context_parallel.zigzag_positions) of T tokens over cp ranks: which rank holds
    each of the 2 cp chunks; for each rank, each (query chunk, key chunk) pair's relation as
    context_parallel._relation classes it (skip, full, diagonal); and the causal (query, key) token
    pairs each rank computes, zigzag against the contiguous split (contiguous_positions)."""
    from nanohlat.beyond import context_parallel as ctx
    pos = ctx.zigzag_positions(T, cp)
    n = 2 * cp
    chunks = torch.arange(T).view(n, T // n)
    owner = [next(r for r in range(cp) for half in pos[r].chunk(2) if torch.equal(half, chunks[c]))
             for c in range(n)]
    pairs = []
    for r in range(cp):
        mine = [next(c for c in range(n) if torch.equal(half, chunks[c])) for half in pos[r].chunk(2)]
        pairs.append({str(q): [ctx._relation(chunks[q], chunks[k]) for k in range(n)] for q in mine})
    causal = lambda table: [int((table[r] + 1).sum()) for r in range(cp)]   # noqa: E731 (keys 0..p)
    return {"cp": cp, "T": T, "chunk_owner": owner, "pairs": pairs,
            "token_pairs_zigzag": causal(pos), "token_pairs_contiguous": causal(ctx.contiguous_positions(T, cp))}


def cp_pairs_svg(data: dict) -> str:
    n, kinds = 2 * data["cp"], {"full": 0, "diagonal": 2, "skip": None}
    parts = [svg.grid([[(str(o), o) for o in data["chunk_owner"]]], ["rank"], [str(c) for c in range(n)],
                      cell=32, title="zigzag: the rank holding each chunk")]
    for r, rows in enumerate(data["pairs"]):
        parts.append(svg.grid([[({"diagonal": "diag"}.get(rel, rel), kinds[rel]) for rel in rels]
                               for rels in rows.values()], [f"query {q}" for q in rows], [str(k) for k in range(n)],
                              cell=32, title=f"rank {r}: (query chunk, key chunk)"))
    parts.append(svg.grouped_bars([(f"rank {r}", [("zigzag", z), ("contiguous", c)]) for r, (z, c) in
                                   enumerate(zip(data["token_pairs_zigzag"], data["token_pairs_contiguous"]))],
                                  "causal (query, key) token pairs computed", width=340, title="each rank's work"))
    return svg.panels(parts, columns=2, title=f"cp {data['cp']}, T {data['T']}: {n} chunks, zigzag; full and "
                                              f"diag pairs computed, skip never")


# ---------------------------------------------------------------------------
# Chapter 8: a resharding load's map of shards
# ---------------------------------------------------------------------------

RESHARD_PARAMS = ("layers.0.attn.wq.weight", "layers.3.mlp.down.weight", "layers.3.mlp_norm.weight")


RESHARDS = (((2, 2), (4, 1)), ((4, 1), (2, 2)))


def reshard_data() -> dict:
    """Each resharding of RESHARDS (reshard_case), and its reverse."""
    return {"cases": [reshard_case(saved, loaded) for saved, loaded in RESHARDS]}


def reshard_case(saved, loaded) -> dict:
    """A tiny model saved at tp x pp = `saved` and loaded at `loaded`, for a few parameters: each
    saved rank's shard is what run/checkpoint/saving.py writes of it (the parameter's meta, only the
    first copy of a replicated one), filled with that rank's number; ShardSet.full, the loader's own
    code, puts each full tensor together, and shard_spec.local_part cuts each new rank's part of it.
    So each count is how many elements a new rank reads from each saved rank's file."""
    from nanohlat.mesh import Mesh
    from nanohlat.model import Transformer
    from nanohlat.pipeline import stage_layers
    from nanohlat.run.checkpoint.reshard import ShardSet
    from nanohlat.run.checkpoint.saving import _first_copy, _meta
    from nanohlat.shard_spec import local_part
    cfg, _ = _configs("--preset", "tiny")

    def stages(tp, pp):   # (rank, its mesh, its stage's parameters) of a layout, on the meta device
        for r in range(tp * pp):
            mesh = Mesh(tp, pp, 1, r)
            with torch.device("meta"):
                model = Transformer(cfg, Group("tp", list(range(tp)), mesh.tp_rank, None), False,
                                    stage_layers(cfg.n_layers, pp, mesh.pp_rank), mesh.is_first_stage,
                                    mesh.is_last_stage)
            yield r, mesh, dict(model.named_parameters())

    shards = ShardSet.__new__(ShardSet)
    shards.path, shards.shards = "(in memory)", {}
    for r, mesh, params in stages(*saved):
        keep = {n: p for n, p in params.items() if n in RESHARD_PARAMS and _first_copy(p, mesh)}
        shards.shards[f"rank{r}"] = {"tp": saved[0], "tp_rank": mesh.tp_rank, "rank": r,
                                     "meta": {n: _meta(p) for n, p in keep.items()},
                                     "model": {n: torch.full(p.shape, float(r)) for n, p in keep.items()}}
    reads = {}
    for r, mesh, params in stages(*loaded):
        for name in RESHARD_PARAMS:
            if name in params:
                part = local_part(shards.full(name), params[name])
                reads.setdefault(name, {})[str(r)] = {str(int(k)): int((part == k).sum())
                                                      for k in part.unique().tolist()}
    return {"saved": {"tp": saved[0], "pp": saved[1]}, "loaded": {"tp": loaded[0], "pp": loaded[1]},
            "reads": reads}


def reshard_svg(data: dict) -> str:
    cases = []
    for case in data["cases"]:
        world, (s, ld) = case["saved"]["tp"] * case["saved"]["pp"], (case["saved"], case["loaded"])
        parts = []
        for name, by_rank in case["reads"].items():
            cells = [[(str(got.get(str(k), "")), k if str(k) in got else None) for k in range(world)]
                     for got in by_rank.values()]
            parts.append(svg.grid(cells, [f"new {r}" for r in by_rank], [f"old {k}" for k in range(world)], cell=40,
                                  title=name.replace(".weight", "")))
        cases.append(svg.panels(parts, columns=3, title=f"saved at tp {s['tp']} x pp {s['pp']}, loaded at tp "
                                                        f"{ld['tp']} x pp {ld['pp']}"))
    return svg.panels(cases, title="Resharding: the elements each new rank reads from each old rank's file")
