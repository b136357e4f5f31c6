"""Trusting a checkpoint: its manifest, its files and whose run it is.

Trust: files load with weights_only=True, so no pickled code ever runs. Before
anything is loaded, every file named by the manifest must exist with the
recorded size and sha256 (each rank hashes 1/world of the files), so a
missing, truncated or corrupt shard is a one-line UserError naming the file,
never a silently wrong model.

Identity: the manifest records the sha256 of the tokenizer file and the
fingerprint of the data (data.Dataset.fingerprint). Resuming with another
tokenizer would give every embedding row another token's meaning, so it is
refused unless --allow-tokenizer-change; other data with the same tokenizer
is allowed and announced (check_identity).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from nanohlat.config import UserError
from nanohlat.recipe import HIGHEST, ModelConfig, model_from_dict
from nanohlat.system.files import sha256_file

# how to pick another checkpoint, in words true for every reader (train.py, sample.py, eval.py)
PICK_ANOTHER = "pick another checkpoint (a step_* folder: train.py --resume PATH, sample.py or eval.py --checkpoint PATH)"
FORMAT = 2   # 2: per-file sha256, schedule/data/rng records in the manifest
REQUIRED = ("format", "step", "tokens", "layout", "config", "tokenizer", "files")
# the manifest's "rng": where the random state is. Only a description, never read: checkpoints
# saved before it said this named a stochastic-rounding generator that does not exist, and load alike
RNG = "per rank, in its shard: the torch CPU generator (stochastic rounding has none, precision.py)"
TOKENIZER_COPY = "tokenizer.model"


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.json")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as e:   # (ValueError: not JSON, or not UTF-8)
        raise UserError(f"checkpoint manifest {mpath} is missing or unreadable ({e.__class__.__name__}); "
                        f"pick another checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise UserError(f"{mpath} has format {found!r}, this nanohlat reads {FORMAT}: it is damaged or from "
                        f"another nanohlat version; pick another checkpoint")
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise UserError(f"checkpoint manifest {mpath} lacks {', '.join(missing)}: it is corrupt; "
                        f"pick another checkpoint")
    _check_fields(mpath, manifest)
    copy = manifest.get("tokenizer_copy")   # the tokenizer saved with the checkpoint, when whole
    if isinstance(copy, dict) and copy.get("file") == TOKENIZER_COPY:
        cpath = os.path.join(path, TOKENIZER_COPY)
        if os.path.isfile(cpath) and sha256_file(cpath) == copy.get("sha256"):
            manifest["tokenizer"] = cpath
    return manifest


MOST = 2**53   # the largest count a manifest may hold: JSON's safe integers (exact in a double, in every reader)


def _count(v, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v <= MOST


def damaged(mpath: str, what: str) -> UserError:
    """The one line for a manifest `mpath` whose field is wrong (`what`: which, and how)."""
    return UserError(f"checkpoint manifest {mpath} is damaged ({what}); {PICK_ANOTHER} or restore this one")


def _check_fields(mpath: str, m: dict) -> None:
    """Types and ranges of every field a reader uses (a manifest edited by hand,
    or damaged, is named in one line instead of failing deep inside a load)."""
    def bad(what: str) -> UserError:
        return damaged(mpath, what)
    for k in ("step", "tokens"):
        if not _count(m[k]):
            raise bad(f"{k} is {m[k]!r}, not a whole number in [0, 2^53]")
    folder = os.path.basename(os.path.dirname(os.path.abspath(mpath)))
    if folder.startswith("step_") and folder[5:].isdigit() and int(folder[5:]) != m["step"]:
        raise bad(f"step is {m['step']}, its folder is {folder}")   # (a copy under another name is fine)
    lay = m["layout"]
    if not isinstance(lay, dict) or not all(_count(lay.get(k), 1) for k in ("tp", "pp", "dp", "world")):
        raise bad(f"layout is {lay!r}, not tp, pp, dp and world >= 1")
    if not _count(lay.get("cp", 1), 1):   # (before context parallelism: no cp, which was 1)
        raise bad(f"layout cp is {lay['cp']!r}, not a whole number >= 1")
    if lay["world"] != lay["tp"] * lay["pp"] * lay["dp"] * lay.get("cp", 1):
        raise bad(f"layout world {lay['world']} is not tp*pp*dp*cp = "
                  f"{lay['tp'] * lay['pp'] * lay['dp'] * lay.get('cp', 1)}")
    # the ZeRO stage: "zero" (0-3) since ZeRO-2; before it only "zero1" (a bool); when both, they agree
    if "zero" in lay and not (_count(lay["zero"]) and lay["zero"] <= 3):
        raise bad(f"layout zero is {lay['zero']!r}, not a ZeRO stage 0-3")
    if "zero1" in lay and not isinstance(lay["zero1"], bool):
        raise bad(f"layout zero1 is {lay['zero1']!r}, not true or false")
    if "zero" not in lay and "zero1" not in lay:
        raise bad("layout has neither zero (the ZeRO stage) nor zero1")
    if "zero" in lay and "zero1" in lay and lay["zero1"] != (lay["zero"] >= 1):
        raise bad(f"layout zero {lay['zero']} and zero1 {lay['zero1']} disagree (zero1 means a stage >= 1)")
    if not _count(lay.get("virtual_stages", 1), 1) or lay.get("virtual_stages", 1) > 1 and lay["pp"] < 2:
        raise bad(f"layout virtual_stages is {lay.get('virtual_stages')!r}, not 1, or >= 2 with pp >= 2")
    cfg = m["config"]
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("train", {}), dict):
        raise bad("config is not {'model': {...}, 'train': {...}}")
    unused_fields(mpath, m)   # (a dense model's mixture fields, the router's training coefficients)
    try:   # each field of its type, then the model's ranges (recipe.ModelConfig.validate)
        model_from_dict(typed_fields(cfg["model"], ModelConfig, "config.model")).validate()
    except FieldError as e:
        raise bad(str(e)) from None
    except UserError as e:
        raise bad(f"config.model: {str(e).splitlines()[0]}") from None
    if not isinstance(m["tokenizer"], str):
        raise bad(f"tokenizer is {m['tokenizer']!r}, not a path")
    files = m["files"]
    if not isinstance(files, dict) or not files:
        raise bad("files is not a non-empty {name: {bytes, sha256}}")
    for name, info in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise bad(f"file name {name!r} is not a plain name inside the checkpoint")
        if not isinstance(info, dict) or not _count(info.get("bytes")) or not isinstance(info.get("sha256"), str) \
                or len(info["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in info["sha256"]):
            raise bad(f"files[{name!r}] is not {{bytes: n >= 0, sha256: 64 hex digits}}")
    for k, fields_ in (("schedule", ("optimizer_step", "bad_steps")), ("data", ())):
        v = m.get(k, {})
        if not isinstance(v, dict) or not all(_count(v.get(f, 0)) for f in fields_):
            raise bad(f"{k} is {v!r}")
    for f in ("optimizer_step", "bad_steps"):   # counts of steps: never more than the steps taken
        if m.get("schedule", {}).get(f, 0) > m["step"]:
            raise bad(f"schedule.{f} {m['schedule'][f]} is more than step {m['step']}")
    if not isinstance(m.get("optimizer", True), bool):   # false: weights only, fresh moments (a wrong value
        raise bad(f"optimizer is {m['optimizer']!r}, not true or false")   # would silently reset Adam)
    for k in ("identity", "tokenizer_copy"):
        if not isinstance(m.get(k) or {}, dict):
            raise bad(f"{k} is {m[k]!r}, not a record")
    for k, f in (("identity", "tokenizer_sha256"), ("identity", "data"), ("tokenizer_copy", "file"),
                 ("tokenizer_copy", "sha256")):
        v = (m.get(k) or {}).get(f)
        if v is not None and not isinstance(v, str):
            raise bad(f"{k}.{f} is {v!r}, not a string")


# What reading a checkpoint's model never uses: a dense model's mixture fields (it has no experts; before this
# version train.py took them unchecked, e.g. --moe-bias-rate nan), and the router losses' coefficients of any
# model (a training step reads them, and a resume takes its own flags). A mixture's --moe-bias-rate is read
# only as "the model has expert biases" (nonzero): its checkpoint holds them, and they route its tokens.
TRAINING_ONLY = ("moe_aux_coef", "moe_z_coef")
_noted: set = set()   # the manifests whose unused values were noted (once each per process)


def unused_fields(mpath: str, m: dict) -> None:
    """Set aside the fields of a manifest's model that no reader uses, when a value there is one that
    train.py's flags now refuse (NaN, inf, above its largest: recipe.HIGHEST; an older nanohlat took
    them unchecked): named in a one-line note, never called damage. A dense model's moe_* fields are
    all set aside (read as their defaults: it has no experts); a mixture's refused router-loss
    coefficient is read as its default, a refused --moe-bias-rate as 1 (its largest: the biases the
    checkpoint holds are loaded, and checked, as they are). What was set aside is in m["ignored"]
    (note_model_changes names no change of it). A value of the wrong kind (a string, a bool) is left
    for typed_fields to call damaged."""
    model, ignored, refused = m["config"]["model"], {}, []
    dense = model.get("moe_experts", 0) == 0 and not isinstance(model.get("moe_experts"), bool)
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_") and f.name != "moe_experts"]
    for name in names if dense else TRAINING_ONLY + ("moe_bias_rate",):
        value = model.get(name)
        spelled = isinstance(value, str) and value in NON_FINITE      # (NaN as strict JSON writes it)
        if not (spelled or isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue                                                  # (absent, or damage: typed_fields')
        x = float(NON_FINITE[value] if spelled else value)
        bad = (spelled or isinstance(value, float)) and not (math.isfinite(x) and 0 <= x <= HIGHEST.get(name, (x,))[0])
        if bad:
            refused.append(f"--{name.replace('_', '-')} {x:g}")
        if dense or bad:
            ignored[name] = model.pop(name)
            if not dense and name == "moe_bias_rate":
                model[name] = HIGHEST[name][0]
    m["ignored"] = ignored
    if refused and mpath not in _noted:
        _noted.add(mpath)
        what = ("a dense model has no experts and never uses it" if dense else
                "reading the model does not use it (a nonzero --moe-bias-rate only says that it has expert biases)")
        print(f"note: checkpoint manifest {mpath} records {', '.join(refused)}, which train.py refuses now (an older "
              f"nanohlat took it unchecked); {what}, so it is set aside (a resume takes its own flags)",
              file=sys.stderr)


NON_FINITE = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}   # (strict JSON's spelling: files.json_text)


class FieldError(ValueError):
    """A field of a run file that is not of its kind (typed_fields)."""


def typed_fields(record: dict, cls, where: str) -> dict:
    """The fields of dataclass `cls` (recipe.ModelConfig, recipe.TrainConfig) in `record`,
    each checked to be of its default's kind: an int a whole number, a float a finite
    number (no strings, no bools, no NaN), a bool a bool, a str a str, a tuple a list of strings
    (read as a tuple). A name `cls` does not have (another nanohlat version's) is left out. Their
    ranges are cls.validate's.
    One checker for the `model` section (read_manifest) and the `train` one (runconfig.py).
    FieldError naming `where`.name otherwise."""
    kinds = {f.name: type(f.default) for f in dataclasses.fields(cls)}
    known = {}
    for name, value in record.items():
        kind = kinds.get(name)
        if kind is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is tuple:   # (a list of strings in JSON: --measured's folders)
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            value = tuple(value) if ok else value
        else:
            ok = (isinstance(value, bool) if kind is bool else
                  number and isinstance(value, int) if kind is int else
                  number and math.isfinite(value) if kind is float else isinstance(value, kind))
        if not ok:
            raise FieldError(f"{where}.{name} is {value!r}")
        known[name] = value
    return known


def check_files(path: str, manifest: dict) -> None:
    """Every file the manifest names exists with the recorded size (cheap: no reading)."""
    for name, info in sorted(manifest["files"].items()):
        fpath = os.path.join(path, name)
        if not isinstance(info, dict) or not {"bytes", "sha256"} <= set(info):
            raise UserError(f"checkpoint manifest {os.path.join(path, 'manifest.json')} has no size and "
                            f"checksum for {name}: it is corrupt; pick another checkpoint")
        if not os.path.isfile(fpath):
            raise UserError(f"checkpoint shard {fpath} is missing; the checkpoint is incomplete, "
                            f"{PICK_ANOTHER}")
        if os.path.getsize(fpath) != info["bytes"]:
            raise UserError(f"checkpoint shard {fpath} has {os.path.getsize(fpath)} bytes, the manifest "
                            f"says {info['bytes']}: the file is truncated or corrupt")


SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "vocab_multiple",
                "moe_experts", "moe_shared_experts", "moe_every")   # what the tensors' shapes follow from


def check_model(path: str, manifest: dict, cfg: ModelConfig) -> None:
    """The checkpoint was saved for a model of this shape (a field it lacks, from before it
    existed, has its default). A reader builds its model from the manifest, so it always
    passes here: a tensor of another shape is then the manifest's fault (ShardSet.tensor)."""
    saved = dataclasses.asdict(model_from_dict(manifest["config"]["model"]))
    mine = dataclasses.asdict(cfg)
    diff = [k for k in SHAPE_FIELDS if saved[k] != mine[k]]
    if diff:
        desc = ", ".join(f"{k} {saved.get(k)} vs {mine[k]}" for k in diff)
        raise UserError(f"checkpoint {os.path.join(path, 'manifest.json')} is for a different model shape "
                        f"({desc}: saved vs this run); pick a matching checkpoint or --out-dir")


def note_model_changes(path: str, manifest: dict, cfg: ModelConfig) -> None:
    """(Resume) a model field that shapes no tensor but differs from the checkpoint's (--moe-top-k,
    --moe-capacity-factor, --moe-aux-coef, --rope-theta, ...): allowed, as a changed --lr is, and
    announced in one note (it was silent); a shape field is refused (check_model)."""
    saved, mine = dataclasses.asdict(model_from_dict(manifest["config"]["model"])), dataclasses.asdict(cfg)
    changed = [f"--{k.replace('_', '-')} {mine[k]!r} (it trained with {saved[k]!r})" for k in mine
               if k not in SHAPE_FIELDS and k not in manifest.get("ignored", {}) and saved[k] != mine[k]]
    if changed:
        print(f"note: resuming {path} with {', '.join(changed)}: the same weights, another model from here on",
              file=sys.stderr)


def identity(tokenizer_path: str, data_fingerprint: str | None) -> dict:
    """What makes a run this run: its tokenizer (file hash) and its data."""
    return {"tokenizer_sha256": sha256_file(tokenizer_path), "data": data_fingerprint}


def check_identity(path: str, tokenizer_path: str, data_fingerprint: str | None,
                   allow_tokenizer_change: bool = False) -> None:
    """Refuse to resume checkpoint `path` with another tokenizer; announce other data."""
    manifest = read_manifest(path)
    saved = manifest.get("identity") or {}
    saved_tok = saved.get("tokenizer_sha256")
    if saved_tok is None and os.path.isfile(manifest["tokenizer"]):   # a checkpoint from before identities
        saved_tok = sha256_file(manifest["tokenizer"])
    mine = sha256_file(tokenizer_path)
    if saved_tok is not None and saved_tok != mine:
        if not allow_tokenizer_change:
            raise UserError(f"checkpoint {path} was trained with another tokenizer ({manifest['tokenizer']}, "
                            f"sha256 {saved_tok[:12]}) than this run's ({tokenizer_path}, {mine[:12]}): its token "
                            f"ids would change meaning. Start fresh with --resume never --overwrite, keep the "
                            f"run's tokenizer for new data with --tokenizer {manifest['tokenizer']}, or continue "
                            f"anyway with --allow-tokenizer-change")
        print(f"warning: resuming {path} with another tokenizer (--allow-tokenizer-change): "
              f"its token ids change meaning", file=sys.stderr)
    elif saved.get("data") and data_fingerprint and saved["data"] != data_fingerprint:
        print(f"note: resuming {path} on other data than it was trained on (same tokenizer)", file=sys.stderr)


def corrupt_files(path: str, manifest: dict, rank: int = 0, world: int = 1) -> list[str]:
    """Files whose sha256 differs from the manifest's, among this rank's 1/world of them."""
    names = sorted(manifest["files"])
    return [n for i, n in enumerate(names)
            if i % world == rank and sha256_file(os.path.join(path, n)) != manifest["files"][n]["sha256"]]


def corrupt_error(path: str, name: str) -> UserError:
    return UserError(f"checkpoint shard {os.path.join(path, name)} does not match the sha256 in its manifest: "
                     f"the file is corrupt; {PICK_ANOTHER}")


def check(path: str, cfg: ModelConfig, checksums: bool = False) -> dict:
    """Checks before workers start (train.py's pre-flight, preflight.py), so that a bad checkpoint is one
    line from one process: manifest, files, model shape, and (reading every byte
    once) the checksums."""
    manifest = read_manifest(path)
    check_files(path, manifest)
    check_model(path, manifest, cfg)
    bad = corrupt_files(path, manifest) if checksums else []
    if bad:
        raise corrupt_error(path, bad[0])
    return manifest
