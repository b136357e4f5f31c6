"""The plan beside what runs measured: for a run folder (its config.json and summary.json, rank 0's
figures), each term the run measures next to what the plan says for the same configuration.

A run measures, on rank 0 (run/trainlog.py:TrainLog.close writes them to summary.json):

    weights          param_bytes      the parameters' flat buffers (ZeRO-3: the shard kept)
    fp32 grads       grad_bytes       the fp32 gradient buffers
    Adam             optimizer_bytes  the moments (and fp32 master weights when kept apart)
    in flight        peak_in_flight   the most micro-batches whose activations were held at once
    peak             peak_memory      on cuda the allocator's peak (torch.cuda.max_memory_allocated);
                                      on the cpu the process's resident set, which counts Python and
                                      torch's libraries too: not the plan's peak, so not compared
    COLLECTIVE       comm_bytes...    the comm ledger of the first step: payload, wire and calls of each

The repository ships these for the layout matrix's runs (LAYOUT_MATRIX_DATA, made by
`python scripts/layout_matrix.py --plan-vs-measured`); `train.py --plan --html FILE` shows how far the
plan was from them, term by term, and `--measured DIR...` adds the given run folders.
"""

from __future__ import annotations

import dataclasses
import json
import os

from nanohlat.config import UserError
from nanohlat.plan.communication import comm_per_step
from nanohlat.plan.memory import memory_per_rank
from nanohlat.plan.params import mesh_at

LAYOUT_MATRIX_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "layout_matrix_measured.json")

# term -> (summary.json's key, the plan's key in memory_per_rank of rank 0's stage)
MEMORY_TERMS = {"weights": ("param_bytes", "weights"), "fp32 grads": ("grad_bytes", "flat_grads"),
                "Adam": ("optimizer_bytes", "optimizer"), "in flight": ("peak_in_flight", "in_flight")}
COMM_FIGURES = {"payload": "comm_bytes", "wire": "comm_wire_bytes", "calls": "comm_calls"}


def configs_of(config: dict):
    """(ModelConfig, TrainConfig, world) from a run's config.json (fields it lacks take their defaults)."""
    from nanohlat.recipe import TrainConfig, model_from_dict
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    train = {k: v for k, v in config["train"].items() if k in names}
    train["measured"] = tuple(train.get("measured", ()))
    return model_from_dict(config["model"]), TrainConfig(**train), int(config["world"])


def planned(config: dict) -> dict:
    """What the plan says for the run that config.json describes, for every term a run measures
    (rank 0: stage 0, dp 0, tp 0): {term: number}, the collectives as 'COLLECTIVE payload' etc."""
    cfg, tcfg, world = configs_of(config)
    dp = world // (tcfg.tp * tcfg.pp * tcfg.cp)
    mem = memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, dp, 0)   # (as tests/plan/plan_utils.py holds them)
    out = {term: mem[key] for term, (_, key) in MEMORY_TERMS.items()}
    eager = tcfg.device in ("cpu", "cuda")
    out["peak"] = memory_per_rank(cfg, tcfg, tcfg.tp, tcfg.pp, dp, 0, fused=eager, eager=eager)["peak"]
    for key, entry in comm_per_step(cfg, tcfg, mesh_at(tcfg.tp, tcfg.pp, dp, 0, tcfg.cp)).items():
        for figure in COMM_FIGURES:
            out[f"{key} {figure}"] = entry[figure]
    return out


def measured(config: dict, summary: dict) -> dict:
    """What the run measured, under the names `planned` uses; the peak only where it is the
    allocator's (cuda), the collectives the plan has no row for as measured beside a planned 0."""
    out = {term: summary.get(key) for term, (key, _) in MEMORY_TERMS.items()}
    out["peak"] = summary.get("peak_memory") if config["train"].get("device") == "cuda" else None
    for figure, key in COMM_FIGURES.items():
        for collective, value in (summary.get(key) or {}).items():
            out[f"{collective} {figure}"] = value
    return out


def compare(config: dict, summary: dict) -> list[dict]:
    """Rows {term, planned, measured, error}: error = planned / measured - 1 (None where the run did
    not measure the term, or measured 0 where the plan says more)."""
    plan, meas = planned(config), measured(config, summary)
    rows = []
    for term in list(plan) + [t for t in meas if t not in plan]:
        p, m = plan.get(term, 0), meas.get(term)
        error = None if m is None else 0.0 if p == m else (p / m - 1 if m else None)
        rows.append({"term": term, "planned": p, "measured": m, "error": error})
    return rows


def read_run(folder: str) -> tuple[dict, dict]:
    """A run folder's config.json and summary.json, or one line saying what is missing."""
    found = []
    for name in ("config.json", "summary.json"):
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                found.append(json.load(f))
        except (OSError, ValueError) as e:
            raise UserError(f"--measured {folder!r}: cannot read {name} ({type(e).__name__}: "
                            f"{e.strerror if isinstance(e, OSError) else e}); give the folder of a finished "
                            f"train.py run (its --out-dir)") from None
    if not all(isinstance(d, dict) for d in found) or "model" not in found[0] or "world" not in found[0]:
        raise UserError(f"--measured {folder!r}: config.json or summary.json is not a train.py run's; give the "
                        f"folder of a finished train.py run (its --out-dir)")
    return found[0], found[1]


def shipped() -> dict:
    """The layout matrix's runs as the repository ships them (LAYOUT_MATRIX_DATA)."""
    with open(LAYOUT_MATRIX_DATA) as f:
        return json.load(f)
