"""The resharding load: a checkpoint saved in any layout, into this one.

Resharding: a shard stores, for every tensor, the full shape, which dimension
was split over tp, into how many parts and which part it holds; ZeRO-1
optimizer pieces also store which [start, stop) of the flattened tp-local
parameter they cover. Loading rebuilds each full tensor one parameter at a
time from whichever shards hold it (checking that every element was found),
then cuts the part the *new* layout needs. Parameters are named by their
global layer (layers.5.attn.wq.weight), so where a stage's layers were (one
run, or interleaved chunks) does not matter to a load either.
"""

from __future__ import annotations

import os

import torch

from nanohlat import comm
from nanohlat.config import UserError
from nanohlat.run.checkpoint.manifest import (check_files, check_model, corrupt_error, corrupt_files, damaged,
                                             read_manifest)
from nanohlat.run.build import whole_params
from nanohlat.run.checkpoint.optimizer_state import import_state, state_buffers
from nanohlat.shard_spec import local_part


class ShardSet:
    """All shard files of one checkpoint, verified, then opened lazily (mmap).

    With a mesh, each rank hashes 1/world of the files and one all-reduce
    shares the verdict, so every rank raises the same error (no hang) while
    each byte is read for verification once per job, not once per rank.
    """

    def __init__(self, path: str, mesh=None, device=None, manifest: dict | None = None):
        self.path = path
        self.manifest = manifest if manifest is not None else read_manifest(path)   # (given: read already)
        check_files(path, self.manifest)
        names = sorted(self.manifest["files"])
        rank, world = (mesh.rank, mesh.world) if mesh is not None else (0, 1)
        mine = corrupt_files(path, self.manifest, rank, world)
        bad = torch.tensor([float(n in mine) for n in names])
        if world > 1:   # everyone learns every verdict
            bad = comm.all_reduce(bad.to(device.torch_device), mesh.group("world")).cpu()
        for name, b in zip(names, bad.tolist()):
            if b:
                raise corrupt_error(path, name)
        self.shards = {}
        for name in names:
            fpath = os.path.join(path, name)
            try:
                sh = torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
                raise UserError(f"checkpoint shard {fpath} cannot be read ({e.__class__.__name__}); "
                                f"the file is corrupt") from None
            if not isinstance(sh, dict) or not {"tp", "tp_rank", "meta", "model", "optim"} <= set(sh):
                raise UserError(f"checkpoint shard {fpath} is not a nanohlat shard")
            self.shards[fpath] = sh

    def shard_of_rank(self, rank: int) -> dict | None:
        for sh in self.shards.values():
            if sh.get("rank") == rank:
                return sh
        return None

    def full(self, name: str, section: str = "model", key: str | None = None) -> torch.Tensor | None:
        """Rebuild the full fp32 tensor `name` from the shards (None if no shard holds it).

        section "model": each holder has its tp chunk; "optim": each holder has
        [start, stop) of its tp chunk flattened (key: master | exp_avg | exp_avg_sq).
        Raises if some element was in no shard: a silent zero would be a wrong model.
        """
        out = covered = None
        for fpath, sh in self.shards.items():
            entry = sh[section].get(name)
            if entry is None:
                continue
            try:
                meta = sh["meta"][name]
                full_shape, tp_dim = meta["full_shape"], meta["tp_dim"]
                parts, part = meta.get("parts", sh["tp"]), meta.get("part", sh["tp_rank"])   # older: tp chunks
                if out is None:
                    out = torch.zeros(full_shape, dtype=torch.float32)
                    covered = torch.zeros(full_shape, dtype=torch.bool)
                if list(out.shape) != list(full_shape):
                    raise ValueError("shards disagree on the full shape")
                # exercise 8a: begin
                dst, cov = out, covered                        # this shard's part, as views
                if tp_dim >= 0:
                    size = full_shape[tp_dim] // parts
                    dst, cov = out.narrow(tp_dim, part * size, size), covered.narrow(tp_dim, part * size, size)
                # exercise 8a: end
                if section == "model":
                    if list(entry.shape) != list(dst.shape):
                        raise ValueError(f"shape {list(entry.shape)}, expected {list(dst.shape)}")
                    dst.copy_(entry)
                    cov.fill_(True)
                else:
                    start, stop, piece = entry["start"], entry["stop"], entry[key]
                    if piece.numel() != stop - start or not 0 <= start < stop <= dst.numel():
                        raise ValueError(f"piece [{start}, {stop}) does not fit {list(dst.shape)}")
                    # the chunk may be strided (narrowed along dim > 0): edit a contiguous copy
                    flat, flat_cov = dst.contiguous().view(-1), cov.contiguous().view(-1)
                    flat[start:stop] = piece.float()
                    flat_cov[start:stop] = True
                    dst.copy_(flat.view(dst.shape))
                    cov.copy_(flat_cov.view(cov.shape))
            except NotImplementedError:   # (a RuntimeError) unfinished code, not the file's fault:
                raise                        # a student copy's stub of exercise 8a names itself
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                first_line = (str(e).splitlines() or [e.__class__.__name__])[0]
                raise UserError(f"checkpoint shard {fpath}: {section} tensor {name!r} is malformed "
                                f"({first_line}); the file is corrupt") from None
        if out is not None and not bool(covered.all()):
            raise UserError(f"checkpoint {self.path}: {section} tensor {name!r} is incomplete "
                            f"({int((~covered).sum())} elements in no shard); a shard is missing")
        return out

    def tensor(self, name: str, full_shape, section: str = "model", key: str | None = None) -> torch.Tensor:
        """full(), required to exist and to have `full_shape` (the model being loaded)."""
        t = self.full(name, section, key)
        if t is None:
            raise UserError(f"checkpoint {self.path} has no {section} tensor {name!r}: a shard is missing "
                            f"or the model differs")
        if list(t.shape) != list(full_shape):   # (the model's shape fields are the manifest's: check_model)
            raise damaged(os.path.join(self.path, "manifest.json"), f"its config.model makes {name!r} "
                          f"{list(full_shape)}, its shards hold {list(t.shape)}")
        return t


@torch.no_grad()
def load_buffers(shards: ShardSet, model) -> None:
    """The model's state besides its parameters (optimizer_state.state_buffers: a mixture's expert
    biases), whole on every rank. One the checkpoint lacks keeps its value as built (a run saved
    without --moe-bias-rate resumed with it: its biases start at zero, as a new run's)."""
    for name, b in state_buffers(model).items():
        t = shards.full(name)
        if t is not None:
            if list(t.shape) != list(b.shape):
                raise UserError(f"checkpoint {shards.path}: {name!r} is {list(t.shape)}, this model's "
                                f"{list(b.shape)}; the checkpoint is for another model")
            if not bool(torch.isfinite(t).all()):   # (an older nanohlat took --moe-bias-rate 1e39: inf, then NaN)
                raise UserError(f"checkpoint {shards.path} has non-finite expert biases (NaN or inf) in {name}: its "
                                f"run moved them by a --moe-bias-rate so large that they overflowed (train.py refuses "
                                f"one above 1 now) and its routing is lost; train it again with a --moe-bias-rate "
                                f"of at most 1 (DeepSeek-V3: 1e-3), or use a checkpoint saved before they overflowed")
            b.copy_(t.to(b.dtype))


@torch.no_grad()
def load(path: str, model, opt, mesh, device) -> dict:
    """Load a checkpoint saved with any layout into this rank's model and
    optimizer (every rank calls this). Returns the manifest."""
    shards = ShardSet(path, mesh, device)
    check_model(path, shards.manifest, model.cfg)
    params = dict(model.named_parameters())
    with whole_params(opt):          # ZeRO-3: the parameters' storage back while they are written
        for name, p in params.items():   # one full tensor at a time, cut to this rank's part
            p.copy_(local_part(shards.tensor(name, p.shard.full_shape), p))
    load_buffers(shards, model)

    if shards.manifest.get("optimizer", True):
        def local_flat(name, key):
            p = params[name]
            return local_part(shards.tensor(name, p.shard.full_shape, "optim", key), p).reshape(-1)
    else:   # weights only (e.g. imported from Hugging Face): master = weights, fresh moments
        def local_flat(name, key):
            p = params[name]
            return p.detach().float().reshape(-1).cpu() if key == "master" else torch.zeros(p.numel())
    step_count = shards.manifest.get("schedule", {}).get("optimizer_step", 0)
    import_state(opt, lambda n, k: local_flat(n, k).to(device.torch_device), step_count)

    # The torch CPU generator is per rank: restore it only where ranks mean the
    # same thing as when saved. (The stochastic-rounding noise needs none: it
    # follows from the seed, the optimizer step and the element, in any layout.)
    layout = shards.manifest["layout"]
    zero = layout["zero"] if "zero" in layout else int(layout["zero1"])   # (before ZeRO-2: only zero1)
    if (layout["tp"], layout["pp"], layout["dp"], layout.get("cp", 1), zero) == (mesh.tp, mesh.pp, mesh.dp, opt.tcfg.cp,
                                                                                 opt.tcfg.zero):
        rng = (shards.shard_of_rank(mesh.rank) or {}).get("rng") or {}
        if rng.get("torch_cpu") is not None:
            torch.set_rng_state(rng["torch_cpu"])
    return shards.manifest
