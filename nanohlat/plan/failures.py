"""Failures at scale: what a checkpoint costs, how often the cluster fails, and the
checkpoint interval that loses the least (`train.py --plan`, `--save-every auto`).

A synchronous save stops every rank for the time the slowest node takes to
write its shards, `save`; a failure throws away the work since the last
complete checkpoint, on average half an interval, and the cluster fails
every `MTBF` seconds on average (one node's MTBF / the nodes). With an interval of
`tau` seconds of training between saves the fraction of time lost is, to
first order (Young 1974; Daly 2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps"):

    lost(tau) = save / tau  +  tau / (2 x MTBF)
                (saving)       (work redone after a failure)

The first term falls with tau, the second grows; their sum is least where its
derivative -save / tau^2 + 1 / (2 x MTBF) is zero:

    tau* = sqrt(2 x save x MTBF),    lost(tau*) = sqrt(2 x save / MTBF)

(the two terms are equal there). Restarting itself (finding the failure,
starting the processes, loading the checkpoint) costs the same whatever the
interval, so it is not in the optimum; the fault lab measures it
(classroom/fault_lab.py). Daly's higher-order terms matter only when save is not
small next to MTBF; nanohlat prints the first-order figure and says which.

With --async-save (run/checkpoint/background.py) the steps stall only for the
snapshot (a copy of the rank's shard to host memory, `stall`), and the
checkpoint is complete `save` seconds later, while training goes on. A
failure in that window finds the previous checkpoint the newest complete one,
so a failure loses tau/2 + save on average, and

    lost(tau) = stall / tau + (tau / 2 + save) / MTBF,    tau* = sqrt(2 x stall x MTBF),

but at least `save` (one save in flight at a time: a shorter interval waits).
The snapshot is held in host memory while it is written: `snapshot_bytes`,
which the pre-flight adds to a CPU run's memory check.

What a checkpoint holds (run/checkpoint/saving.py), per parameter element,
each written once: its weight in the parameters' dtype (by the first dp
replica), the fp32 master weight and Adam's two moments in their dtype (by
the first replica, or with ZeRO each dp rank its 1/dp). Without ZeRO the
optimizer state is written by dp rank 0's ranks alone: the node that holds
them writes the whole checkpoint of their stages.
"""

from __future__ import annotations

import dataclasses
import math

from nanohlat.mesh import coords
from nanohlat.precision import param_dtype
from nanohlat.recipe import MTBF_HOURS_PER_NODE, SAVE_EVERY_AUTO, ModelConfig, TrainConfig
from nanohlat.plan.fmt import fmt_bytes, fmt_seconds, table
from nanohlat.plan.hardware import NETWORKS, PLAN_DEVICES
from nanohlat.plan.params import stage_param_counts
from nanohlat.plan.step_time import estimate_step

# The snapshot of --async-save: each rank's shard copied to host memory. On the CPU a memory copy; from an
# accelerator over PCIe. 10 GB/s per device is an ASSUMPTION (PCIe 4 x16 moves ~25 GB/s, shared by the
# devices behind one switch); a run with --async-save prints what its snapshots took.
HOST_COPY_GB_S = 10.0
# --save-every auto on a run: the device of the plan whose step time and node size it uses
RUN_DEVICE = {"cpu": "cpu", "cuda": "H100", "xla": "NeuronCore-v2"}
SOURCE = ("Llama 3's: 419 unexpected interruptions in 54 days on 2,048 nodes of 8 H100s, Dubey et al. 2024, "
          "section 3.3.4")


# ---------------------------------------------------------------------------
# The formula
# ---------------------------------------------------------------------------

def optimal_interval(save_s: float, mtbf_s: float) -> float:
    """Young's interval: the seconds of training between two saves that lose the least time, for a
    save that stalls `save_s` seconds and a cluster failing every `mtbf_s` seconds on average."""
    return math.sqrt(2 * save_s * mtbf_s)


def lost_fraction(interval_s: float, save_s: float, mtbf_s: float, durable_after_s: float = 0.0) -> float:
    """The fraction of time lost, to first order: saving (save_s every interval_s) and redoing the work
    since the last complete checkpoint after each failure (interval_s / 2 on average, plus
    `durable_after_s` when a checkpoint is complete only that long after its step: --async-save)."""
    return save_s / interval_s + (interval_s / 2 + durable_after_s) / mtbf_s


# ---------------------------------------------------------------------------
# What a checkpoint is made of
# ---------------------------------------------------------------------------

def _bytes_per_element(tcfg: TrainConfig) -> tuple[int, int]:
    """(weight, optimizer) bytes a checkpoint holds per parameter element: the weight in the parameters'
    dtype; the master weight, always as fp32 (export_state), and the two moments in theirs."""
    moment = 2 if tcfg.moments == "bf16" else 4
    return param_dtype(tcfg.precision).itemsize, 4 + 2 * moment


def rank_elements(cfg: ModelConfig, tcfg: TrainConfig, stage: int, tp_rank: int) -> int:
    """Parameter elements a (stage, tp rank) saves: its tp part of every tensor, but a tensor several tp
    ranks hold alike only by the first of them (norm gains, the routers: tp rank 0; a kv head shared
    by a kv group: its first rank; saving._first_copy)."""
    tp = tcfg.tp
    c = stage_param_counts(cfg, tp, tcfg.pp, stage, tcfg.ep, tcfg.virtual_stages)
    copies = tp // cfg.n_kv_heads if tp > cfg.n_kv_heads else 1
    own = c["sharded"] - c["kv"] + (c["kv"] if tp_rank % copies == 0 else 0) + c["experts"]
    return own + (c["replicated"] + c["moe"] if tp_rank == 0 else 0)


def rank_bytes(cfg: ModelConfig, tcfg: TrainConfig, world: int, rank: int) -> int:
    """The bytes of rank `rank`'s shard (saving.save): its weights if it is the first of its dp (x cp)
    replicas, its optimizer state then too, or with ZeRO its 1/(dp x cp) of it on every replica."""
    tp, pp, cp = tcfg.tp, tcfg.pp, tcfg.cp
    dp = world // (tp * pp * cp)
    d, stage, inner = coords(rank, tp * cp, pp, dp)   # (cp, tp) as one inner coordinate (layout_table)
    c, t = divmod(inner, tp)
    elements = rank_elements(cfg, tcfg, stage, t)
    weight, state = _bytes_per_element(tcfg)
    first = d == 0 and c == 0
    return elements * weight * first + (-(-elements * state // (dp * cp)) if tcfg.zero else elements * state * first)


def checkpoint_bytes(cfg: ModelConfig, tcfg: TrainConfig) -> dict:
    """The whole checkpoint: every parameter element once, {"weights", "optimizer", "total"} in bytes."""
    weight, state = _bytes_per_element(tcfg)
    n = cfg.num_params()
    return {"weights": n * weight, "optimizer": n * state, "total": n * (weight + state)}


def node_bytes(cfg: ModelConfig, tcfg: TrainConfig, world: int, per_node: int) -> tuple[int, int, int]:
    """(bytes, node, ranks that write) of the node that writes the most. Ranks fill nodes in order; the
    nodes of dp rank 0 (its first rank in each stage) write the most, so only those are summed."""
    if per_node >= world:   # one node: the whole checkpoint, from every rank with ZeRO, else from dp rank 0's
        return checkpoint_bytes(cfg, tcfg)["total"], 0, world if tcfg.zero else tcfg.tp * tcfg.pp
    dp = world // (tcfg.tp * tcfg.pp * tcfg.cp)
    best = (0, 0, 0)
    for stage in range(tcfg.pp) if tcfg.pp <= 64 else (0, tcfg.pp - 1):
        node = stage * dp * tcfg.cp * tcfg.tp // per_node   # the node of (dp 0, this stage, tp 0)
        sizes = [rank_bytes(cfg, tcfg, world, r) for r in range(node * per_node, min(world, (node + 1) * per_node))]
        best = max(best, (sum(sizes), node, sum(1 for s in sizes if s)))
    return best


def snapshot_bytes(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> int:
    """Host memory one rank's --async-save snapshot holds at most: the largest rank's shard (rank 0's)."""
    return rank_bytes(cfg, tcfg, world, 0) if tcfg.async_save else 0


# ---------------------------------------------------------------------------
# The interval, for a device
# ---------------------------------------------------------------------------

def interval_plan(cfg: ModelConfig, tcfg: TrainConfig, world: int, device: str) -> dict:
    """For `device` (a plan device: its node size, its step time): nodes, the cluster's MTBF, the save time,
    Young's interval in seconds and steps, and the fraction of time lost at --save-every and at the optimum."""
    per_node = NETWORKS[device].per_node
    nodes = -(-world // per_node)
    written, node, writers = node_bytes(cfg, tcfg, world, per_node)
    save = written / (tcfg.storage_gb_s * 1e9)
    mtbf = tcfg.mtbf_hours * 3600 / nodes
    step = estimate_step(cfg, tcfg, world, device)["step"]
    stall = rank_bytes(cfg, tcfg, world, 0) / (HOST_COPY_GB_S * 1e9) if tcfg.async_save else save
    after = save if tcfg.async_save else 0.0          # a checkpoint is complete this long after its step
    best = optimal_interval(stall, mtbf)
    if tcfg.async_save:
        best = max(best, save)                        # one save in flight at a time
    best_steps = max(1, round(best / step))
    chosen = tcfg.save_every if tcfg.save_every != SAVE_EVERY_AUTO else best_steps
    return {"device": device, "nodes": nodes, "per_node": per_node, "node": node, "writers": writers,
            "node_bytes": written, "save": save, "stall": stall, "mtbf": mtbf, "step": step,
            "optimal_s": best, "optimal_steps": best_steps, "chosen": chosen,
            "lost_chosen": lost_fraction(chosen * step, stall, mtbf, after) if chosen else None,
            "lost_optimal": lost_fraction(best_steps * step, stall, mtbf, after)}


def resolve_save_every(cfg: ModelConfig, tcfg: TrainConfig, world: int, kind: str) -> tuple[TrainConfig, str]:
    """--save-every auto made a number for a run on device `kind` (cpu, cuda, xla): Young's interval in
    steps (interval_plan). Returns the config and the line that says it ("" when not auto)."""
    if tcfg.save_every != SAVE_EVERY_AUTO:
        return tcfg, ""
    p = interval_plan(cfg, tcfg, world, RUN_DEVICE.get(kind, "cpu"))
    note = (f"--save-every auto: every {p['optimal_steps']:,} steps = sqrt(2 x {fmt_seconds(p['stall'])} "
            f"{'stall' if tcfg.async_save else 'save'} x {p['mtbf'] / 3600:,.1f} h MTBF) / {fmt_seconds(p['step'])} "
            f"per step (planned for {p['device']}, {p['nodes']} node(s); plan/failures.py)")
    return dataclasses.replace(tcfg, save_every=p["optimal_steps"]), note


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.3g}%"


def failures_section(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> list[str]:
    """`--plan`: the checkpoint, the cluster's failures, the interval that loses least, per device."""
    total = checkpoint_bytes(cfg, tcfg)
    weight, state = _bytes_per_element(tcfg)
    dp = world // (tcfg.tp * tcfg.pp * tcfg.cp)
    who = (f"with ZeRO every dp rank writes its 1/{dp * tcfg.cp} of the optimizer state" if tcfg.zero else
           "without ZeRO dp rank 0's ranks write the optimizer state too")
    lines = ["", "failures and the checkpoint interval (plan/failures.py; Young 1974, first order)",
             f"  a checkpoint: {fmt_bytes(total['total'])} = weights {fmt_bytes(total['weights'])} ({weight} B each) + "
             f"master weights and Adam's moments {fmt_bytes(total['optimizer'])} ({state} B each), each parameter "
             f"written once; rank 0 writes {fmt_bytes(rank_bytes(cfg, tcfg, world, 0))} (dp rank 0's ranks write the "
             f"weights; {who})",
             f"  one node fails every {tcfg.mtbf_hours:,.0f} h on average (--mtbf-hours"
             + (f"; the default is {SOURCE}" if tcfg.mtbf_hours == MTBF_HOURS_PER_NODE else "")
             + f"); a node writes at {tcfg.storage_gb_s:g} GB/s (--storage-gb-s)"]
    rows = []
    chosen = "auto" if tcfg.save_every == SAVE_EVERY_AUTO else f"{tcfg.save_every:,}"
    stall = "stall (snapshot)" if tcfg.async_save else "save"
    for dev in PLAN_DEVICES[tcfg.device]:
        p = interval_plan(cfg, tcfg, world, dev)
        rows.append([dev, f"{p['nodes']:,}", f"{p['mtbf'] / 3600:,.1f} h",
                     f"{fmt_bytes(p['node_bytes'])} ({p['writers']} rank{'s' if p['writers'] > 1 else ''})",
                     fmt_seconds(p["save"])]
                    + ([fmt_seconds(p["stall"])] if tcfg.async_save else [])
                    + [fmt_seconds(p["step"]), f"{fmt_seconds(p['optimal_s'])} = {p['optimal_steps']:,} steps",
                       _pct(p["lost_chosen"]) if tcfg.save_every else "-", _pct(p["lost_optimal"])])
    lines += table(["device", "nodes", "cluster MTBF", "the node writing most", "save"]
                   + (["stall"] if tcfg.async_save else [])
                   + ["step", f"optimal interval sqrt(2 x {stall} x MTBF)", f"lost at --save-every {chosen}",
                      "lost at the optimum"], rows)
    lines += [f"  cluster MTBF = {tcfg.mtbf_hours:,.0f} h / nodes; save = the bytes of the node writing most / "
              f"{tcfg.storage_gb_s:g} GB/s, all nodes at once; lost = {stall} / interval + "
              + ("(interval / 2 + save) / MTBF: a checkpoint is complete a save after its snapshot"
                 if tcfg.async_save else "interval / 2 / MTBF (the work redone after a failure)")
              + "; restarts cost the same at any interval and are not counted"]
    if tcfg.async_save:
        lines.append(f"  --async-save: each rank holds its shard in host memory while it is written, at most "
                     f"{fmt_bytes(snapshot_bytes(cfg, tcfg, world))} (rank 0's; a node, its ranks' shards: the node "
                     f"writing most holds the column's bytes); its snapshot is a copy at "
                     f"{HOST_COPY_GB_S:g} GB/s (an ASSUMPTION: PCIe); the interval is at least one save "
                     f"(one save in flight at a time)")
    else:
        lines.append("  --async-save would stall the steps only for a copy to host memory, holding that copy "
                     "while the node writes it")
    return lines
