"""Sharded, atomic checkpoints that load into any layout.

On disk (one directory per saved step):

    <out_dir>/checkpoints/step_00000200/
        shard_00000.pt ... shard_<world-1>.pt   one per rank: its tensors + where they belong
        manifest.json                            written last: config, layout, step, file sizes
    <out_dir>/checkpoints/latest                 name of the newest complete checkpoint

Atomicity: every rank writes into `.tmp_step_...`, each file under a
temporary name, fsync'd, then renamed; after a barrier rank 0 writes the
manifest the same way, renames the directory into place and only then
updates `latest`. A crash at any moment leaves at most a `.tmp_` directory
that nothing reads, and the previous checkpoint intact.

Resharding: a shard stores, for every tensor, the full shape, which dimension
was split over tp and which chunk it is; ZeRO-1 optimizer pieces also store
which [start, stop) of the flattened tp-local parameter they cover. Loading
rebuilds each full tensor one parameter at a time from whichever shards hold
it, then cuts the slice the *new* layout needs. Model weights are written
once per (pp, tp) coordinate (dp rank 0); optimizer state by every rank that
owns some (all dp ranks with ZeRO-1). Files load with weights_only=True, so
no pickled code ever runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import torch

from . import comm
from .config import ModelConfig, UserError, model_from_dict
from .tensor_parallel import shard

FORMAT = 1


# -- small file helpers ------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier(mesh, device) -> None:
    """All ranks reach this point (an all-reduce: barrier() is a no-op on xla)."""
    g = mesh.group("world")
    if g.size > 1:
        comm.all_reduce(torch.zeros(1, device=device.torch_device), g)
        device.sync()


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def list_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints of a run (they have a manifest), oldest first."""
    root = ckpt_root(out_dir)
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_")
                   and os.path.isfile(os.path.join(root, n, "manifest.json")))
    return [os.path.join(root, n) for n in names]


def latest(out_dir: str) -> str | None:
    pointer = os.path.join(ckpt_root(out_dir), "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(ckpt_root(out_dir), f.read().strip())
        if os.path.isfile(os.path.join(path, "manifest.json")):
            return path
    found = list_checkpoints(out_dir)   # pointer missing (crash between rename and update)
    return found[-1] if found else None


def resolve(path: str) -> str:
    """A checkpoint directory, or a run directory -> its latest checkpoint."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    found = latest(path) if os.path.isdir(path) else None
    if not found:
        raise UserError(f"no complete checkpoint in {path!r}; train first (python train.py --out-dir {path}) "
                        f"or pass a checkpoint directory")
    return found


def find_resume(out_dir: str, resume: str, overwrite: bool = False) -> str | None:
    """What --resume means for this out-dir: a checkpoint to load, or None to start fresh."""
    if resume == "auto":
        return latest(out_dir)
    if resume == "never":
        has_run = latest(out_dir) or os.path.isfile(os.path.join(out_dir, "metrics.jsonl"))
        if has_run and not overwrite:
            raise UserError(f"--out-dir {out_dir} already holds a run; use --resume auto to continue it, "
                            f"--overwrite to replace it, or another --out-dir")
        return None
    return resolve(resume)


def clear_run(out_dir: str) -> None:
    """--resume never --overwrite: remove the old run's checkpoints and metrics."""
    shutil.rmtree(ckpt_root(out_dir), ignore_errors=True)
    for name in ("metrics.jsonl", "timeline.txt"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def truncate_metrics(path: str, step: int) -> None:
    """Drop metrics.jsonl records after `step` (written by a run that was then
    interrupted before its next checkpoint), so a resumed run continues cleanly."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except json.JSONDecodeError:
                pass  # a line cut short by a crash
    _atomic_write(path, lambda f: f.write("".join(keep).encode()))


# -- save ------------------------------------------------------------------

def _meta(p) -> dict:
    return {"full_shape": list(p.full_shape), "tp_dim": -1 if p.tp_dim is None else p.tp_dim}


def save(out_dir: str, step: int, tokens: int, model, opt, mesh, device, config: dict,
         tokenizer_path: str, keep_last: int = 0) -> str:
    """Every rank calls this. Returns the checkpoint directory."""
    root = ckpt_root(out_dir)
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, ".tmp_" + name), os.path.join(root, name)
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(mesh, device)
    shard_state = {
        "format": FORMAT, "rank": mesh.rank, "tp": mesh.tp, "tp_rank": mesh.tp_rank,
        "meta": {n: _meta(p) for n, p in model.named_parameters()},
        "model": {n: p.detach() for n, p in model.named_parameters()} if mesh.dp_rank == 0 else {},
        "optim": opt.export_state() if (opt.zero or mesh.dp_rank == 0) else {},
        "optim_step": opt.step_count,
        "sr_rng": opt.sr_generator.get_state() if opt.sr_generator is not None else None,
    }
    shard_state = device.to_host(shard_state)          # XLA: sync, then copies on the CPU
    _atomic_write(os.path.join(tmp, f"shard_{mesh.rank:05d}.pt"), lambda f: torch.save(shard_state, f))
    _barrier(mesh, device)
    if mesh.rank == 0:
        files = sorted(n for n in os.listdir(tmp) if n.endswith(".pt"))
        manifest = {
            "format": FORMAT, "step": step, "tokens": tokens, "time": time.time(),
            "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "zero1": bool(opt.zero)},
            "config": config, "tokenizer": tokenizer_path,
            "files": {n: os.path.getsize(os.path.join(tmp, n)) for n in files},
        }
        _atomic_write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        _fsync_dir(tmp)
        if os.path.exists(final):           # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _atomic_write(os.path.join(root, "latest"), lambda f: f.write(name.encode()))
        if keep_last > 0:
            for old in list_checkpoints(out_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(mesh, device)
    return final


def save_full(out_dir: str, model_cfg: ModelConfig, full_state: dict, tokenizer_path: str,
              step: int = 0, tokens: int = 0) -> str:
    """A one-process checkpoint of full weights, without optimizer state (HF import)."""
    root = ckpt_root(out_dir)
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, ".tmp_" + name), os.path.join(root, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {}
    for n, t in full_state.items():
        meta[n] = {"full_shape": list(t.shape), "tp_dim": -1}
    state = {"format": FORMAT, "rank": 0, "tp": 1, "tp_rank": 0, "meta": meta,
             "model": {n: t.detach().float().cpu().contiguous() for n, t in full_state.items()},
             "optim": {}, "optim_step": 0, "sr_rng": None}
    _atomic_write(os.path.join(tmp, "shard_00000.pt"), lambda f: torch.save(state, f))
    manifest = {"format": FORMAT, "step": step, "tokens": tokens, "time": time.time(),
                "layout": {"tp": 1, "pp": 1, "dp": 1, "zero1": False},
                "config": {"model": dataclasses.asdict(model_cfg), "train": {}},
                "tokenizer": tokenizer_path,
                "files": {"shard_00000.pt": os.path.getsize(os.path.join(tmp, "shard_00000.pt"))}}
    _atomic_write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write(os.path.join(root, "latest"), lambda f: f.write(name.encode()))
    return final


# -- load ------------------------------------------------------------------

def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, "manifest.json")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint manifest {mpath} is missing or unreadable ({e.__class__.__name__}); "
                        f"pick another checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{mpath} has format {manifest.get('format')}, this nanohlat reads {FORMAT}")
    return manifest


class ShardSet:
    """All shard files of one checkpoint, opened lazily (mmap) and checked."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = read_manifest(path)
        self.shards = []
        for name, size in self.manifest["files"].items():
            fpath = os.path.join(path, name)
            if not os.path.isfile(fpath):
                raise UserError(f"checkpoint shard {fpath} is missing; the checkpoint is incomplete, "
                                f"pick another one")
            if os.path.getsize(fpath) != size:
                raise UserError(f"checkpoint shard {fpath} has {os.path.getsize(fpath)} bytes, the manifest "
                                f"says {size}: the file is truncated or corrupt")
            try:
                self.shards.append(torch.load(fpath, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
                raise UserError(f"checkpoint shard {fpath} cannot be read ({e.__class__.__name__}); "
                                f"the file is corrupt") from None

    def check_model(self, cfg: ModelConfig) -> None:
        saved = self.manifest["config"]["model"]
        mine = dataclasses.asdict(cfg)
        diff = [k for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                            "vocab_multiple") if saved.get(k) != mine[k]]
        if diff:
            desc = ", ".join(f"{k} {saved.get(k)} vs {mine[k]}" for k in diff)
            raise UserError(f"checkpoint {self.path} is for a different model shape ({desc}: saved vs this run)")

    def full(self, name: str, section: str = "model", key: str | None = None) -> torch.Tensor | None:
        """Rebuild the full tensor `name` from the shards (None if not saved)."""
        out, found = None, False
        for sh in self.shards:
            if name not in sh[section]:
                continue
            meta = sh["meta"][name]
            full_shape, tp_dim, tp, tp_rank = meta["full_shape"], meta["tp_dim"], sh["tp"], sh["tp_rank"]
            local_shape = list(full_shape)
            if tp_dim >= 0:
                local_shape[tp_dim] //= tp
            if out is None:
                out = torch.zeros(full_shape, dtype=torch.float32)
            dst = out if tp_dim < 0 else out.narrow(tp_dim, tp_rank * local_shape[tp_dim], local_shape[tp_dim])
            entry = sh[section][name]
            if section == "model":
                dst.copy_(entry.float().view(local_shape))
            else:  # an optimizer piece: [start, stop) of the flattened tp-local tensor
                flat = dst.contiguous().view(-1)
                flat[entry["start"]:entry["stop"]] = entry[key].float()
                dst.copy_(flat.view(local_shape))
            found = True
        return out if found else None


@torch.no_grad()
def load(path: str, model, opt, mesh, device) -> dict:
    """Load a checkpoint saved with any layout into this rank's model and optimizer."""
    shards = ShardSet(path)
    shards.check_model(model.cfg)
    tp, tp_rank = mesh.tp, mesh.tp_rank
    for name, p in model.named_parameters():
        full = shards.full(name)
        if full is None:
            raise UserError(f"checkpoint {path} has no tensor {name!r}: a shard is missing or the model differs")
        p.copy_(shard(full, p.tp_dim, tp_rank, tp))
    params = dict(model.named_parameters())

    def local_flat(name, key):
        full = shards.full(name, "optim", key)
        if full is None:   # no optimizer state saved (e.g. imported weights): fresh moments
            return params[name].detach().float().reshape(-1).cpu() if key == "master" else \
                torch.zeros(params[name].numel())
        return shard(full, params[name].tp_dim, tp_rank, tp).reshape(-1)

    step_count = max((sh.get("optim_step", 0) for sh in shards.shards), default=0)
    opt.import_state(lambda n, k: local_flat(n, k).to(device.torch_device), step_count)
    layout = shards.manifest["layout"]
    same = (layout["tp"], layout["pp"], layout["dp"], layout["zero1"]) == (mesh.tp, mesh.pp, mesh.dp, opt.zero)
    if same and opt.sr_generator is not None:
        state = shards.shards[mesh.rank].get("sr_rng")
        if state is not None:
            opt.sr_generator.set_state(state)
    return shards.manifest


def load_for_inference(path: str, device) -> tuple:
    """(whole model on `device` in eval mode, manifest) from a run dir or checkpoint dir."""
    from .model import Transformer
    path = resolve(path)
    shards = ShardSet(path)
    cfg = model_from_dict(shards.manifest["config"]["model"])
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = shards.full(name)
            if full is None:
                raise UserError(f"checkpoint {path} has no tensor {name!r}: a shard is missing")
            p.copy_(full)
    model.to(device.torch_device).eval()
    return model, shards.manifest
