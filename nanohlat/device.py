"""Devices: the one module that knows which backend we run on (docs/design.md section 3).

                 CPU (laptop, CI)   CUDA                trn1 (torch-neuronx 2.9)
    device       cpu                cuda:<local_rank>   torch_xla.device()
    backend      gloo               nccl                xla
    step end     nothing            nothing             torch_xla.sync()

Everything else in nanohlat asks a `Device` instead of naming a backend, so
the same parallel code runs everywhere. A `Device` is the per-step contract:
`torch_device`, `place`, `sync`, `add_step_closure`, `checkpoint` and the
process groups. How each is done on XLA (torch_xla's calls, the Neuron
runtime's switches, host copies, graph counts) is in `xla.py`, which imports
torch_xla only inside its functions: a CPU or CUDA run never loads it.

Order of calls on xla: get_device() -> init_process_group() -> anything that
touches tensors. Under torchrun the xla rendezvous configures which cores this
process owns, which must happen before the XLA runtime starts; so the xla
device itself is created lazily, on first use of `torch_device`. The Neuron
runtime's rounding mode (--precision bf16-sr) is also fixed at start-up, so
`get_device` sets it. How to run all this on a trn1: docs/trn1.md.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from nanohlat import xla
from nanohlat.config import DEVICES, UserError


def set_cpu_threads(n: int) -> None:
    """Threads for CPU math in this process. With several workers on one
    machine each must get its share, or they oversubscribe the cores and every
    step slows down. PyTorch allows the inter-op pool to be sized only once,
    before any parallel work, so later calls change the intra-op pool only."""
    if n < 1:
        raise UserError(f"--threads must be at least 1 per worker, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # sized already, or parallel work already ran in this process: torch refuses
        pass


class Device:
    """Where tensors live, and how a step ends, logs, recomputes activations and forms process groups."""

    def __init__(self, kind: str, torch_device: torch.device | None, backend: str, name: str,
                 local_rank: int = 0):
        self.kind = kind              # 'cpu' | 'cuda' | 'xla'
        self.backend = backend        # 'gloo' | 'nccl' | 'xla'
        self.name = name              # key into metrics.PEAK_FLOPS
        self.local_rank = local_rank
        self._torch_device = torch_device  # None on xla until first used
        self._timeout = None          # a collective's timeout, once init_process_group is given one

    @property
    def torch_device(self) -> torch.device:
        if self._torch_device is None:
            self._torch_device = xla.torch_device()  # starts the XLA runtime
        return self._torch_device

    def __repr__(self) -> str:
        where = self._torch_device if self._torch_device is not None else "xla (not started)"
        return f"Device({where}, backend={self.backend}, name={self.name})"

    def place(self, module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """module.to(this device, dtype), keeping what parameters carry besides
        their values: `p.shard`, how the parameter is split over tp ranks
        (shard_spec.py:ShardSpec). Moving to CPU or CUDA swaps the data
        inside the same Parameter objects; moving to XLA makes *new* Parameters
        (an XLA tensor cannot share a CPU tensor's internals), which would
        silently drop that attribute. So copy it over, by parameter name."""
        shards = {name: p.shard for name, p in module.named_parameters() if hasattr(p, "shard")}
        module.to(device=self.torch_device, dtype=dtype)
        for name, p in module.named_parameters():
            if name in shards:
                p.shard = shards[name]
        return module

    # -- the step ------------------------------------------------------------

    def sync(self) -> None:
        """Step boundary: on xla, compile (if new) and run the recorded graph.
        CPU and CUDA execute eagerly, so there is nothing to do."""
        if self.kind == "xla":
            xla.sync()

    def add_step_closure(self, fn, *args) -> None:
        """Run fn(*args) once the current step's values exist. On xla it is
        queued and runs inside the next sync(), after the graph has executed,
        so reading tensors there (loss.item()) costs a copy but no extra graph
        run; calling .item() in the step would cut the graph and run it twice.
        Eager backends have the values already, so it runs now."""
        if self.kind == "xla":
            xla.add_step_closure(fn, args)
        else:
            fn(*args)

    def checkpoint(self, fn, *args):
        """Activation checkpointing: keep only fn's inputs, recompute its
        activations in backward (on xla: `xla.checkpoint`, which keeps the
        compiler from undoing it)."""
        if not torch.is_grad_enabled():  # evaluation: nothing to save memory on
            return fn(*args)
        if self.kind == "xla":
            return xla.checkpoint(fn, *args)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    # -- processes and groups ------------------------------------------------

    def init_process_group(self, rank: int, world_size: int, timeout_s: float | None = None) -> None:
        """Join the job. gloo/nccl rendezvous through env:// (MASTER_ADDR and
        MASTER_PORT, set by the launcher). xla takes rank and world size from
        its own runtime (xla://; under torchrun on trn1).

        `timeout_s` (--collective-timeout): on gloo and nccl a collective
        that waits longer than this for a peer raises instead of waiting
        forever (torch's default is 30 minutes; `new_group` passes it on to
        every group). Not applied on xla, whose runtime has its own."""
        self._timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        if self.kind == "xla":
            xla.init_process_group()
        else:
            if self.kind == "cuda":
                # nccl binds each process to "the current device": make it ours
                # before the first communicator is created.
                torch.cuda.set_device(self.torch_device)
            dist.init_process_group(self.backend, rank=rank, world_size=world_size, timeout=self._timeout)
        # torch_xla on CPU (and xla runs not started by torchrun) silently
        # form a world of 1: every rank would then train alone on the whole
        # batch and never communicate. Refuse rather than mislead.
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            got = (dist.get_rank(), dist.get_world_size())
            dist.destroy_process_group()
            raise RuntimeError(f"{self.backend} process group gave rank {got[0]} of {got[1]}, expected rank "
                               f"{rank} of {world_size}: start xla jobs with torchrun, or use --device cpu "
                               f"(gloo) to test")

    def new_group(self, ranks: list[int], partition: list[list[int]]):
        """Process group for `ranks`, one group of `partition` (all groups of
        that kind, e.g. every tp group). Every rank must call this for every
        group, in the same order (on xla each group is also told the whole
        partition: `xla.new_group`)."""
        ranks = list(ranks)
        if ranks not in [list(g) for g in partition]:
            raise ValueError(f"ranks {ranks} are not one of the groups in partition {partition}")
        if len({len(g) for g in partition}) != 1:
            raise ValueError(f"groups in a partition must have equal sizes, got {partition}")
        if self.kind == "xla":
            return xla.new_group(ranks, partition)
        return dist.new_group(ranks, timeout=self._timeout)

    # -- randomness --------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        """Seed every generator this process draws from (train() calls it with --seed)."""
        torch.manual_seed(seed)  # CPU generator and every CUDA device
        if self.kind == "xla":
            import torch_xla
            torch_xla.manual_seed(seed, self.torch_device)  # XLA keeps its own RNG state


def _cuda_name(index: int) -> str:
    # torch reports e.g. "NVIDIA H100 80GB HBM3"; PCIe/NVL H100s have lower
    # peaks than the SXM figure in metrics.PEAK_FLOPS, so they stay 'unknown'.
    full = torch.cuda.get_device_name(index)
    for name in ("A100", "H200", "H100"):
        if name in full and not (name == "H100" and ("PCIe" in full or "NVL" in full)):
            return name
    return "unknown"


def check_available(kind: str, workers: int = 1) -> None:
    """Refuse, as one line, a --device that this machine cannot give `workers`
    local processes, without creating anything: train.py's pre-flight asks
    before it writes into out-dir (and before --overwrite removes an old run)."""
    if kind not in DEVICES:
        raise UserError(f"--device {kind!r} is not one of {', '.join(DEVICES)}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA GPU; "
                            f"install a CUDA build of torch on a GPU machine, or use --device cpu")
        if workers > torch.cuda.device_count():
            raise UserError(f"{workers} workers need a GPU each but only {torch.cuda.device_count()} are "
                            f"visible; start at most that many workers per machine")
    if kind == "xla":
        xla.require_installed()


def resolve_kind(kind: str) -> str:
    """--device as a kind: 'auto' prefers Trainium (torch-neuronx installed, or
    PJRT_DEVICE set with torch_xla installed), then CUDA, then CPU."""
    if kind != "auto":
        return kind
    if xla.preferred():
        return "xla"
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_device(kind: str = "auto", local_rank: int = 0, precision: str | None = None) -> Device:
    """The device for this process (`resolve_kind` decides what 'auto' means).

    `precision` (the --precision of a training run) matters on Trainium only:
    it decides the Neuron runtime's rounding mode, which must be set before
    the runtime starts (see `xla.set_neuron_rounding`)."""
    kind = resolve_kind(kind)
    check_available(kind, local_rank + 1)   # an unknown name, no GPU, no torch_xla: one line

    if kind == "cpu":
        return Device("cpu", torch.device("cpu"), "gloo", "cpu", local_rank)

    if kind == "cuda":
        return Device("cuda", torch.device("cuda", local_rank), "nccl", _cuda_name(local_rank), local_rank)

    name = xla.device_name()
    if name == xla.NEURON and precision is not None:
        xla.set_neuron_rounding(precision)
    return Device("xla", None, "xla", name, local_rank)
