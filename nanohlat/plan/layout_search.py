"""`--plan --search`: every layout that fits, fastest first, and where the
preset's own layout ranks among them."""

from __future__ import annotations

import dataclasses
import math
import textwrap

from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig, TrainConfig, divisors
from nanohlat.plan.fmt import fmt_bytes, fmt_count, fmt_seconds, table
from nanohlat.plan.hardware import DEVICE_MEMORY, NETWORKS
from nanohlat.plan.context import ALGORITHMS, ulysses_fits
from nanohlat.plan.memory import memory_per_rank
from nanohlat.plan.sheets import schedule_text, validate_plan_layout
from nanohlat.plan.step_time import DEFAULT_MFU, estimate_step


SEARCH_DEVICE = {"xla": "NeuronCore-v2", "auto": "NeuronCore-v2", "cuda": "H100", "cpu": "cpu"}


# Context parallelism is for long sequences: the search tries cp > 1 from this --seq-len on (or when
# --cp is given), and only while each rank keeps at least CP_MIN_TOKENS tokens of a sequence.
CP_SEARCH_FROM, CP_MIN_TOKENS = 8192, 1024


def cp_choices(cfg: ModelConfig, tcfg: TrainConfig, tp: int, ranks: int) -> list[tuple[int, str]]:
    """(cp, attention algorithm) pairs for `ranks` = world / (tp * pp): cp 1, and (long sequences, above)
    every cp dividing them whose 2 x cp chunks split --seq-len, with each of allgather, ring and ulysses
    (where its heads divide: context.py)."""
    out = [(1, tcfg.cp_attention)]
    if tcfg.seq_len < CP_SEARCH_FROM and tcfg.cp == 1:
        return out
    for cp in divisors(math.gcd(ranks, tcfg.seq_len // 2))[1:]:   # (2 x cp chunks split --seq-len)
        if tcfg.seq_len % (2 * cp) == 0 and tcfg.seq_len // cp >= min(CP_MIN_TOKENS, tcfg.seq_len // tcfg.cp):
            out += [(cp, a) for a in ALGORITHMS if a != "ulysses" or ulysses_fits(cfg, tp, cp)]
    return out


def ep_choices(cfg: ModelConfig, dp: int) -> list[int]:
    """--ep degrees to try at this dp (with --cp, dp x cp: the ranks expert parallelism draws from,
    moe.add_groups): for a mixture of experts every ep dividing both it and the experts
    (recipe.check_layout); a dense model has none to spread (ep 1)."""
    return divisors(math.gcd(dp, cfg.moe_experts)) if cfg.moe_experts else [1]


def candidate_layouts(cfg: ModelConfig, tcfg: TrainConfig, world: int):
    """Every valid (tp, pp, cp and its attention, dp, micro-batches, ZeRO stage, sequence parallel,
    checkpointing, and on cpu and cuda overlapped gradient reduction or not; for a mixture of experts
    ep too, drawn from dp x cp)
    for this model, batch and world size, as TrainConfigs."""
    for tp in divisors(math.gcd(world, cfg.n_heads)):               # (tp divides the heads, pp the layers:
        for pp in divisors(math.gcd(world // tp, cfg.n_layers)):    # the search is the model's, not the world's)
            for cp, attention in cp_choices(cfg, tcfg, tp, world // (tp * pp)):
                # interleaved: only with pp > 1, its chunks splitting the layers equally, m a multiple of pp
                sched = (dict(schedule="1f1b", virtual_stages=1) if pp == 1 and tcfg.schedule == "interleaved"
                         else dict(schedule=tcfg.schedule, virtual_stages=tcfg.virtual_stages))
                if cfg.n_layers % (pp * sched["virtual_stages"]):
                    continue
                try:
                    dp, _ = validate_plan_layout(cfg, dataclasses.replace(tcfg, tp=tp, pp=pp, cp=cp, dp=0, microbatches=1,
                                                                          sequence_parallel=False, schedule="1f1b",
                                                                          virtual_stages=1), world)
                except UserError:
                    continue
                for m in divisors(tcfg.batch_size // dp):
                    if sched["virtual_stages"] > 1 and m % pp or sched["schedule"] == "zb-h1" and m < pp:
                        continue                    # (zb-h1: at least one micro-batch per stage, mesh.py)
                    for sp in ((False, True) if tp > 1 and tcfg.seq_len // cp % tp == 0 else (False,)):
                        # (ZeRO-2 fills a bucket per micro-batch: not with interleaved chunks or zb-h1's B and W;
                        # ZeRO-3: pp 1 on cpu and cuda only, config.py)
                        split = sched["virtual_stages"] > 1 or sched["schedule"] == "zb-h1"
                        zeros = (0, 1) if split else (0, 1, 2)
                        zeros += (3,) if pp == 1 and not split and tcfg.device in ("cpu", "cuda") and not tcfg.compile else ()
                        for zero in (zeros if dp * cp > 1 else (0,)):
                            for mode in ("none", "selective", "full"):
                                for ov in ((True, False) if dp * cp > 1 and tcfg.device in ("cpu", "cuda")
                                           else (tcfg.overlap_grad_reduce,)):
                                    for ep in ep_choices(cfg, dp * cp):
                                        c = dataclasses.replace(tcfg, tp=tp, pp=pp, cp=cp, cp_attention=attention,
                                                                dp=0, microbatches=m, sequence_parallel=sp, zero=zero,
                                                                activation_checkpointing=mode, overlap_grad_reduce=ov,
                                                                ep=ep, **sched)
                                        yield c


def search(cfg: ModelConfig, tcfg: TrainConfig, world: int, device: str) -> list[dict]:
    """Every candidate layout with its estimate and peak memory, fastest first."""
    cap = DEVICE_MEMORY.get(device)
    out = []
    for c in candidate_layouts(cfg, tcfg, world):
        dp, eager = world // (c.tp * c.pp * c.cp), c.device in ("cpu", "cuda")   # (memory.peak_memory_per_rank)
        mems = [memory_per_rank(cfg, c, c.tp, c.pp, dp, s, fused=eager, eager=eager) for s in sorted({0, c.pp - 1})]
        peak = max(x["peak"] for x in mems)
        out.append({"t": c, "peak_memory": peak, "activations": max(x["activations"] for x in mems),
                    "fits": cap is None or peak <= cap,
                    "estimate": estimate_step(cfg, c, world, device)})
    out.sort(key=lambda r: (r["estimate"]["step"], r["peak_memory"]))
    return out


def _layout_name(c: TrainConfig) -> tuple:
    return (c.tp, c.pp, c.microbatches, c.zero, c.sequence_parallel and c.tp > 1, c.activation_checkpointing,
            c.ep, c.cp, c.cp_attention if c.cp > 1 else "-", c.overlap_grad_reduce)


def _search_row(i, r, world, moe: bool = False) -> list[str]:
    c, est = r["t"], r["estimate"]
    return [i, c.tp, c.pp, c.cp, c.cp_attention if c.cp > 1 else "-", world // (c.tp * c.pp * c.cp)] + (
            [c.ep] if moe else []) + [
            c.microbatches, c.zero or "-",
            "yes" if c.sequence_parallel and c.tp > 1 else "-", c.activation_checkpointing,
            fmt_bytes(r["peak_memory"]), fmt_seconds(est["compute"]),
            fmt_bytes(r["activations"]),
            fmt_seconds(est["comm"]["tp"] + est["comm"]["pp"] + est["comm"]["dp"] + est["comm"].get("cp", 0.0)
                        + est["comm"].get("ep", 0.0)),
            fmt_seconds(est["bubble"]) if c.pp > 1 else "-",
            fmt_seconds(est["step"]), f"{est['tokens_per_s']:,.0f}", f"{est['mfu']:.0%}"] + (
            ["on" if c.overlap_grad_reduce and c.tp * c.pp < world else "-"] if c.device in ("cpu", "cuda") else [])


SEARCH_HEADER = ["#", "tp", "pp", "cp", "cp attn", "dp", "m", "ZeRO", "SP", "ckpt", "peak mem", "compute",
                 "activations", "comm", "bubble",
                 "step", "tokens/s", "MFU"]   # + "ep" after "dp" for a mixture of experts, "overlap" on cpu and cuda


def search_header(cfg: ModelConfig, tcfg: TrainConfig) -> list[str]:
    """SEARCH_HEADER with "ep" (a mixture of experts) and "overlap" (cpu, cuda) where they apply."""
    head = SEARCH_HEADER[:6] + (["ep"] if cfg.moe_experts else []) + SEARCH_HEADER[6:]
    return head + (["overlap"] if tcfg.device in ("cpu", "cuda") else [])


def search_report(cfg: ModelConfig, tcfg: TrainConfig, world: int, top: int = 10) -> str:
    """`train.py --plan --search`: the fastest layouts that fit, and where the
    preset's own layout ranks."""
    device = SEARCH_DEVICE[tcfg.device]
    rows = search(cfg, tcfg, world, device)
    fits = [r for r in rows if r["fits"]]
    cap = DEVICE_MEMORY.get(device)
    lines = [f"layout search for preset {tcfg.preset} ({fmt_count(cfg.num_params())} parameters) on {world} x {device}: "
         f"{len(rows)} valid layouts, {len(fits)} fit "
         + (f"{fmt_bytes(cap)} per device" if cap else "(no memory limit known)"),
         f"  batch {tcfg.batch_size} x {tcfg.seq_len} tokens, precision {tcfg.precision}, schedule {schedule_text(tcfg)}; "
         f"ranked by the estimated step time (the assumptions of --plan: {DEFAULT_MFU:.0%} of peak, "
         f"{NETWORKS[device].node} links, "
         + ("the gradients' dp reduction overlapped with the backward where 'overlap' says on)"
            if tcfg.device in ("cpu", "cuda") else "nothing overlapped)")]
    moe = bool(cfg.moe_experts)
    if moe:
        lines.append(f"  ep: the dp (x cp) ranks sharing each sparse layer's {cfg.moe_experts} experts ({cfg.moe_experts}/ep a "
                     f"rank; comm counts its all-to-alls, predicted for balanced routing)")
    header = search_header(cfg, tcfg)
    lines += table(header, [_search_row(i + 1, r, world, moe) for i, r in enumerate(fits[:top])])
    own = _layout_name(tcfg)
    mine = next((r for r in rows if _layout_name(r["t"]) == own), None)
    if mine is None:   # why: recipe.check_layout's refusal, or what the search does not try
        try:
            validate_plan_layout(cfg, tcfg, world)
            why = "it passes the layout checks, but is not one the search tries (train.py --help, --search)"
        except UserError as e:
            why = str(e)
        if not rows:
            lines.append(f"  (no layout the search tries splits this model and batch over {world} ranks)")
        return "\n".join(lines + ["", f"the preset's own layout is not valid for {world} ranks: {why}"])
    # (hlat-moe: HLAT's 7B shape with experts, a layout HLAT never trained)
    who = "HLAT's own layout" if tcfg.preset in ("hlat-7b", "hlat-70b") else "the preset's own layout"
    lines += ["", f"{who}:"] + table(header, [_search_row("-", mine, world, moe)])
    lines += textwrap.wrap(_why(mine, fits, cap, who, moe).strip(), 100, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def _why(mine: dict, fits: list[dict], cap, who: str, moe: bool = False) -> str:
    """Where `mine` ranks among the layouts that fit, and what separates it from the first."""
    best = fits[0] if fits else None
    est = mine["estimate"]
    parts = ("compute", "tp", "pp", "dp", "bubble") + (("ep",) if moe else ())
    def costs(x):
        return {"compute": x["compute"], "tp": x["comm"]["tp"], "pp": x["comm"]["pp"], "dp": x["comm"]["dp"],
                "bubble": x["bubble"], "ep": x["comm"].get("ep", 0.0)}
    if not mine["fits"]:
        text = (f"  it does not fit: {fmt_bytes(mine['peak_memory'])} per device at its peak against "
                f"{fmt_bytes(cap)} (the memory table of --plan says where it goes).")
        name = _layout_name(mine["t"])
        with_zero1 = next((i for i, r in enumerate(fits) if _layout_name(r["t"]) == name[:3] + (1,) + name[4:]), None)
        if with_zero1 is not None:      # (only a layout without ZeRO can fit by adding ZeRO-1)
            text += f" With --zero 1 it fits and ranks {with_zero1 + 1} of {len(fits)}."
    else:
        rank = next(i for i, r in enumerate(fits) if r is mine) + 1
        text = f"  it ranks {rank} of {len(fits)} layouts that fit."
    if best is not None and best is not mine:
        diff = {k: costs(est)[k] - costs(best["estimate"])[k] for k in parts}
        big = sorted(diff, key=lambda k: -abs(diff[k]))[:3]
        names = {"compute": "compute", "tp": "tp comm", "pp": "pp exchange", "dp": "dp comm", "bubble": "bubble",
                 "ep": "ep all-to-all"}
        text += (" Against #1 it spends " + ", ".join(f"{'+' if diff[k] >= 0 else '-'}{fmt_seconds(abs(diff[k]))} "
                 f"on {names[k]}" for k in big) + f" per step ({fmt_seconds(est['step'])} vs "
                 f"{fmt_seconds(best['estimate']['step'])}).")
    if best is not None and best["t"].cp > mine["t"].cp:   # (why a long sequence wants context parallelism)
        text += (f" #1 splits each sequence over cp {best['t'].cp} ranks ({best['t'].cp_attention} attention): "
                 f"{best['t'].seq_len // best['t'].cp:,} tokens a rank, activations {fmt_bytes(best['activations'])} "
                 f"per rank against {fmt_bytes(mine['activations'])} here.")
    if est["step_overlapped"] < 0.99 * est["step"]:
        text += (f" Overlapping all the dp reduction with the backward, which nanohlat does not do "
                 f"{'on XLA' if est['device'].startswith('NeuronCore') else 'beyond the last micro-batch'}, "
                 f"would bring it to {fmt_seconds(est['step_overlapped'])}.")
    return text
