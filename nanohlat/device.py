"""Devices: the one module that knows which backend we run on (DESIGN section 3).

                 CPU (laptop, CI)   CUDA                trn1 (torch-neuronx 2.9)
    device       cpu                cuda:<local_rank>   torch_xla.device()
    backend      gloo               nccl                xla
    step end     nothing            nothing             torch_xla.sync()

Everything else in nanohlat asks a `Device` instead of naming a backend, so
the same parallel code runs everywhere. torch_xla is imported only when the
xla device is asked for (or detected): a CPU or CUDA run never pays for it,
and never needs it installed.

Why XLA is different: torch_xla is *lazy*. Tensor ops only record a graph;
`torch_xla.sync()` compiles it (once per distinct graph, minutes on Neuron)
and runs it. Hence the rules the rest of the code follows: sync once per step,
read values on the host only in step closures or at checkpoints, and keep every
step's graph identical so nothing compiles after the first steps.

Order of calls on xla: get_device() -> init_process_group() -> anything that
touches tensors. Under torchrun the xla rendezvous configures which cores this
process owns, which must happen before the XLA runtime starts; so the xla
device itself is created lazily, on first use of `torch_device`. The Neuron
runtime's rounding mode (--precision bf16-sr) is also fixed at start-up, so
`get_device` sets it. How to run all this on a trn1: docs/trn1.md.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from nanohlat.config import UserError

_XLA_INSTALL_HINT = ("install torch_xla matching torch: `pip install torch==2.9.0 torch_xla==2.9.0`; "
                     "on trn1 install torch-neuronx 2.9 from the Neuron pip repository")


def _installed(module: str) -> bool:
    # find_spec looks for the package on sys.path without importing it.
    return importlib.util.find_spec(module) is not None


def extract_graphs_only() -> bool:
    """True while `neuron_parallel_compile` traces the script to extract its
    graphs. Tensors then hold zeros, not results, so value-dependent logic
    (NaN checks, early stopping, loss-based decisions) must be skipped."""
    return os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "") not in ("", "0")


_interop_threads_set = False


def set_cpu_threads(n: int) -> None:
    """Threads for CPU math in this process. With several workers on one
    machine each must get its share, or they oversubscribe the cores and every
    step slows down. PyTorch allows the inter-op pool to be sized only once,
    before any parallel work, so later calls change the intra-op pool only."""
    global _interop_threads_set
    if n < 1:
        raise UserError(f"--threads must be at least 1 per worker, got {n}")
    torch.set_num_threads(n)
    if not _interop_threads_set:
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:  # parallel work already ran in this process
            pass
        _interop_threads_set = True


class Device:
    """Where tensors live and how the step, collectives and host copies work."""

    def __init__(self, kind: str, torch_device: torch.device | None, backend: str, name: str,
                 local_rank: int = 0):
        self.kind = kind              # 'cpu' | 'cuda' | 'xla'
        self.backend = backend        # 'gloo' | 'nccl' | 'xla'
        self.name = name              # key into metrics.PEAK_FLOPS
        self.local_rank = local_rank
        self._torch_device = torch_device  # None on xla until first used

    @property
    def torch_device(self) -> torch.device:
        if self._torch_device is None:
            import torch_xla
            self._torch_device = torch_xla.device()  # starts the XLA runtime
        return self._torch_device

    def __repr__(self) -> str:
        where = self._torch_device if self._torch_device is not None else "xla (not started)"
        return f"Device({where}, backend={self.backend}, name={self.name})"

    @property
    def hardware_stochastic_rounding(self) -> bool:
        """True on Trainium, whose runtime rounds fp32 -> bf16 stochastically
        for --precision bf16-sr (see `_neuron_rounding`). Elsewhere, including
        torch_xla on the CPU, bf16-sr is done in software (precision.py)."""
        return self.kind == "xla" and self.name == "NeuronCore-v2"

    def place(self, module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """module.to(this device, dtype), keeping what parameters carry besides
        their values (`tp_dim`, `full_shape`, `sequence_parallel`: see
        tensor_parallel.py). Moving to CPU or CUDA swaps the data inside the
        same Parameter objects; moving to XLA makes *new* Parameters (an XLA
        tensor cannot share a CPU tensor's internals), which would silently
        drop those attributes. So copy them over, by parameter name."""
        extras = {name: dict(vars(p)) for name, p in module.named_parameters()}
        module.to(device=self.torch_device, dtype=dtype)
        for name, p in module.named_parameters():
            for key, value in extras[name].items():
                setattr(p, key, value)
        return module

    # -- the step ------------------------------------------------------------

    def sync(self) -> None:
        """Step boundary: on xla, compile (if new) and run the recorded graph.
        CPU and CUDA execute eagerly, so there is nothing to do."""
        if self.kind == "xla":
            import torch_xla
            if hasattr(torch_xla, "sync"):
                torch_xla.sync()
            else:  # torch_xla older than 2.4 only had mark_step
                import torch_xla.core.xla_model as xm
                xm.mark_step()

    def add_step_closure(self, fn, *args) -> None:
        """Run fn(*args) once the current step's values exist. On xla it is
        queued and runs inside the next sync(), after the graph has executed,
        so reading tensors there (loss.item()) costs a copy but no extra graph
        run; calling .item() in the step would cut the graph and run it twice.
        Eager backends have the values already, so it runs now."""
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm
            xm.add_step_closure(fn, args)
        else:
            fn(*args)

    def to_host(self, obj):
        """CPU copies of every tensor in a nested dict/list/tuple (for checkpoints).
        Always copies, even on the CPU, so the snapshot does not change when
        training goes on updating the original tensors in place.

        On xla: sync first, so pending updates are in the snapshot; then fetch
        every XLA tensor in *one* batched transfer (what `xm.save` does). One
        `.cpu()` per tensor would compile a small graph for each slice of a
        buffer that was updated in place (the optimizer-state pieces of a
        checkpoint): one per parameter shape, minutes of compiling on Neuron."""
        if self.kind != "xla":
            return _to_cpu(obj)
        import torch_xla.core.xla_model as xm
        self.sync()
        on_xla = [t for t in _tensors(obj) if t.device.type == "xla"]
        fetched = xm._maybe_convert_to_cpu([t.detach() for t in on_xla])   # a list in, a list out
        return _to_cpu(obj, {id(t): c for t, c in zip(on_xla, fetched)})

    def checkpoint(self, fn, *args):
        """Activation checkpointing: keep only fn's inputs, recompute its
        activations in backward. torch_xla's version adds an optimization
        barrier so the XLA compiler cannot merge the recomputation back into
        the forward pass (which would silently undo the memory saving)."""
        if not torch.is_grad_enabled():  # evaluation: nothing to save memory on
            return fn(*args)
        if self.kind == "xla":
            # torch_xla 2.9 supports only the re-entrant variant, which gives
            # no parameter gradients unless some *input* requires grad. Fall
            # back to no checkpointing there: more memory, correct gradients.
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return fn(*args)
            import torch_xla.utils.checkpoint as xla_checkpoint
            return xla_checkpoint.checkpoint(fn, *args)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    # -- processes and groups ------------------------------------------------

    def init_process_group(self, rank: int, world_size: int) -> None:
        """Join the job. gloo/nccl rendezvous through env:// (MASTER_ADDR and
        MASTER_PORT, set by the launcher). xla takes rank and world size from
        its own runtime (xla://; under torchrun on trn1)."""
        if self.kind == "xla":
            import torch_xla.distributed.xla_backend  # noqa: F401  registers 'xla', patches dist.new_group
            dist.init_process_group("xla", init_method="xla://")
        else:
            if self.kind == "cuda":
                # nccl binds each process to "the current device": make it ours
                # before the first communicator is created.
                torch.cuda.set_device(self.torch_device)
            dist.init_process_group(self.backend, rank=rank, world_size=world_size)
        # torch_xla on CPU (and xla runs not started by torchrun) silently
        # form a world of 1: every rank would then train alone on the whole
        # batch and never communicate. Refuse rather than mislead.
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            got = (dist.get_rank(), dist.get_world_size())
            dist.destroy_process_group()
            raise RuntimeError(f"{self.backend} process group gave rank {got[0]} of {got[1]}, expected rank {rank} "
                               f"of {world_size}: start xla jobs with torchrun, or use --device cpu (gloo) to test")

    def new_group(self, ranks: list[int], partition: list[list[int]]):
        """Process group for `ranks`, one group of `partition` (all groups of
        that kind, e.g. every tp group). Every rank must call this for every
        group, in the same order. On xla a collective is compiled into the
        graph with its replica groups, and all ranks must compile the same
        collective, so each group is told the whole partition."""
        ranks = list(ranks)
        if ranks not in [list(g) for g in partition]:
            raise ValueError(f"ranks {ranks} are not one of the groups in partition {partition}")
        if len({len(g) for g in partition}) != 1:
            raise ValueError(f"groups in a partition must have equal sizes, got {partition}")
        if self.kind == "xla":
            mesh = [list(g) for g in partition]
            return dist.new_group(ranks, pg_options={"xla_pg_options": {"mesh": mesh}})
        return dist.new_group(ranks)

    # -- randomness and measurements -------------------------------------------

    def manual_seed(self, seed: int) -> None:
        """Seed every generator this process draws from (train() calls it with --seed)."""
        torch.manual_seed(seed)  # CPU generator and every CUDA device
        if self.kind == "xla":
            import torch_xla
            torch_xla.manual_seed(seed, self.torch_device)  # XLA keeps its own RNG state

    def compile_count(self) -> int | None:
        """Graphs compiled so far in this process (xla only). It must stop
        growing after the first steps; if it keeps growing, a step's graph
        changes from step to step (a shape, a Python branch on a value).

        Read from the runtime's CompileTime metric, which has one sample per
        compilation of any graph. The counter UncachedCompile counts only the
        graphs of sync() and misses e.g. those compiled to fetch a tensor to
        the host."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met
        if "CompileTime" in met.metric_names():
            return int(met.metric_data("CompileTime")[0])  # (total samples, accumulator, samples)
        return int(met.counter_value("UncachedCompile") or 0)  # None until the first compile

    def peak_memory(self) -> int | None:
        """Peak bytes: CUDA tensor allocations; on the CPU the process's peak
        resident set (everything, not only tensors); xla when the runtime
        reports it (PJRT's CPU client does not)."""
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.torch_device)
        if self.kind == "cpu":
            try:
                import resource
            except ImportError:  # Windows
                return None
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if os.uname().sysname == "Darwin" else peak * 1024  # Linux reports KiB
        try:
            import torch_xla.core.xla_model as xm
            return int(xm.get_memory_info(self.torch_device)["peak_bytes_used"])
        except Exception:
            return None


def _tensors(obj) -> list:
    """Every tensor in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _to_cpu(obj, fetched: dict | None = None):
    """The same nesting with CPU copies of the tensors; `fetched` maps id(tensor)
    -> its copy already fetched from the device (to_host on xla)."""
    if isinstance(obj, torch.Tensor):
        if fetched is not None and id(obj) in fetched:
            return fetched[id(obj)]
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v, fetched)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, fetched) for v in obj)
    return obj


def _cuda_name(index: int) -> str:
    # torch reports e.g. "NVIDIA H100 80GB HBM3"; PCIe/NVL H100s have lower
    # peaks than the SXM figure in metrics.PEAK_FLOPS, so they stay 'unknown'.
    full = torch.cuda.get_device_name(index)
    for name in ("A100", "H200", "H100"):
        if name in full and not (name == "H100" and ("PCIe" in full or "NVL" in full)):
            return name
    return "unknown"


def get_device(kind: str = "auto", local_rank: int = 0, precision: str | None = None) -> Device:
    """The device for this process. 'auto' prefers Trainium (torch-neuronx
    installed, or PJRT_DEVICE set with torch_xla installed), then CUDA, then CPU.

    `precision` (the --precision of a training run) matters on Trainium only:
    it decides the Neuron runtime's rounding mode, which must be set before
    the runtime starts (see `_neuron_rounding`)."""
    if kind not in ("auto", "cpu", "cuda", "xla"):
        raise UserError(f"--device {kind!r} is not one of auto, cpu, cuda, xla")
    if kind == "auto":
        if _installed("torch_neuronx") or (os.environ.get("PJRT_DEVICE") and _installed("torch_xla")):
            kind = "xla"
        elif torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"

    if kind == "cpu":
        return Device("cpu", torch.device("cpu"), "gloo", "cpu", local_rank)

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device cuda, but this torch ({torch.__version__}) sees no CUDA GPU; "
                            f"install a CUDA build of torch on a GPU machine, or use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"worker {local_rank} needs a GPU but only {torch.cuda.device_count()} are visible; "
                            f"start at most that many workers per machine")
        return Device("cuda", torch.device("cuda", local_rank), "nccl", _cuda_name(local_rank), local_rank)

    if not _installed("torch_xla"):
        raise UserError(f"--device xla needs torch_xla, which is not installed; {_XLA_INSTALL_HINT}")
    import torch_xla  # noqa: F401  importing sets PJRT_DEVICE (NEURON if its plugin is found, else CPU)
    import torch_xla.runtime as xr
    # device_type() only reads PJRT_DEVICE, so this does not start the runtime.
    # NEURON means trn1 here (NeuronCore-v2): torch-neuronx 2.9 is our trn1 target.
    name = {"NEURON": "NeuronCore-v2", "CPU": "cpu"}.get(xr.device_type() or "", "unknown")
    if name == "NeuronCore-v2" and precision is not None:
        _neuron_rounding(precision)
    return Device("xla", None, "xla", name, local_rank)


SR_VARIABLE = "NEURON_RT_STOCHASTIC_ROUNDING_EN"


def _neuron_rounding(precision: str) -> None:
    """Make the Neuron runtime round the way --precision says.

    NeuronCore-v2 can round every fp32 -> bf16 conversion stochastically
    (the runtime variable NEURON_RT_STOCHASTIC_ROUNDING_EN=1). That is what
    `bf16-sr` means on trn1, as in HLAT-7B's pure-bf16 run: the optimizer's
    plain `.to(bfloat16)` becomes unbiased in hardware. Every other precision
    wants round-to-nearest (0, the runtime's default). The runtime reads the
    variable when it starts, so it is set here, before the first XLA tensor.
    A value the user set that contradicts --precision is an error, not
    silently overridden."""
    want = "1" if precision == "bf16-sr" else "0"
    have = os.environ.get(SR_VARIABLE)
    if have is not None and have != want:
        raise UserError(f"{SR_VARIABLE}={have} contradicts --precision {precision}, which needs {want}; "
                        f"unset the variable (nanohlat sets it from --precision) or change --precision")
    os.environ[SR_VARIABLE] = want
