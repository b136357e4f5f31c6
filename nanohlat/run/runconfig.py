"""A run's configuration as the commands that load its checkpoints find it.

Every checkpoint's manifest holds the configuration of the run that saved it
(manifest["config"]: the `model` and `train` sections of the run's
config.json). Before a command builds a model from it, two things are
checked here, in one place for every such command (sample.py and speculative
decoding through generate.load_model, eval.py, the lm-evaluation-harness,
`python -m nanohlat.hf export`):

  * the `train` section, field by field (`train_section`): its type (a whole
    number, a finite number, a flag's word), then the ranges train.py's flags
    have (recipe.TrainConfig.validate). eval.py reads its windows' length
    `seq_len` from there: 0 divided by zero, "abc" was a TypeError. (The
    `model` section is checked as the manifest is read: checkpoint.read_manifest.)
  * the size (`check_fits`): a model whose weights, or the rotary tables of
    its max_seq_len, cannot fit in this machine's memory is refused in
    pre-flight's one line (preflight.refuse_if_too_big) before anything is
    allocated: a max_seq_len of 10^12 would ask for 4 TB.

A model imported from Hugging Face has no training section ({}); `python -m
nanohlat.hf import` checks the size from the Hugging Face config.json before
it reads the weights, and the bench (which builds its model from train.py's
flags) runs pre-flight's own check_memory.
"""

from __future__ import annotations

import os

from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig, TrainConfig, model_from_dict
from nanohlat.run import preflight
from nanohlat.run.checkpoint.manifest import FieldError, damaged, typed_fields


def train_section(manifest: dict, path: str) -> dict:
    """manifest["config"]["train"] of checkpoint `path` ({} for an imported model), each
    TrainConfig field in it checked for type, then all of them for range; a field
    of another nanohlat version is left alone. UserError naming the manifest otherwise."""
    train = manifest.get("config", {}).get("train") or {}
    mpath = os.path.join(path, "manifest.json")

    def bad(what: str) -> UserError:
        return damaged(mpath, what)
    if not isinstance(train, dict):
        raise bad(f"config.train is {train!r}, not a record")
    try:   # each field of its type, then the ranges train.py's flags have (TrainConfig.validate)
        TrainConfig(**typed_fields(train, TrainConfig, "config.train")).validate()
    except FieldError as e:
        raise bad(str(e)) from None
    except UserError as e:
        raise bad(f"config.train: {e}") from None
    return train


def check_fits(model_cfg: ModelConfig, kind: str, source: str, copies: int = 1, ranks: int = 1) -> None:
    """Refuse, in pre-flight's one line, a model this machine cannot hold: `copies` of
    its fp32 weights (in all: tp ranks each hold their slice) plus the rotary tables
    (preflight.rotary_bytes) of each of the `ranks` processes, against the memory
    of device `kind` (preflight.memory_of: one GPU on cuda, the RAM on cpu; not
    checked on xla). `source` names where the shape comes from."""
    need = copies * 4 * model_cfg.num_params() + ranks * preflight.rotary_bytes(model_cfg)
    what = "its weights" if copies == 1 else f"{copies} copies of its weights"
    rotary = f" and the rotary tables of max_seq_len {model_cfg.max_seq_len:,}" if ranks else ""
    preflight.refuse_if_too_big(need, preflight.memory_of(kind), what + rotary, f"the size comes from {source}: "
                                f"use a machine with more memory, or another model", ranks)


def check(manifest: dict, path: str, kind: str, copies: int = 1, ranks: int = 1) -> dict:
    """Before a reader builds the model of checkpoint `path` (its `manifest`, read):
    the train section (returned) and the size."""
    train = train_section(manifest, path)
    check_fits(model_from_dict(manifest["config"]["model"]), kind, f"checkpoint {path} (its config.model)", copies,
               ranks)
    return train
