"""The printed plan (`train.py --plan`): the layout and the mesh, memory per
rank, communication per step, the estimated step time and where the dp bytes
go, then the KV cache; and the comm table a run prints beside its ledger."""

from __future__ import annotations

import dataclasses

from nanohlat import comm
from nanohlat.recipe import ModelConfig, TrainConfig, check_layout
from nanohlat.mesh import coords, kv_replicas, rank_of
from nanohlat.tools.metrics import active_params, flops_per_token
from nanohlat.plan.communication import comm_per_step
from nanohlat.plan.context import (ALGORITHMS, attention_collectives, attention_core_bytes, attention_flops,
                                         attention_pairs, local_tokens, ulysses_fits)
from nanohlat.plan.fmt import fmt_bytes, fmt_count, fmt_flop, fmt_seconds, table
from nanohlat.plan.hardware import DEVICE_MEMORY, NETWORKS, PLAN_DEVICES, dp_groups
from nanohlat.plan.failures import failures_section
from nanohlat.plan.kv_cache import kv_cache_section
from nanohlat.plan.params import dtype_bytes, mesh_at
from nanohlat.plan.memory import (PEAK_MARGIN, activation_bytes, bytes_per_param_line, memory_per_rank, micro_batch_size,
                                        weight_grad_bytes)
from nanohlat.plan.step_time import DEFAULT_MFU, estimate_step, recompute_flops_per_token
from nanohlat.tools.timeline import FORMULAS


def stage_layer_text(n_layers: int, pp: int, stage: int, v: int = 1) -> str:
    """A stage's layers as text: '2-3', or with v chunks each chunk's run, '2-3,10-11'."""
    per = n_layers // (pp * v)
    return ",".join(f"{k * per}-{(k + 1) * per - 1}" for k in range(stage, pp * v, pp))


def layout_table(tp: int, pp: int, dp: int, n_layers: int | None = None, max_rows: int = 64, v: int = 1,
                 cp: int = 1) -> str:
    """The printable rank -> (dp, pp, tp) table (`--plan` and the run's log);
    v: model chunks per stage (interleaved schedule); cp > 1: a cp column too."""
    world = tp * pp * dp * cp
    per = bool(n_layers)
    lines = [f"world {world} = dp {dp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "") + f" x tp {tp}",
             "rank  dp  pp" + ("  cp" if cp > 1 else "") + "  tp" + ("  layers" if per else "")]
    shown = list(range(world)) if world <= max_rows else list(range(max_rows // 2)) + list(range(world - max_rows // 2, world))
    for i, r in enumerate(shown):
        if i and shown[i - 1] != r - 1:
            lines.append(f"  ... {r - shown[i - 1] - 1} more ranks ...")
        d, p, inner = coords(r, tp * cp, pp, dp)   # (cp, tp) as one inner coordinate: context_parallel.ContextMesh
        c, t = divmod(inner, tp)
        row = f"{r:4d} {d:3d} {p:3d}" + (f" {c:3d}" if cp > 1 else "") + f" {t:3d}"
        if per:
            row += f"  {stage_layer_text(n_layers, pp, p, v)}" + ("  +embedding" if p == 0 else "") + ("  +norm,head,loss" if p == pp - 1 else "")
        lines.append(row)
    return "\n".join(lines)


def shown_stages(pp: int) -> list[int]:
    return list(range(pp)) if pp <= 16 else [0, 1, pp - 2, pp - 1]


def schedule_text(tcfg: TrainConfig) -> str:
    """'1f1b', or 'interleaved (v=2 chunks per stage)'."""
    v = tcfg.virtual_stages
    return tcfg.schedule + (f" (v={v} chunks per stage)" if v > 1 else "")


def validate_plan_layout(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> tuple[int, list[str]]:
    """recipe.check_layout, and what to note about the layout. Returns dp and notes to print."""
    dp = check_layout(cfg, tcfg, world)
    if tcfg.tp <= cfg.n_kv_heads:
        return dp, []
    return dp, [f"note: tp {tcfg.tp} > {cfg.n_kv_heads} kv heads, so each tp rank holds a replica of one kv head, the one "
                f"its query heads use (each shared by {kv_replicas(cfg, tcfg.tp)} ranks, as HLAT-70B ran); their wk and "
                f"wv gradients are summed over those ranks once per step, in fp32 (kv.all_reduce below)."]


def report(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> str:
    """Everything above as text: the answer to `train.py --plan`."""
    dp, notes = validate_plan_layout(cfg, tcfg, world)
    tp, pp, m, cp = tcfg.tp, tcfg.pp, tcfg.microbatches, tcfg.cp
    sp = tcfg.sequence_parallel and tp > 1
    tokens = tcfg.batch_size * tcfg.seq_len
    cp_text = f" x cp {cp} ({tcfg.cp_attention} attention)" if cp > 1 else ""
    lines = [f"plan for preset {tcfg.preset}: {fmt_count(cfg.num_params())} parameters "
         f"(vocabulary {cfg.vocab_size}, padded {cfg.padded_vocab}), {world} ranks",
         f"  layout: dp {dp} x pp {pp}{cp_text} x tp {tp}; sequence parallel "
         f"{('on, ' + ('re-gathered in backward' if tcfg.sp_regather else 'gathers kept')) if sp else 'off'}; "
         f"activation checkpointing {tcfg.activation_checkpointing}; "
         f"{f'ZeRO-{tcfg.zero}' if tcfg.zero else 'replicated optimizer'}; precision {tcfg.precision}; schedule {schedule_text(tcfg)}",
         f"  batch: {tcfg.batch_size} sequences x {tcfg.seq_len} tokens = {tokens:,} tokens per step; per dp rank "
         f"{tcfg.batch_size // dp} = {m} micro-batch(es) of {micro_batch_size(tcfg, dp)}"
         + (f", each sequence split over the {cp} cp ranks: {tcfg.seq_len // cp:,} tokens of it on each" if cp > 1 else "")]
    lines.append("  " + bytes_per_param_line(tcfg))
    lines += ["  " + n for n in notes] + _moe_lines(cfg, tcfg, dp)
    lines += ["", "mesh (rank -> coordinates, and the layers each stage holds)",
          layout_table(tp, pp, dp, cfg.n_layers, max_rows=16, v=tcfg.virtual_stages, cp=cp)]
    lines += _memory_section(cfg, tcfg, dp)
    lines += _comm_section(cfg, tcfg, dp)
    lines += cp_section(cfg, tcfg, dp)
    lines += _time_section(cfg, tcfg, world)
    lines += failures_section(cfg, tcfg, world)
    lines += kv_cache_section(cfg, tcfg)
    return "\n".join(lines)


def _moe_lines(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    """A mixture of experts: its total and active parameters, where its experts live."""
    if not cfg.moe_experts:
        return []
    E, k, ep = cfg.moe_experts, cfg.moe_top_k, tcfg.ep
    sparse = cfg.sparse_layers()
    active = active_params(cfg)
    shared = f" + {cfg.moe_shared_experts} shared" if cfg.moe_shared_experts else ""
    cp, over = tcfg.cp, "dp x cp" if tcfg.cp > 1 else "dp"   # (--cp: ep drawn from dp x cp, moe.add_groups)
    where = (f"--ep {ep}: each rank holds E/ep = {E // ep} expert(s) of each sparse layer (weights, fp32 gradients and "
             f"Adam state: the experts' share / {ep}), summed over the ({over})/ep = {dp * cp // ep} ranks holding "
             f"the same ones"
             if ep > 1 else f"experts replicated on every {over} rank like the dense weights (ep 1)")
    return [f"  mixture of experts: {sparse} of {cfg.n_layers} layers sparse, {E} experts{shared}, top-{k}: "
            f"{fmt_count(cfg.num_params())} parameters in all, {fmt_count(active)} active per token "
            f"(its {k} experts{shared}, the router, the dense rest); {where}",
            "    (activations: what each sparse block keeps, memory.moe_layer_bytes, is counted for balanced routing; "
            "dropless, a router favouring some experts moves more rows to their ranks at --ep)"]


def memory_table(cfg: ModelConfig, tcfg: TrainConfig, dp: int, largest_only: bool = False
                 ) -> tuple[list[str], list[list], dict, int]:
    """The memory table of --plan: (header, a row of cells per stage shown (largest_only: the largest stage's
    alone), every stage's memory_per_rank, and the largest stage. The planner page (plan/page_data.py) shows
    the same cells."""
    pp = tcfg.pp
    eager = tcfg.device in ("cpu", "cuda")    # else plan for xla (trn1), also for --device auto
    mems = {s: memory_per_rank(cfg, tcfg, tcfg.tp, pp, dp, s, fused=eager, eager=eager) for s in range(pp)}
    largest = max(range(pp), key=lambda s: mems[s]["peak"])
    rows, staging = [], any(mems[s]["grad_staging"] for s in range(pp))   # (ZeRO-2's column)
    gathered = any(mems[s]["gathered"] for s in range(pp))                # (ZeRO-3's)
    transient = any(mems[s]["backward_transients"] for s in range(pp))    # (eager backends')
    for s in [largest] if largest_only else shown_stages(pp):
        r = mems[s]
        step = fmt_bytes(r["step_temporaries"])
        rows.append([s, stage_layer_text(cfg.n_layers, pp, s, tcfg.virtual_stages), fmt_count(r["params"]), fmt_bytes(r["weights"]),
                     fmt_bytes(r["grads"]), fmt_bytes(r["optimizer_replicated"]),
                     fmt_bytes(r["optimizer_zero1"]) if tcfg.ep == 1 else "- (--ep: no ZeRO)",
                     (f"{r['in_flight']} x " if tcfg.schedule != "zb-h1" else f"{r['in_flight']} mb: ")
                     + fmt_bytes(r["activations"] / (r["in_flight"] if tcfg.schedule != "zb-h1" else 1)),
                     fmt_bytes(r["flat_grads"]), fmt_bytes(r["loss_backward"])]
                    + ([fmt_bytes(r["backward_transients"])] if transient else [])
                    + ([fmt_bytes(r["grad_staging"])] if staging else [])
                    + ([fmt_bytes(r["gathered"])] if gathered else []) + [step, fmt_bytes(r["peak"])])
    header = (["stage", "layers", "params", "weights", "grads", "Adam", "Adam ZeRO-1", "activations",
               "fp32 grads", "loss bwd"] + (["transients"] if transient else [])
              + (["grad staging"] if staging else []) + (["gathered"] if gathered else [])
              + ["optimizer step", "peak"])
    return header, rows, mems, largest


def fits_lines(tcfg: TrainConfig, biggest: int, largest: int) -> dict[str, str]:
    """--plan's "does it fit" line for each device of --device whose memory is known, by device."""
    return {dev: f"  largest stage {largest}: {fmt_bytes(biggest)} of {fmt_bytes(DEVICE_MEMORY[dev])} on one {dev}: "
                 + ("fits" if biggest <= DEVICE_MEMORY[dev] else f"does NOT fit ({biggest / DEVICE_MEMORY[dev]:.1f}x)")
            for dev in PLAN_DEVICES[tcfg.device] if dev in DEVICE_MEMORY}


def _memory_section(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    tp, pp, m = tcfg.tp, tcfg.pp, tcfg.microbatches
    eager = tcfg.device in ("cpu", "cuda")    # else plan for xla (trn1), also for --device auto
    header, rows, mems, largest = memory_table(cfg, tcfg, dp)
    lines = ["", "parameters and memory per rank (every rank of a stage holds the same), assuming "
             + ("an eager backend (cpu/cuda): fused attention kernel, unfused AdamW" if eager else
                "xla (trn1): T*T attention scores kept, AdamW fused into one kernel; "
                "--device cpu or cuda for eager")]
    staging = any(mems[s]["grad_staging"] for s in range(pp))
    during = ({1: "ZeRO-1 shards and gathers", 2: "ZeRO-2 gathers"}.get(tcfg.zero),
              eager and "the grad norm's fp64 chunk or the in-place AdamW's temporaries, the larger")
    step_parts = " + ".join(x for x in during if x) or "nothing more"
    gathered = any(mems[s]["gathered"] for s in range(pp))                # (ZeRO-3's)
    transient = any(mems[s]["backward_transients"] for s in range(pp))    # (eager backends')
    lines += table(header, rows)
    lines.append(f"  peak = weights + grads + Adam ({f'ZeRO-{tcfg.zero}' if tcfg.zero else 'no ZeRO'}, as configured) + "
             f"fp32 gradient buffers + rotary tables, token ids" + (", the last exchange" if pp > 1 and eager else "")
             + (", the last step's gradient shards" if tcfg.zero == 1 and dp > 1 else "")
             + f" ({fmt_bytes(mems[largest]['fixed'])}) + the larger of "
             "(activations in flight + " + ("the backward's largest moment of: " if staging or gathered else "")
             + "loss backward"
             + (" + transients: a backward's own gradients" + (", the exchange's buffers" if pp > 1 else "")
                if transient else "")
             + (f", ZeRO-{tcfg.zero}'s grad staging" if staging else "")
             + (" and the layers gathered" if gathered else "")
             + (", as each layer's activations are freed; not the columns' sum" if staging or gathered else "")
             + ") and (optimizer step: " + step_parts + ")")
    lines.append(f"  peak: an upper bound of the allocator's peak on a rank, at most {PEAK_MARGIN:.0%} above it "
                 "(measured on the cpu for small layouts of every strategy, tests/plan/test_plan_peak_memory.py)"
                 if eager else "  peak: what the plan counts; on xla the compiler assigns the step's buffers, which the plan "
                 "does not model (the bound is measured on eager backends: --device cpu)")
    lines += fits_lines(tcfg, mems[largest]["peak"], largest).values()

    flight = mems[largest]["in_flight"]
    held = (f"{flight} chunk activations of {m} micro-batch(es), each 1/{tcfg.virtual_stages} of the stage,"
            if tcfg.virtual_stages > 1 else f"{flight} of {m} micro-batch(es)")
    lines += ["", f"activations per rank of stage {largest}, by checkpointing mode ({held} "
              f"of {micro_batch_size(tcfg, dp)} x {tcfg.seq_len // tcfg.cp} tokens in flight"
              + (f", 1/{tcfg.cp} of each sequence: context parallelism below" if tcfg.cp > 1 else "") + "):"]
    rows, sp_label = [], "on, re-gather" if tcfg.sp_regather else "on, kept"
    for mode in ("none", "selective", "full"):
        for sp in ((False, True) if tp > 1 else (False,)):
            kept = activation_bytes(cfg, tcfg, tp, pp, dp, largest, mode, sp, fused=False)
            fused = activation_bytes(cfg, tcfg, tp, pp, dp, largest, mode, sp, fused=True)
            this = (mode, sp) == (tcfg.activation_checkpointing, tcfg.sequence_parallel and tp > 1)
            rows.append([mode, sp_label if sp else "off", fmt_bytes(kept), fmt_bytes(flight * kept),
                         fmt_bytes(fused), fmt_bytes(flight * fused), "<- this run" if this else ""])
    lines += table(["checkpointing", "seq-parallel", "T*T kept: 1 mb", "in flight",
                 "fused attn: 1 mb", "in flight", ""], rows)
    lines.append("  'T*T kept': softmax probabilities stored (Korthikanti et al.; torch_xla's matmul+softmax); "
             "'fused': a flash/efficient SDPA kernel (cpu, cuda)")
    if tcfg.schedule == "zb-h1":
        lines.append(f"  zb-h1: 'in flight' counts each micro-batch whole; from its B to its W it keeps only its linears' "
                 f"inputs and output gradients, {fmt_bytes(weight_grad_bytes(cfg, tcfg, tp, pp, dp, largest))} "
                 f"(any checkpointing mode): {fmt_bytes(mems[largest]['activations'])} at most, walking its order")
    if tp > 1:
        lines.append("  " + ("'re-gather' (--sp-regather): the matmuls after each norm keep its T/tp output and "
                         "all-gather it again in backward" if tcfg.sp_regather else
                         "'kept' (--no-sp-regather): the matmuls after each norm keep the all-gathered sequence"))
    return lines


def cp_section(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    """`--plan` with --cp: the three algorithms side by side on this layout (memory, bytes,
    constraints), and the causal work per cp rank, zigzag against a contiguous split."""
    cp, tp, T = tcfg.cp, tcfg.tp, tcfg.seq_len
    if cp == 1:
        return []
    mb, t, e, mode = micro_batch_size(tcfg, dp), local_tokens(tcfg), dtype_bytes(tcfg.precision), tcfg.activation_checkpointing
    layers = cfg.n_layers // tcfg.pp
    rows = []
    for alg in ALGORITHMS:
        fits = alg != "ulysses" or ulysses_fits(cfg, tp, cp)
        calls = attention_collectives(cfg, mb, t, tp, cp, e, alg, mode)
        count = lambda when: sum(c for w, _, _, c in calls if w == when)
        moved = lambda when: fmt_bytes(sum(p * c for w, _, p, c in calls if w == when))
        acts = activation_bytes(cfg, dataclasses.replace(tcfg, cp_attention=alg), tp, tcfg.pp, dp, 0)
        rows.append([alg + (" <- this run" if alg == tcfg.cp_attention else ""),
                     fmt_bytes(attention_core_bytes(cfg, mb, t, tp, cp, e, alg)), fmt_bytes(acts),
                     f"{count('forward')} / {count('backward')}" + (f" + {count('replay')}" if count("replay") else ""),
                     moved("forward"), moved("backward") + (f" + {moved('replay')}" if count("replay") else ""),
                     {"allgather": "-", "ring": "-"}.get(alg) or (
                         f"heads {cfg.n_heads // tp}, kv heads {cfg.kv_heads_per_rank(tp)} per tp rank divisible by "
                         f"cp {cp}: " + ("yes" if fits else "NO"))])
    H, K = cfg.n_heads // tp, cfg.kv_heads_per_rank(tp)
    lines = ["", f"context parallelism: cp {cp}, each rank {t:,} of a sequence's {T:,} tokens (zigzag: chunks i and "
             f"{2 * cp - 1}-i of {2 * cp}); attention on one rank, per layer and micro-batch ({mb} x {t:,} tokens, "
             f"{H} heads, {K} kv heads of dim {cfg.head_dim} per tp rank):"]
    lines += table(["algorithm", "attention keeps (no ckpt)", f"stage 0 activations, 1 mb ({mode})",
                    "calls fwd / bwd (+ replay)", "bytes fwd", "bytes bwd (+ replay)", "constraint"], rows)
    lines += ["  allgather: all-gather [K; V] (every rank's T tokens of K/V held, kv heads not repeated), backward "
              "reduce-scatter of dK/dV; ring: n-1 shifts of [K; V] forward, n-1 of [K; V] and n of the fp32 dK/dV "
              "backward (3n-2; two K/V blocks in flight); ulysses: all-to-all sequence -> heads and back, forward "
              "and backward (4; T tokens x heads/cp)",
              f"  'replay': activation checkpointing ({mode}) repeats the forward's exchanges in backward"
              if mode != "none" else "  (with selective or full checkpointing the forward's exchanges are replayed "
              "in backward)",
              "  'attention keeps': q, k, v (allgather: the whole sequence's k, v), the fp32 output and its "
              "log-sum-exp; no mask, no T*T scores: every algorithm computes its causal pairs only, by (query chunk, "
              "key chunk) pairs, in fp32 (on the CPU torch's fused kernel; elsewhere two matmuls and a softmax)"]
    shown = list(range(cp)) if cp <= 16 else list(range(4)) + list(range(cp - 4, cp))
    zig, cont = attention_pairs(T, cp, "zigzag"), attention_pairs(T, cp, "contiguous")
    spread = lambda xs: max(xs) / min(xs) - 1
    lines += ["", f"causal attention work per cp rank, one sequence, one layer, one tp rank (pairs: the (query, key) "
              f"pairs its queries attend to; FLOPs: 12 x dim x heads a pair, forward and backward):"]
    lines += table(["cp rank", "zigzag pairs", "zigzag FLOPs", "contiguous pairs", "contiguous FLOPs"],
                   [[r, f"{zig[r]:,}", fmt_flop(attention_flops(cfg, zig[r], tp)), f"{cont[r]:,}",
                     fmt_flop(attention_flops(cfg, cont[r], tp))] for r in shown])
    lines.append(f"  max/min - 1 across the ranks: zigzag {spread(zig):.1%}, contiguous {spread(cont):.1%} (its last "
                 f"rank {cont[-1] / cont[0]:.1f}x the first's: the others wait for it every layer)")
    return lines


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
        entry = entries.get(k, zero) if k != "total" else {f: sum(v[f] for v in entries.values()) for f in comm.FIGURES}
        row = [k, f"{entry['calls']:,}" if k != "total" else "", f"{entry['payload']:,}", f"{entry['wire']:,}", f"{entry['padding']:,}"]
        if predicted is not None and k != "total":
            p = predicted.get(k, zero)
            row.append("same" if p == entry else "predicted: " + " ".join(f"{f} {p[f]:,}" for f in comm.FIGURES))
        elif predicted is not None:
            row.append("")
        rows.append(row)
    header = ["collective", "calls", "payload", "wire", "padding"] + (["plan"] if predicted is not None else [])
    return table(header, rows)


def comm_report(cfg: ModelConfig, tcfg: TrainConfig, mesh, measured: dict) -> str:
    """A run's comm ledger of its first step on this rank (`measured`), beside the plan's formula."""
    if not measured:
        return "communication: none (one process)"
    if cfg.moe_experts:   # the all-to-alls' rows follow the routing: the ledger alone
        lines = [f"communication per step on rank {mesh.rank}: the comm ledger (a mixture's; --plan predicts it, "
                 f"with --ep its all-to-alls for balanced routing)"]
        return "\n".join(lines + comm_table(measured))
    predicted = comm_per_step(cfg, tcfg, mesh)
    lines = [f"communication per step on rank {mesh.rank}: the comm ledger, and the plan's prediction"]
    return "\n".join(lines + comm_table(measured, predicted) + [COMM_LEGEND_SHORT])


def _comm_section(cfg: ModelConfig, tcfg: TrainConfig, dp: int) -> list[str]:
    tp, pp = tcfg.tp, tcfg.pp
    cp = tcfg.cp
    lines = ["", "communication per step, bytes on one rank"] + COMM_LEGEND
    first = {s: rank_of(0, s, 0, tp, dp * cp) for s in range(pp)}   # (cp rank 0 of the stage: its tp 0, dp 0)
    by_stage = {s: comm_per_step(cfg, tcfg, mesh_at(tp, pp, dp, first[s], cp)) for s in range(pp)}
    if not by_stage[0]:
        return lines + ["  none: one process"]
    for s in sorted({0, pp - 1}):
        lines.append(f"  rank {first[s]} (stage {s}):")
        lines += comm_table(by_stage[s])
    everyone = sum(entry["wire"] + entry["padding"] for c in by_stage.values() for entry in c.values()) * tp * dp * cp
    lines.append(f"  all {tp * pp * dp * cp} ranks together: {fmt_bytes(everyone)} on the wire per step (padding included)")
    # the tokens a rank routes per micro-batch: with --cp its T/cp share, with sequence parallelism T/tp of that (moe.py)
    N = micro_batch_size(tcfg, dp) * local_tokens(tcfg) // (tp if tcfg.sequence_parallel and tp > 1 else 1)
    if cp > 1 and cfg.moe_experts:
        mb = micro_batch_size(tcfg, dp)
        lines.append(f"  cp.all_reduce: per sparse layer and micro-batch 3 calls, the router's per-sequence sums over "
                     f"this rank's {N // mb} tokens of each sequence (f and P, {mb} x {cfg.moe_experts} fp32 each, "
                     f"and z) added up over the cp ranks"
                     + ("; full checkpointing replays them" if tcfg.activation_checkpointing == "full" else ""))
    if tcfg.ep > 1 and cfg.moe_capacity_factor:
        from nanohlat.beyond import moe   # (a mixture of experts only)
        E = cfg.moe_experts
        C = moe.capacity(N, cfg.moe_top_k, E, cfg.moe_capacity_factor)
        lines.append(f"  ep.all_to_all: per sparse layer and micro-batch 4 calls, each {E} experts' queues of "
                     f"capacity {C} (ceil({cfg.moe_capacity_factor} x {N} tokens x top-{cfg.moe_top_k} / {E})) = "
                     f"{E * C} rows of d_model {cfg.d_model}, whatever the routing (capacity mode: static shapes, "
                     f"no counts): the queues to the experts' ranks, the outputs back, and both gradients"
                     + ("; full checkpointing replays the 2 forward ones" if tcfg.activation_checkpointing == "full"
                        else ""))
    elif tcfg.ep > 1:
        lines.append(f"  ep.all_to_all: per sparse layer and micro-batch 5 calls: the counts ({cfg.moe_experts // tcfg.ep} "
                     f"int64 to each of the {tcfg.ep} ranks), the dispatch ({N} tokens x top-{cfg.moe_top_k} = "
                     f"{N * cfg.moe_top_k} rows of d_model {cfg.d_model}) and the return trip's gradient (as many "
                     f"rows), the return trip and the dispatch's gradient (the rows this rank received: PREDICTED "
                     f"FOR BALANCED ROUTING, {N * cfg.moe_top_k}, 1/{tcfg.ep} of them from itself; a real router "
                     f"moves more to some ranks, less to others, the same summed over the ep group)"
                     + ("; full checkpointing replays the 3 forward ones" if tcfg.activation_checkpointing == "full"
                        else ""))
    if tcfg.activation_checkpointing == "full" and tp > 1:
        lines.append("  full checkpointing replays 3 of a block's 4 forward tp collectives with torch's checkpoint, "
                 "all 4 with torch_xla's (--device xla)")
    return lines
def time_devices(tcfg: TrainConfig) -> list[str]:
    """The devices of --plan's time table: --device's, and on xla (or auto) trn1n's too."""
    return list(PLAN_DEVICES[tcfg.device]) + (["NeuronCore-v2 (trn1n)"] if tcfg.device in ("xla", "auto") else [])


def time_header(tcfg: TrainConfig) -> list[str]:
    return (["device", "peak", "compute", "tp comm", "pp exchange", "dp comm"]
            + (["ep all-to-all"] if tcfg.ep > 1 else []) + (["cp attention"] if tcfg.cp > 1 else [])
            + ["bubble", "step", "tokens/s", "MFU", "step, dp overlapped", f"{tcfg.steps:,} steps"])


def time_row(cfg: ModelConfig, tcfg: TrainConfig, world: int, dev: str) -> list[str]:
    """One device's row of --plan's time table (time_header's cells); the planner page shows the same."""
    est = estimate_step(cfg, tcfg, world, dev)
    sizes = {"tp": tcfg.tp, "pp": tcfg.pp, "dp": world // (tcfg.tp * tcfg.pp), "ep": tcfg.ep, "cp": tcfg.cp}
    comm_cells = [f"{fmt_seconds(est['comm'][g])} ({_where(est, g)})" if sizes[g] > 1 else "-"
                  for g in ("tp", "pp", "dp") + (("ep",) if tcfg.ep > 1 else ()) + (("cp",) if tcfg.cp > 1 else ())]
    return ([dev, fmt_flop(est["peak"], "FLOP/s"), fmt_seconds(est["compute"])] + comm_cells
            + [fmt_seconds(est["bubble"]) if tcfg.pp > 1 else "-", fmt_seconds(est["step"]),
               f"{est['tokens_per_s']:,.0f}", f"{est['mfu']:.0%}", fmt_seconds(est["step_overlapped"]),
               fmt_seconds(est["step"] * tcfg.steps)])


def _time_section(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> list[str]:
    tokens = tcfg.batch_size * tcfg.seq_len
    f_tok = flops_per_token(cfg, tcfg.seq_len)
    active = " (active: the k experts a token uses)" if cfg.moe_experts else ""
    lines = ["", f"compute: {fmt_flop(f_tok)} per token (6 x matmul params{active} + 12 x layers x d_model x seq_len, "
             f"metrics.flops_per_token) x {tokens:,} tokens = {fmt_flop(f_tok * tokens)} per step, "
             f"{fmt_flop(f_tok * tokens / world)} per rank",
         "", "estimated time per step (rank 0's groups; the slower of the first and last stage)"]
    devices = time_devices(tcfg)
    lines += table(time_header(tcfg), [time_row(cfg, tcfg, world, dev) for dev in devices])
    net_notes = list(dict.fromkeys(NETWORKS[d].note for d in devices))
    lines += ["  assumptions:",
          f"  - the matmuls run at {DEFAULT_MFU:.0%} of the device's peak, recomputation included (activation "
          f"checkpointing {tcfg.activation_checkpointing}: "
          f"+{recompute_flops_per_token(cfg, tcfg.seq_len, tcfg.activation_checkpointing) / f_tok:.0%} FLOPs); "
          f"MFU counts the model's FLOPs only" + (" (of a mixture: on its active parameters)" if cfg.moe_experts else "")
          + ("; ep all-to-all: per micro-batch, between the matmuls; dp comm includes the experts' gradient "
             "sum over ep_dp" if tcfg.ep > 1 else "")
          + ("; cp attention: the cp group's exchanges, per micro-batch, as if none overlapped the arithmetic "
             "(the ring's do overlap its blocks' in the code); dp comm: the gradients' sum over dp x cp"
             if tcfg.cp > 1 else ""),
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
    if tcfg.fp8 != "none":   # what FP8's rate makes of the arithmetic on each device (plan/fp8_costs.py)
        from nanohlat.plan import fp8_costs as fp8_plan
        lines += fp8_plan.plan_lines(cfg, tcfg, devices)
    return lines + _dp_ring_section(cfg, tcfg, world, devices)


def _where(est: dict, group: str) -> str:
    """'in', 'across' or (a dp ring with hops of both kinds) 'mixed'."""
    if group == "dp" and est["dp_ring"].on_node and est["dp_ring"].off_node:
        return "mixed"
    return "in" if est["inside"][group] else "across"


def _dp_ring_section(cfg: ModelConfig, tcfg: TrainConfig, world: int, devices: list[str]) -> list[str]:
    """"where the dp bytes go": rank 0's dp ring, hop by hop, on each device's network."""
    tp, pp = tcfg.tp, tcfg.pp
    dp = world // (tp * pp)   # (--cp: the gradients' ring is dp x cp ranks, as a cp-1 mesh's dp group of that size)
    if dp == 1:
        return []
    ranks = dp_groups(tp, pp, dp)[0]
    shown = " -> ".join(map(str, ranks[:4])) + (" -> ... -> " + str(ranks[-1]) if dp > 4 else "") + f" -> {ranks[0]}"
    lines = ["", f"where the dp bytes go: rank 0's {'dp x cp' if tcfg.cp > 1 else 'dp'} ring {shown} ({dp} hops); "
             f"{tp * pp} such rings reduce at once, one per (stage, tp rank)"]
    rows = []
    for dev in devices:
        est = estimate_step(cfg, tcfg, world, dev)
        r, b = est["dp_ring"], est["dp_bytes"]
        net = est["network"]
        rows.append([dev, r.ranks_per_node, r.on_node, r.off_node, r.sharing if r.off_node else "-",
                     f"{r.off_node_bw / 1e9:.3g} GB/s" if r.off_node else "-", fmt_bytes(b),
                     fmt_seconds(b / net.inside) if r.on_node else "-",
                     fmt_seconds(b / r.off_node_bw) if r.off_node else "-", fmt_seconds(est["comm"]["dp"])])
    lines += table(["device", "ring ranks per node", "hops on node", "off node", "hops leaving a node at once",
                 "off-node hop gets", "bytes per hop", "on-node hop", "off-node hop", "dp comm"], rows)
    lines += ["  every hop carries the same bytes (each rank's wire bytes of the dp collectives); the ring moves at "
          "its slowest hop's pace, so dp comm = bytes / the slowest hop + calls x latency. An off-node hop gets "
          "the node's network divided by the hops that leave that node at the same time (all rings together)"]
    return lines
