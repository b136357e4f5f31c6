"""The numbers of the planner page (`train.py --plan --html FILE`, plan/page.py), every one computed here,
by the functions that print `--plan` and `--search`, and formatted as they print it. The page's
JavaScript only looks them up and draws them: no formula of the planner lives in it.

What the page holds: every layout of a bounded set (`layouts`), each the plan of one command line.
Varied, every value --plan accepts (validate, check_layout) of:

    tp, pp          the divisors of the heads and of the layers that divide the world (as --search)
    cp, ep          cp 1, and from --seq-len 8192 (or a --cp given) the search's cp with --cp-attention's
                    algorithm; a mixture's ep dividing dp x cp and the experts (as --search)
    dp              world / (tp x pp x cp): a layout is set by its degrees
    zero            0, 1, 2, 3
    schedule        afab, 1f1b, interleaved (the command's --virtual-stages, or 2), zb-h1
    microbatches    every divisor of the sequences per dp rank
    batch size      the command's; where a layout's dp cannot split it, the smallest multiple of it that
                    dp splits (lcm(batch, dp)) in its place, and the page says so

and every other flag as the command gave it (precision, moments, checkpointing, sequence parallelism,
--device, --seq-len, --cp-attention, --overlap-grad-reduce, the model). For hlat-7b on 2048 ranks that is
about 1,400 layouts (docs/design.md says how large the page is and how long it takes). Their strings
are kept once, in one table (`strings`), and every record names them by number.
"""

from __future__ import annotations

import dataclasses
import math

from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig, TrainConfig, divisors
from nanohlat.config import DEVICES
from nanohlat.precision import PRECISIONS
from nanohlat.recipe.configs import CP_ATTENTIONS, SCHEDULES
from nanohlat.plan.communication import comm_per_step
from nanohlat.plan.fmt import fmt_bytes
from nanohlat.plan.hardware import DEVICE_MEMORY
from nanohlat.plan.layout_search import SEARCH_DEVICE, _search_row, cp_choices, ep_choices, search, search_header
from nanohlat.mesh import rank_of
from nanohlat.plan.params import mesh_at
from nanohlat.plan.sheets import fits_lines, memory_table, time_devices, time_header, time_row, validate_plan_layout

# The page's controls, in the order of a layout's key: each a form element whose name is the flag's without
# its dashes (--virtual-stages: virtualstages), and the TrainConfig field it sets.
CONTROLS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "zero": "zero", "schedule": "schedule",
            "virtualstages": "virtual_stages", "microbatches": "microbatches", "batchsize": "batch_size",
            "seqlen": "seq_len", "precision": "precision", "moments": "moments",
            "activationcheckpointing": "activation_checkpointing", "sequenceparallel": "sequence_parallel",
            "cpattention": "cp_attention", "overlapgradreduce": "overlap_grad_reduce", "device": "device"}


# the values each choice's flag takes (a control offers them all; the page holds the command's, or those varied)
CHOICES = {"zero": ["0", "1", "2", "3"], "schedule": list(SCHEDULES), "precision": list(PRECISIONS),
           "moments": ["fp32", "bf16"], "activationcheckpointing": ["none", "selective", "full"],
           "sequenceparallel": ["on", "off"], "cpattention": list(CP_ATTENTIONS), "overlapgradreduce": ["on", "off"],
           "device": list(DEVICES)}


def control_value(value) -> str:
    """A flag's value as the page's control holds it: on/off for a switch, else its text."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def key_of(tcfg: TrainConfig) -> str:
    """A layout's key: its controls' values in CONTROLS' order (the page's JavaScript joins the same)."""
    return "|".join(control_value(getattr(tcfg, field)) for field in CONTROLS.values())


class Strings:
    """Every text of the page once: `add` gives its number in `table`."""

    def __init__(self):
        self.table, self.index = [], {}

    def add(self, text) -> int:
        text = str(text)
        if text not in self.index:
            self.index[text] = len(self.table)
            self.table.append(text)
        return self.index[text]


def variants(cfg: ModelConfig, tcfg: TrainConfig, world: int):
    """Every layout of the bounded set (the module's docstring) that --plan accepts, as TrainConfigs."""
    for tp in divisors(math.gcd(world, cfg.n_heads)):
        for pp in divisors(math.gcd(world // tp, cfg.n_layers)):
            for cp, attention in cp_choices(cfg, tcfg, tp, world // (tp * pp)):
                if attention != tcfg.cp_attention and cp > 1:
                    continue
                dp = world // (tp * pp * cp)
                batch = tcfg.batch_size if tcfg.batch_size % dp == 0 else math.lcm(tcfg.batch_size, dp)
                for schedule in SCHEDULES:
                    v = max(tcfg.virtual_stages, 2) if schedule == "interleaved" else 1
                    for m in divisors(batch // dp):
                        for zero in (0, 1, 2, 3):
                            for ep in ep_choices(cfg, dp * cp):
                                c = dataclasses.replace(tcfg, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, zero=zero,
                                                        schedule=schedule, virtual_stages=v, microbatches=m,
                                                        batch_size=batch, plan=True, html="", measured=())
                                try:
                                    c.validate()
                                    validate_plan_layout(cfg, c, world)
                                except UserError:
                                    continue
                                yield c


def layout_record(cfg: ModelConfig, tcfg: TrainConfig, world: int, s: Strings) -> dict:
    """One layout's figures as --plan prints them (strings, by number) and the bytes its bar draws."""
    dp = world // (tcfg.tp * tcfg.pp * tcfg.cp)
    header, (row,), mems, largest = memory_table(cfg, tcfg, dp, largest_only=True)
    r = mems[largest]
    fb, step = r["forward_backward"], r["optimizer_step"]
    # the stacked bar: the peak's parts (memory_per_rank's sum), the larger of the two moments last
    adam = f"Adam (ZeRO-{tcfg.zero})" if tcfg.zero else "Adam (no ZeRO)"
    bar = [["weights", r["weights"]], [adam, r["optimizer"]], ["fp32 grads", r["flat_grads"]],
           ["rotary tables, token ids, buffers", r["fixed"]]]
    bar += ([["activations", r["activations"]], ["the backward's largest moment beyond them", fb - r["activations"]]]
            if fb >= step else [["optimizer step", step]])
    if sum(b for _, b in bar) + r["grads"] != r["peak"]:   # (grads: 0, in the fp32 buffers)
        raise AssertionError(f"the bar's parts do not add up to the peak of {key_of(tcfg)}")
    comm = []
    for stage in sorted({0, tcfg.pp - 1}):   # (as --plan: the first rank of the first and last stage)
        rank = rank_of(0, stage, 0, tcfg.tp, dp * tcfg.cp)
        entries = comm_per_step(cfg, tcfg, mesh_at(tcfg.tp, tcfg.pp, dp, rank, tcfg.cp))
        comm.append([s.add(f"rank {rank} (stage {stage})"),
                     [[s.add(k), s.add(f"{e['calls']:,}"), s.add(f"{e['payload']:,}"), s.add(f"{e['wire']:,}"),
                       s.add(f"{e['padding']:,}")] for k, e in sorted(entries.items())]])
    fits = fits_lines(tcfg, r["peak"], largest)
    times = {dev: time_row(cfg, tcfg, world, dev) for dev in time_devices(tcfg)}
    return {"memory": [[s.add(h), s.add(c)] for h, c in zip(header, row)], "largest": largest,
            "peak": s.add(fmt_bytes(r["peak"])), "peak_bytes": r["peak"],
            "bar": [[s.add(name), b, s.add(fmt_bytes(b))] for name, b in bar],
            # (trn1n: the same NeuronCore-v2 as trn1, its --plan line; cpu: no memory figure, no line)
            "fits": {dev: [s.add("fits" if r["peak"] <= DEVICE_MEMORY[base(dev)] else "does not fit"),
                           s.add(fits[base(dev)].strip())] for dev in times if base(dev) in fits},
            "time": {dev: [s.add(c) for c in cells] for dev, cells in times.items()},
            "time_header": [s.add(h) for h in time_header(tcfg)], "comm": comm}


def search_rows(cfg: ModelConfig, tcfg: TrainConfig, world: int, s: Strings) -> dict:
    """--search's ranking (the layouts that fit, fastest first) as it prints it, each row with the numbers it
    sorts by and the key of its layout on the page."""
    device = SEARCH_DEVICE[tcfg.device]
    rows = [r for r in search(cfg, tcfg, world, device) if r["fits"]]
    moe = bool(cfg.moe_experts)
    out = []
    for i, r in enumerate(rows):
        c, est = r["t"], r["estimate"]
        cells = _search_row(i + 1, r, world, moe)
        comm = sum(est["comm"].get(g, 0.0) for g in ("tp", "pp", "dp", "cp", "ep"))
        numbers = [i + 1, c.tp, c.pp, c.cp, None, world // (c.tp * c.pp * c.cp)] + ([c.ep] if moe else []) + [
            c.microbatches, c.zero, None, None, r["peak_memory"], est["compute"], r["activations"], comm,
            est["bubble"], est["step"], est["tokens_per_s"], est["mfu"]] + ([None] if c.device in ("cpu", "cuda") else [])
        key = key_of(dataclasses.replace(c, dp=world // (c.tp * c.pp * c.cp), plan=True, html="", measured=()))
        out.append([[s.add(x) for x in cells], numbers, key])
    return {"device": device, "header": [s.add(h) for h in search_header(cfg, tcfg)], "rows": out}


def page_data(cfg: ModelConfig, tcfg: TrainConfig, world: int) -> dict:
    """Everything the planner page shows for this command: the layouts, the ranking, the controls."""
    s = Strings()
    own = dataclasses.replace(tcfg, dp=world // (tcfg.tp * tcfg.pp * tcfg.cp), plan=True, html="", measured=())
    layouts, options, notes = {}, {name: set() for name in CONTROLS}, {}
    for c in variants(cfg, tcfg, world):
        layouts[key_of(c)] = layout_record(cfg, c, world, s)
        if c.batch_size != tcfg.batch_size:   # (the page's JavaScript finds it by tp|pp|dp|cp)
            notes[f"{c.tp}|{c.pp}|{c.dp}|{c.cp}"] = (
                f"dp {c.dp} cannot split --batch-size {tcfg.batch_size}: the page holds this layout at "
                f"--batch-size {c.batch_size} (lcm of the two), choose it above.")
        for name, field in CONTROLS.items():
            options[name].add(control_value(getattr(c, field)))
    return {"world": world, "strings": s.table, "layouts": layouts, "own": key_of(own), "notes": notes,
            "controls": list(CONTROLS),
            "options": {k: CHOICES.get(k) or sorted(v, key=_order) for k, v in options.items()},
            "devices": {dev: [DEVICE_MEMORY.get(base(dev)),
                              fmt_bytes(DEVICE_MEMORY[base(dev)]) if base(dev) in DEVICE_MEMORY else ""]
                        for dev in time_devices(tcfg)},
            "search": search_rows(cfg, tcfg, world, s)}


def base(device: str) -> str:
    """The device of a time-table row: 'NeuronCore-v2 (trn1n)' is a NeuronCore-v2 (as step_time.estimate_step)."""
    return device.split(" ")[0]


def _order(value: str):
    return (0, int(value), "") if value.isdigit() else (1, 0, value)
