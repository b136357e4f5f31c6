"""`--compile`: torch.compile for the model stage, and what it did, counted.

torch.compile (TorchDynamo + Inductor) is PyTorch's own graph compiler. It
sees what XLA sees on Trainium, from the other end: XLA records every op of a
step lazily and compiles the whole recorded graph at `torch_xla.sync()`;
Dynamo reads a function's Python bytecode the first time it is called,
captures the tensor operations into a graph, and Inductor generates fused
kernels for it (C++/OpenMP on the CPU, Triton on CUDA). The next call runs
the compiled code, after checking the *guards* recorded with it (shapes,
dtypes, grad mode, the Python values the graph was specialised on); when a
guard fails it compiles again (a recompilation). Where Dynamo cannot capture
something (a collective of comm.py, a Python `if` on a tensor's value, a
`.item()`) it ends the graph, runs that piece eagerly and starts a new graph
after it: a *graph break*. Tutorial chapter 2 has exercises on each of these.

What is compiled: the model stage, `Transformer.forward` (forward and, through
AOTAutograd, its backward), compiled in place (`nn.Module.compile`), so
parameter names, checkpoints and the optimizer see the same module. One
process runs the whole step's forward as one graph; with --tp > 1 each
collective of comm.py is a graph break (compile_stage), with --cp > 1 each layer's
attention across the cp ranks (its q, k and v projections and rotary compiled,
the exchange of keys and values and the attention core eager), with a mixture of
experts each block's dispatch eager where the host reads its shapes (--ep, one
matmul a slice) and in capacity mode (static, not yet tried compiled), all in
moe.MoE.dispatch_on_host (a grouped dispatch compiles with the stage), and with
--pp > 1 every
stage compiles its own graphs and the pipeline schedule (pipeline.py) stays
Python, calling the compiled stage once per micro-batch.

The optimizer is compiled in part (tools/fast_adamw.py:FastFlatAdamW.compile, called by build.py):
the arithmetic of its step, the fp64 sum of squares of the grad norm and (where
torch has no fused AdamW kernel for the device: not the CPU) the AdamW update,
each a few memory-bound passes over a large flat buffer that Inductor fuses
into one loop (eagerly, every pass streams the buffer again).
Its collectives (the dp reduction, the grad norm's all-reduces, ZeRO-1's
all-gather) and the Python between the phases stay eager. So do the pipeline
schedule and the evaluation loop (the model stage inside them is compiled;
evaluation under no_grad compiles its own forward-only graph once).
"""

from __future__ import annotations

import torch

from nanohlat import comm
from nanohlat.config import UserError


def compile_stage(model: torch.nn.Module, device_kind: str = "cpu", eager: tuple = ()) -> torch.nn.Module:
    """torch.compile this rank's model stage, in place; returns it. `eager`: (class, method name) pairs
    that run eagerly besides comm.py's collectives (what an extension applied to the stage asks for:
    run/build.py).

    Compilation is lazy: nothing happens until the first forward, which then
    takes seconds to minutes (Inductor writes and compiles C++ on the CPU).
    Compiled code is cached on disk (TORCHINDUCTOR_CACHE_DIR, by default
    /tmp/torchinductor_$USER), so a second run of the same shapes starts faster.
    """
    if device_kind == "xla":
        raise UserError("--compile is torch.compile for cpu and cuda; on xla the step is already "
                        "compiled as one graph by XLA: drop --compile")
    # Each collective of comm.py runs eagerly, between two graphs. Dynamo must not
    # look inside: the ledger there adds each call's bytes to Python integers, and
    # traced, every such integer becomes a guard ("payload == 2101252") that the
    # next call fails, a recompilation per call until Dynamo gives up (its limit,
    # 8) and silently runs that code eagerly from then on.
    for owner, name in ((comm, "all_reduce"), (comm, "all_gather"), (comm, "reduce_scatter")) + tuple(eager):
        f = getattr(owner, name)
        if not hasattr(f, "__wrapped__"):   # (once per process)
            setattr(owner, name, torch.compiler.disable(f))
    model.compile()
    return model


def reset() -> None:
    """Forget every compiled graph and zero the counters (a fresh start, for measurements)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def stats() -> dict:
    """What torch.compile did so far in this process, from Dynamo's own counters
    (`torch._dynamo.utils.counters`, the same on torch 2.9 and 2.13):

        graphs        graphs captured and compiled: one per piece between graph
                      breaks, again for each recompilation
        frames        Python functions (frames) Dynamo compiled, again for each recompilation
        graph_breaks  places where Dynamo cut a graph, counted once when captured
                      (not per call), with the reasons it gave (first line of each)
    """
    from torch._dynamo.utils import counters, graph_break_reasons
    reasons = sorted({r.reason.splitlines()[0] for r in graph_break_reasons})
    return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
            "graph_breaks": len(graph_break_reasons), "break_reasons": reasons}
