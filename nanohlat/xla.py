"""torch_xla and the Neuron runtime: every quirk of the XLA path, in one place.

`device.py:Device` says *what* happens at each point of a step (place, sync,
step closures, checkpointing, process groups); on `--device xla` it calls the
functions here for *how*. Apart from one seeding call in
`device.py:Device.manual_seed`, nothing else in nanohlat imports torch_xla, and
both import it only inside functions: a CPU or CUDA run never loads it, and
never needs it installed.

Why XLA is different: torch_xla is *lazy*. Tensor ops only record a graph;
`torch_xla.sync()` compiles it (once per distinct graph, minutes on Neuron)
and runs it. Hence the rules the rest of the code follows: sync once per step,
read values on the host only in step closures or at checkpoints, and keep every
step's graph identical so nothing compiles after the first steps
(`compile_count` shows whether they do). How to run all this on a trn1:
docs/trn1.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist

from nanohlat.config import UserError

NEURON = "NeuronCore-v2"     # the device name of a trn1 core (a key of metrics.PEAK_FLOPS)
INSTALL_HINT = ("install torch_xla matching torch: `pip install torch==2.9.0 torch_xla==2.9.0`; "
                "on trn1 install torch-neuronx 2.9 from the Neuron pip repository")


def installed(module: str) -> bool:
    # find_spec looks for the package on sys.path without importing it.
    return importlib.util.find_spec(module) is not None


def require_installed() -> None:
    """--device xla on a machine without torch_xla: one line that says what to install."""
    if not installed("torch_xla"):
        raise UserError(f"--device xla needs torch_xla, which is not installed; {INSTALL_HINT}")


def preferred() -> bool:
    """Whether --device auto means xla: torch-neuronx installed (a trn1), or
    PJRT_DEVICE set with torch_xla installed."""
    return installed("torch_neuronx") or bool(os.environ.get("PJRT_DEVICE") and installed("torch_xla"))


def device_name() -> str:
    """NeuronCore-v2, cpu (torch_xla's CPU backend) or unknown, without
    starting the XLA runtime (device_type() only reads PJRT_DEVICE)."""
    require_installed()
    import torch_xla  # noqa: F401  importing sets PJRT_DEVICE (NEURON if its plugin is found, else CPU)
    import torch_xla.runtime as xr
    # NEURON means trn1 here (NeuronCore-v2): torch-neuronx 2.9 is our trn1 target.
    return {"NEURON": NEURON, "CPU": "cpu"}.get(xr.device_type() or "", "unknown")


def extract_graphs_only() -> bool:
    """True while `neuron_parallel_compile` traces the script to extract its
    graphs. Tensors then hold zeros, not results, so value-dependent logic
    (NaN checks, early stopping, loss-based decisions) must be skipped."""
    return os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", "") not in ("", "0")


SR_VARIABLE = "NEURON_RT_STOCHASTIC_ROUNDING_EN"


def set_neuron_rounding(precision: str) -> None:
    """Make the Neuron runtime round the way --precision says.

    NeuronCore-v2 can round every fp32 -> bf16 conversion stochastically
    (the runtime variable NEURON_RT_STOCHASTIC_ROUNDING_EN=1), as in HLAT-7B's
    pure-bf16 run; `bf16-sr` turns it on for the casts inside the model's
    forward and backward. The optimizer's update does not depend on it: it is
    rounded in software with noise that every replica shares
    (precision.round_into_master), so its cast to bf16 is exact and replicas
    cannot drift apart. Every other precision wants round-to-nearest (0, the
    runtime's default). The runtime reads the
    variable when it starts, so it is set before the first XLA tensor. A value
    the user set that contradicts --precision is an error, not silently
    overridden."""
    want = "1" if precision == "bf16-sr" else "0"
    have = os.environ.get(SR_VARIABLE)
    if have is not None and have != want:
        raise UserError(f"{SR_VARIABLE}={have} contradicts --precision {precision}, which needs {want}; "
                        f"unset the variable (nanohlat sets it from --precision) or change --precision")
    os.environ[SR_VARIABLE] = want


# -- the calls behind Device -------------------------------------------------------

def torch_device() -> torch.device:
    import torch_xla
    return torch_xla.device()  # starts the XLA runtime


def sync() -> None:
    import torch_xla
    torch_xla.sync()


def add_step_closure(fn, args: tuple) -> None:
    import torch_xla.core.xla_model as xm
    xm.add_step_closure(fn, args)


def checkpoint(fn, *args):
    """torch_xla's activation checkpointing adds an optimization barrier so
    the compiler cannot merge the recomputation back into the forward pass
    (which would silently undo the memory saving). torch_xla 2.9 supports only
    the re-entrant variant, which gives no parameter gradients unless some
    *input* requires grad: then fall back to no checkpointing (more memory,
    correct gradients)."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    import torch_xla.utils.checkpoint as xla_checkpoint
    return xla_checkpoint.checkpoint(fn, *args)


def init_process_group() -> None:
    """Rank and world size come from the XLA runtime (xla://; under torchrun on trn1)."""
    import torch_xla.distributed.xla_backend  # noqa: F401  registers 'xla', patches dist.new_group
    dist.init_process_group("xla", init_method="xla://")


def new_group(ranks: list[int], partition: list[list[int]]):
    """A collective is compiled into the graph with its replica groups, and all
    ranks must compile the same collective, so each group is told the whole
    partition."""
    return dist.new_group(ranks, pg_options={"xla_pg_options": {"mesh": [list(g) for g in partition]}})


# -- host copies, graph counts, memory ------------------------------------------------

def to_host(obj):
    """CPU copies of every tensor in a nested dict/list/tuple (for checkpoints),
    the nesting kept. Always copies, even on the CPU, so the snapshot does not
    change when training goes on updating the original tensors in place.

    XLA tensors: sync first, so pending updates are in the snapshot; then fetch
    them all in *one* batched transfer (what `xm.save` does). One `.cpu()` per
    tensor would compile a small graph for each slice of a buffer that was
    updated in place (the optimizer-state pieces of a checkpoint): one per
    parameter shape, minutes of compiling on Neuron."""
    on_xla = [t for t in _tensors(obj) if t.device.type == "xla"]
    if not on_xla:
        return _to_cpu(obj, {})
    import torch_xla.core.xla_model as xm
    sync()
    fetched = xm._maybe_convert_to_cpu([t.detach() for t in on_xla])   # a list in, a list out
    return _to_cpu(obj, {id(t): c for t, c in zip(on_xla, fetched)})


def _tensors(obj) -> list:
    """Every tensor in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _to_cpu(obj, fetched: dict):
    """The same nesting with CPU copies of the tensors; `fetched` maps id(tensor)
    -> its copy already fetched from the device."""
    if isinstance(obj, torch.Tensor):
        return fetched[id(obj)] if id(obj) in fetched else obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v, fetched)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, fetched) for v in obj)
    return obj


def compile_count() -> int | None:
    """Graphs compiled so far in this process; None if torch_xla was never
    loaded. It must stop growing after the first steps; if it keeps growing, a
    step's graph changes from step to step (a shape, a Python branch on a value).

    Read from the runtime's CompileTime metric, which has one sample per
    compilation of any graph. The counter UncachedCompile counts only the
    graphs of sync() and misses e.g. those compiled to fetch a tensor to the
    host."""
    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.debug.metrics as met
    if "CompileTime" in met.metric_names():
        return int(met.metric_data("CompileTime")[0])  # (total samples, accumulator, samples)
    return int(met.counter_value("UncachedCompile") or 0)  # None until the first compile


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes the runtime reports for `device`; None where it reports none
    (PJRT's CPU client)."""
    try:
        import torch_xla.core.xla_model as xm
        return int(xm.get_memory_info(device)["peak_bytes_used"])
    except Exception:
        return None
