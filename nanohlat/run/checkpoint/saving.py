"""The save protocol: every rank its shard, then the manifest, atomically.

Atomicity: every rank writes its shard into `.tmp_step_...` under a
temporary name, fsync'd, then renamed; an all-gather tells rank 0 that every
shard is complete (and each file's checksum); rank 0 then writes the manifest
the same way, renames the directory into place and only then updates
`latest`. A crash at any moment leaves at most a `.tmp_` directory that
nothing reads (the next save removes it) and the previous checkpoint intact.
Old checkpoints are removed by renaming them away first, so a crash during a
removal never leaves a half-deleted directory that looks complete.

Every element is written once: model weights by dp rank 0 of each (pp, tp)
coordinate, optimizer state by every rank that owns some (all dp ranks with
ZeRO-1), and a tensor that several tp ranks hold identically (norm gains; a
kv head shared by several ranks when tp > n_kv_heads) only by the first of
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time

import torch

from nanohlat import comm
from nanohlat.config import UserError
from nanohlat.recipe import ModelConfig
from nanohlat.run.checkpoint.history import (ckpt_root, incomplete_checkpoints, list_checkpoints, remove_checkpoint,
                                             set_aside_newer)
from nanohlat.run.checkpoint.io_errors import io_error, state_bytes
from nanohlat.run.checkpoint.manifest import FORMAT, RNG, TOKENIZER_COPY, identity
from nanohlat.run.checkpoint.optimizer_state import export_state, export_weights, fetch_buffers, state_buffers
from nanohlat.run import faults
from nanohlat.system.files import atomic_write as _atomic_write   # module-level name: tests swap it to simulate crashes
from nanohlat.system.files import fsync_dir, sha256_file
from nanohlat.xla import extract_graphs_only


def _barrier(mesh, device) -> None:
    """All ranks reach this point (an all-reduce: barrier() is a no-op on xla)."""
    g = mesh.group("world")
    if g.size > 1:
        comm.all_reduce(torch.zeros(1, device=device.torch_device), g)
        device.sync()


def _meta(p) -> dict:
    s = p.shard   # the file keeps its own names: tp_dim (-1: replicated), parts, part
    return {"full_shape": list(s.full_shape), "tp_dim": -1 if s.dim is None else s.dim,
            "parts": s.parts, "part": s.part}


def _first_copy(p, mesh) -> bool:
    """Whether this tp rank is the first of those holding p's part (they save it)."""
    if p.shard.group != "tp":   # cut over another group (the experts over ep): whole on every tp rank
        return mesh.tp_rank == 0
    copies = mesh.tp // p.shard.parts
    return mesh.tp_rank == p.shard.part * copies


def _first_replica(p, mesh) -> bool:
    """Whether this rank is the first of those holding the same part of p: rank 0 of the group its gradient
    is summed over (mesh.grad_group: dp, with --cp dp x cp; cut over another group, as the experts over ep:
    the ranks holding the same part, '<group>_dp', optim.FlatAdamW)."""
    return (mesh.grad_group if p.shard.group == "tp" else mesh.group(p.shard.group + "_dp")).rank == 0


def _begin(out_dir: str, step: int) -> str:
    """(One process) a fresh `.tmp_step_N` directory; removes debris of crashed saves."""
    root = ckpt_root(out_dir)
    os.makedirs(root, exist_ok=True)
    for debris in os.listdir(root):
        if debris.startswith((".tmp_", ".trash_")):
            path = os.path.join(root, debris)
            if os.path.islink(path):    # a link is removed, never followed (nanohlat makes none)
                os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
    tmp = os.path.join(root, f".tmp_step_{step:08d}")
    os.makedirs(tmp)
    return tmp


def _publish(out_dir: str, tmp: str, manifest: dict) -> str:
    """(One process, every shard in `tmp` complete) manifest, rename, `latest`."""
    root, name = ckpt_root(out_dir), f"step_{manifest['step']:08d}"
    _atomic_write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    set_aside_newer(out_dir, manifest["step"])   # an abandoned future (or this very step, saved before): kept
    for path in incomplete_checkpoints(out_dir):   # a step_ folder without manifest, after a crash or damage
        if path != tmp:
            remove_checkpoint(path)
    os.replace(tmp, os.path.join(root, name))    # the checkpoint appears whole, or not at all
    fsync_dir(root)
    _atomic_write(os.path.join(root, "latest"), lambda f: f.write(name.encode()))
    return os.path.join(root, name)


def _copy_tokenizer(tokenizer_path: str, ckpt_dir: str) -> dict:
    """A copy of the run's tokenizer inside the checkpoint: the manifest's
    `tokenizer` path points into a cache that may be cleared, or stay behind
    on another machine, and without its tokenizer a model's token ids mean
    nothing. `read_manifest` prefers the copy."""
    with open(tokenizer_path, "rb") as f:
        blob = f.read()
    _atomic_write(os.path.join(ckpt_dir, TOKENIZER_COPY), lambda f: f.write(blob))
    return {"file": TOKENIZER_COPY, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


@dataclasses.dataclass
class Snapshot:
    """One rank's part of the checkpoint of `step`, taken at the step's end (`snapshot`): its shard's
    tensors, copies in host memory that training may go on updating the originals of, and on rank 0
    the manifest's fields (all but the files' sizes and checksums, the tokenizer's copy and the time)."""
    out_dir: str
    step: int
    rank: int
    shard: dict
    manifest: dict | None
    tokenizer_path: str
    keep_last: int

    @property
    def tmp(self) -> str:
        return os.path.join(ckpt_root(self.out_dir), f".tmp_step_{self.step:08d}")

    @property
    def final(self) -> str:
        return os.path.join(ckpt_root(self.out_dir), f"step_{self.step:08d}")

    def nbytes(self) -> int:
        return state_bytes(self.shard)


def begin(out_dir: str, step: int, mesh, device) -> None:
    """Every rank: rank 0 makes `.tmp_step_N` (removing a crashed save's debris), then all wait for it."""
    if mesh.rank == 0:
        _begin(out_dir, step)
    _barrier(mesh, device)


def snapshot(out_dir: str, step: int, tokens: int, model, opt, mesh, config: dict, tokenizer_path: str,
             keep_last: int = 0, bad_steps: int = 0, data_fingerprint: str | None = None) -> Snapshot | None:
    """This rank's shard of the checkpoint of `step` copied to host memory, with what its manifest says
    (rank 0). None while neuron_parallel_compile extracts graphs (its tensors hold zeros, not weights)."""
    # every rank: its shard (each element once, module docstring)
    params = dict(model.named_parameters())
    mine = {n for n, p in params.items() if _first_copy(p, mesh)}
    shard_state = {
        "format": FORMAT, "rank": mesh.rank, "tp": mesh.tp, "tp_rank": mesh.tp_rank,
        "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank,
        "meta": {n: _meta(p) for n, p in params.items()},
        "rng": {"torch_cpu": torch.get_rng_state()},   # (SR noise follows from seed and step: precision.py)
    }
    host = fetch_buffers(opt)                          # XLA: sync, then one transfer to the CPU
    shard_state["model"] = {n: w for n, w in export_weights(opt, host).items()
                            if n in mine and _first_replica(params[n], mesh)}
    shard_state["optim"] = {n: v for n, v in export_state(opt, host).items()
                            if n in mine and (opt.zero or _first_replica(params[n], mesh))}
    # the model's state besides its parameters (a mixture's expert biases, --moe-bias-rate): the
    # optimizer holds none of it; the same on every rank of a stage, so saved by its first
    buffers = state_buffers(model)
    shard_state["meta"].update({n: {"full_shape": list(b.shape), "tp_dim": -1, "parts": 1, "part": 0}
                                for n, b in buffers.items()})
    if mesh.tp_rank == 0 and mesh.grad_group.rank == 0:
        shard_state["model"].update({n: b.detach().float().cpu().clone() for n, b in buffers.items()})
    if extract_graphs_only():
        # neuron_parallel_compile's trial run: tensors hold zeros, not weights. The
        # transfer above has been traced (so its graph is pre-compiled too); writing
        # it would leave a `latest` that a later --resume auto starts from, at zero.
        if mesh.rank == 0:
            shutil.rmtree(os.path.join(ckpt_root(out_dir), f".tmp_step_{step:08d}"), ignore_errors=True)
        return None
    manifest = None
    if mesh.rank == 0:
        manifest = {
            "format": FORMAT, "step": step, "tokens": tokens,
            "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "cp": opt.tcfg.cp,   # world = tp*pp*dp*cp
                       "zero": opt.tcfg.zero,                             # the ZeRO stage, 0-3
                       "zero1": bool(opt.zero), "world": mesh.world,      # (zero1: any stage >= 1; older readers)
                       "virtual_stages": opt.tcfg.virtual_stages},   # interleaved: stage s held chunks s, s+pp, ...
            # the lr of step k is optim.cosine_lr(k, lr, min_lr, warmup_steps, steps) of the config below
            "schedule": {"optimizer_step": int(opt.step_count), "bad_steps": int(bad_steps)},
            # the global batch of step k is Dataset.batch(k, ...) with this seed: the next one is `step`
            "data": {"next_step": step, "seed": config.get("train", {}).get("seed")},
            # what each shard's "rng" holds; stochastic rounding has no generator (precision.py)
            "rng": RNG,
            "optimizer": True, "config": config, "tokenizer": tokenizer_path,
            "identity": identity(tokenizer_path, data_fingerprint),
        }
    return Snapshot(out_dir, step, mesh.rank, shard_state, manifest, tokenizer_path, keep_last)


def write_shard(snap: Snapshot) -> tuple[torch.Tensor, UserError | None]:
    """This rank's shard -> .tmp_step_N/shard_<rank>.pt (temporary name, fsync, rename: files.atomic_write).
    Returns its sha256 as 4 int64, or zeros and the failure (a full disk, an I/O error) as one line.
    Touches no process group: --async-save runs it in its writer thread."""
    shard_path = os.path.join(snap.tmp, f"shard_{snap.rank:05d}.pt")
    try:
        # (the fault lab's full disk or kill -9 half-way through: faults.writer, run/faults.py)
        _atomic_write(shard_path, lambda f: torch.save(snap.shard, faults.writer(f, snap.step, snap.rank,
                                                                                 snap.nbytes())))
        return torch.frombuffer(bytearray.fromhex(sha256_file(shard_path)), dtype=torch.int64), None
    except (OSError, RuntimeError) as e:
        return torch.zeros(4, dtype=torch.int64), io_error(e, shard_path, snap.nbytes())


def gather_shards(snap: Snapshot, digest: torch.Tensor, failed: UserError | None, mesh, device) -> torch.Tensor:
    """Every rank (a collective): rank 0 learns that every shard is on disk, and its checksum: one
    all-gather of each rank's sha256 (32 bytes as 4 int64) and a failure flag; it doubles as the
    barrier. Returns the rows, (world, 5): a row's last element 1 where that rank could not write."""
    row = torch.cat([digest, torch.tensor([int(failed is not None)])])
    return comm.all_gather(row.to(device.torch_device), mesh.group("world")).cpu().view(mesh.world, 5)


def publish(snap: Snapshot, rows: torch.Tensor) -> UserError | None:
    """(Rank 0, every shard complete: `rows` from gather_shards) the tokenizer's copy, the manifest, the
    rename into place, `latest`, then --keep-last's pruning. Returns the failure as one line, or None."""
    tmp = snap.tmp
    try:
        tokenizer_copy = _copy_tokenizer(snap.tokenizer_path, tmp)
        files = {f"shard_{r:05d}.pt": {"bytes": os.path.getsize(os.path.join(tmp, f"shard_{r:05d}.pt")),
                                       "sha256": rows[r, :4].numpy().tobytes().hex()} for r in range(rows.shape[0])}
        _publish(snap.out_dir, tmp, {**snap.manifest, "time": time.time(), "files": files,
                                     "tokenizer_copy": tokenizer_copy})
    except (OSError, RuntimeError) as e:
        return io_error(e, tmp, 0)
    if snap.keep_last > 0:
        for old in list_checkpoints(snap.out_dir)[:-snap.keep_last]:
            remove_checkpoint(old)
    return None


def save(out_dir: str, step: int, tokens: int, model, opt, mesh, device, config: dict,
         tokenizer_path: str, keep_last: int = 0, bad_steps: int = 0, data_fingerprint: str | None = None) -> str:
    """Every rank calls this after `step` optimizer steps. Returns the checkpoint directory.

    keep_last > 0 keeps only that many newest checkpoints; bad_steps is the
    current run of non-finite steps (restored on resume); data_fingerprint
    identifies the token shards (data.Dataset.fingerprint). The steps in
    order: begin, snapshot, write_shard, gather_shards, publish (rank 0), and
    an all-reduce that tells every rank the checkpoint is visible (or not).
    """
    begin(out_dir, step, mesh, device)
    snap = snapshot(out_dir, step, tokens, model, opt, mesh, config, tokenizer_path, keep_last, bad_steps,
                    data_fingerprint)
    final = os.path.join(ckpt_root(out_dir), f"step_{step:08d}")
    if snap is None:
        return final
    # 1. every rank: its shard -> .tmp_step_N/shard_<rank>.pt; a full disk or an I/O error is said by
    #    every rank after the all-gather below
    digest, failed = write_shard(snap)
    # 2. rank 0 learns that every shard is on disk, and its checksum
    rows = gather_shards(snap, digest, failed, mesh, device)
    if failed is not None or rows[:, 4].any():   # every rank leaves: no rank waits for a checkpoint that is not coming
        _abandon(snap.tmp, mesh)
        raise failed or UserError(f"checkpoint step {step} not saved: another rank could not write its shard "
                                  f"(its line says why); {final} was not written, the previous checkpoint is intact")
    # 3. rank 0: the tokenizer's copy, manifest, rename into place, update `latest`, prune
    failed = publish(snap, rows) if mesh.rank == 0 else None
    # no rank goes on (or reports success) before the checkpoint is visible; a failure reaches every rank
    flag = torch.tensor([float(failed is not None)], device=device.torch_device)
    if mesh.group("world").size > 1:
        comm.all_reduce(flag, mesh.group("world"))
        device.sync()
    if flag.item():
        _abandon(snap.tmp, mesh)
        raise failed or UserError(f"checkpoint step {step} not saved: rank 0 could not write it (its line says "
                                  f"why); {final} was not written, the previous checkpoint is intact")
    return final


def _abandon(tmp: str, mesh) -> None:
    """A failed save: every rank removes what it wrote, rank 0 the whole `.tmp_step_N`."""
    shard = os.path.join(tmp, f"shard_{mesh.rank:05d}.pt")
    for path in (shard, shard + ".partial"):
        with contextlib.suppress(OSError):
            os.remove(path)
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def save_full(out_dir: str, model_cfg: ModelConfig, full_state: dict, tokenizer_path: str,
              step: int = 0, tokens: int = 0) -> str:
    """A one-process checkpoint of full weights, without optimizer state (HF import)."""
    tmp = _begin(out_dir, step)
    state = {"format": FORMAT, "rank": 0, "tp": 1, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0,
             "meta": {n: {"full_shape": list(t.shape), "tp_dim": -1} for n, t in full_state.items()},
             "model": {n: t.detach().float().cpu().contiguous() for n, t in full_state.items()},
             "optim": {}, "rng": {"torch_cpu": None}}
    shard_path = os.path.join(tmp, "shard_00000.pt")
    _atomic_write(shard_path, lambda f: torch.save(state, f))
    tokenizer_copy = _copy_tokenizer(tokenizer_path, tmp)
    return _publish(out_dir, tmp, {
        "format": FORMAT, "step": step, "tokens": tokens, "time": time.time(),
        "layout": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "zero1": False, "world": 1, "virtual_stages": 1},
        "schedule": {"optimizer_step": 0, "bad_steps": 0}, "data": {"next_step": step, "seed": None},
        "optimizer": False,     # training from here starts with fresh Adam moments
        "config": {"model": dataclasses.asdict(model_cfg), "train": {}}, "tokenizer": tokenizer_path,
        "tokenizer_copy": tokenizer_copy, "identity": identity(tokenizer_path, None),
        "files": {"shard_00000.pt": {"bytes": os.path.getsize(shard_path), "sha256": sha256_file(shard_path)}},
    })
