"""Time: compute, communication and the bubble -> an estimated step, on a
device and its network (hardware.py), at a stated share of the device's peak."""

from __future__ import annotations

from nanohlat import comm
from nanohlat.recipe import ModelConfig, TrainConfig
from nanohlat.mesh import kv_replicas, rank_of
from nanohlat.tools.metrics import flops_per_token, peak_flops
from nanohlat.plan.communication import comm_per_step
from nanohlat.plan.params import mesh_at
from nanohlat.plan.hardware import NETWORKS, Network, dp_ring, group_inside_node


DEFAULT_MFU = 0.40


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
    """Seconds per step on `device`, part by part, for the layout in `tcfg` (see
    `_time_section` for the assumptions). Slowest of the first and last stage."""
    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp
    dp = world // (tp * pp * cp)
    m = tcfg.microbatches
    net = network or NETWORKS[device]
    threads = max(1, tcfg.threads) if device == "cpu" else None
    peak = peak_flops(device.split(" ")[0], tcfg.precision, threads)
    tokens = tcfg.batch_size * tcfg.seq_len
    model_flops = flops_per_token(cfg, tcfg.seq_len) * tokens
    hardware_flops = model_flops + recompute_flops_per_token(cfg, tcfg.seq_len, tcfg.activation_checkpointing) * tokens
    compute = hardware_flops / world / (peak * utilisation)
    fp8_ratio = None
    if tcfg.fp8 != "none":   # --fp8: the linears at the device's FP8 rate, where it has one (plan/fp8_costs.py)
        from nanohlat.plan import fp8_costs as fp8_plan
        fp8_ratio = fp8_plan.time_ratio(cfg, tcfg, device.split(" ")[0], threads)
        compute *= fp8_ratio or 1.0
    # rank 0's groups; with --cp the gradients' group is dp x cp, ranks tp apart like a cp-1 mesh's dp group
    # of dp x cp ranks (context_parallel.ContextMesh), and the cp group's ranks are tp apart
    groups = {"tp": [rank_of(0, 0, r, tp, dp) for r in range(tp)],
              "dp": [rank_of(d, 0, 0, tp, dp * cp) for d in range(dp * cp)],
              "pp": [rank_of(0, s, 0, tp, dp * cp) for s in range(min(pp, 2))],
              "kv": [rank_of(0, 0, r, tp, dp) for r in range(kv_replicas(cfg, tp))]}   # copies of one kv head
    if cp > 1:
        groups["cp"] = [c * tp for c in range(cp)]
    if tcfg.ep > 1:   # a mixture's experts: the ranks sharing them, and those holding the same ones, both
        # drawn from the gradients' dp (x cp) group above (moe.add_groups: runs of it, cp neighbours first)
        groups.update(ep=groups["dp"][:tcfg.ep], ep_dp=groups["dp"][::tcfg.ep])
    inside = {g: group_inside_node(r, net.per_node) for g, r in groups.items()}
    ring = dp_ring(tp, pp, dp * cp, net)
    links = {g: (net.inside, net.latency_inside) if inside[g] else (net.across, net.latency_across) for g in groups}
    links["dp"] = (ring.bandwidth, ring.latency)     # the dp ring goes at its slowest hop's pace
    if tcfg.ep > 1:   # the ep_dp rings, ranks tp x ep apart, all running at once: walked hop by hop like dp's
        ep_ring = dp_ring(tp * tcfg.ep, pp, dp * cp // tcfg.ep, net)
        links["ep_dp"] = (ep_ring.bandwidth, ep_ring.latency)
    comm_s = dict.fromkeys(groups, 0.0)
    dp_wire, grad_s = 0, 0.0
    for stage in sorted({0, pp - 1}):
        per = dict.fromkeys(groups, 0.0)
        entries = comm_per_step(cfg, tcfg, mesh_at(tp, pp, dp, rank_of(0, stage, 0, tp, dp * cp), cp))
        entries = {k.replace("dp_cp.", "dp."): v for k, v in entries.items()}   # (--cp: the gradients' dp x cp group)
        dp_wire = max(dp_wire, sum(entry["wire"] + entry["padding"] for k, entry in entries.items() if k.startswith("dp.")))
        for key, entry in entries.items():
            g = key.split(".")[0]
            bw, lat = links[g]
            per[g] += (entry["wire"] + entry["padding"]) / bw + entry["calls"] * lat   # nanohlat sends the padding too
        bw, lat = links["dp"]   # the gradients' dp collective, the one --overlap-grad-reduce starts in backward
        entry = entries.get("dp.reduce_scatter" if tcfg.zero else "dp.all_reduce")
        loss = 0 if tcfg.zero else 1                       # (ZeRO-0: the loss's all-reduce, after the backward)
        grad_s = max(grad_s, ((entry["wire"] - loss * comm.wire_bytes("all_reduce", dp * cp, 4)) / bw
                              + (entry["calls"] - loss) * lat) if entry else 0.0)
        comm_s = {g: max(comm_s[g], per[g]) for g in groups}
    comm_s["tp"] += comm_s.pop("kv")   # the kv-head gradient sum, once per step: counted like the norm gains' tp one
    comm_s["dp"] += comm_s.pop("ep_dp", 0.0)   # --ep: the experts' gradient sum, after the backward like the dense one
    # each micro-batch's forward + backward, with its tp collectives, pp exchanges (and --ep all-to-alls)
    # (--cp: the cp group's attention exchanges too, counted as not overlapped with the arithmetic)
    per_microbatch = (compute + comm_s["tp"] + comm_s["pp"] + comm_s.get("ep", 0.0) + comm_s.get("cp", 0.0)) / m
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
            "mfu": model_flops / (step * world * peak), "fp8_ratio": fp8_ratio}
