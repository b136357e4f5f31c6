"""Tutorial chapter 2's exercises: what a graph compiler sees, counted on a laptop.

    python -m nanohlat.classroom.compile_lessons lr       # a Python-float learning rate vs a tensor
    python -m nanohlat.classroom.compile_lessons branch   # a Python `if` on a tensor's value vs a mask
    python -m nanohlat.classroom.compile_lessons sync     # reading a value on the host inside the step
    ... --xla                                   # the same functions on torch_xla (the XLA lane)

Each lesson runs two (or three) versions of one small piece of an optimizer
step for a few steps and prints how many graphs the compiler built, how many
times it cut a graph, and (with --xla) how many graphs ran over the steps
and how many values came back to the host. The counts are deterministic: they are
the answers the exercises ask for.

torch.compile runs here with backend="eager": Dynamo captures the graphs, and
decides every recompilation and graph break, exactly as it does for Inductor
(train.py --compile); the captured graphs then run with PyTorch's own kernels
instead of generated C++, so each lesson takes a second, not a minute. The
counters are Dynamo's own (`nanohlat/tools/compile.py:stats`). To see *why* each
graph was (re)compiled, run a lesson under `TORCH_LOGS=recompiles,graph_breaks`.
"""

from __future__ import annotations

import sys

import torch

from nanohlat.config import UserError
from nanohlat.system import cli, flags
from nanohlat.tools import compile as compilelib
from nanohlat.optim import cosine_lr

STEPS = 6
N = 4096   # elements of the toy weight


# -- the step pieces, two ways each ----------------------------------------

def sgd(w, g, lr):
    """The update the learning rate enters: lr is a Python float or a 0-d tensor."""
    return w - lr * g


def skip_with_if(w, g, lr):
    """Skip a step whose gradient is not finite with a Python `if`: the branch
    needs the value of `finite`, so the graph must end before it."""
    finite = torch.isfinite(torch.linalg.vector_norm(g))
    if finite:
        w = w - lr * g
    return w


def skip_with_mask(w, g, lr):
    """optim.py's way: multiply the update by keep = 0.0 or 1.0 (a tensor). No
    branch: the same graph every step, finite or not."""
    keep = torch.isfinite(torch.linalg.vector_norm(g)).float()
    return w - lr * keep * torch.nan_to_num(g, 0.0, 0.0, 0.0)


def clip_on_host(w, g, lr):
    """Gradient clipping with the norm read on the host (`.item()`), as
    `if norm > max_norm: ...` code often does."""
    norm = torch.linalg.vector_norm(g).item()           # host sync
    scale = min(1.0, 1.0 / (norm + 1e-6))
    return w - lr * scale * g


def clip_on_device(w, g, lr):
    """optim.py's way: the clip factor stays a tensor (torch.clamp), no host read."""
    norm = torch.linalg.vector_norm(g)
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    return w - lr * scale * g


# -- running them ------------------------------------------------------------

def learning_rates() -> list[float]:
    """The first STEPS learning rates of a short warm-up + cosine schedule: all different."""
    return [cosine_lr(s, 3e-3, 3e-4, 3, 20) for s in range(STEPS)]


def gradients(bad_step: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, generator=g) for _ in range(STEPS)]
    if bad_step is not None:
        grads[bad_step][0] = float("inf")     # an overflowed gradient
    return grads


def run_compiled(fn, lr_tensor: bool, grads, dynamic=None) -> dict:
    """STEPS steps of fn under torch.compile(backend="eager"): Dynamo's counts."""
    compilelib.reset()
    step = torch.compile(fn, backend="eager", dynamic=dynamic)
    w = torch.ones(N)
    for i, lr in enumerate(learning_rates()):
        w = step(w, grads[i], torch.tensor(lr) if lr_tensor else lr)
    return compilelib.stats()


def run_xla(fn, lr_tensor: bool, grads) -> dict:
    """STEPS steps of fn on torch_xla, one torch_xla.sync() per step (as train.py).
    Returns the graphs compiled, graphs executed and device-to-host transfers,
    counted by torch_xla's metrics over the steps."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    dev = torch_xla.device()

    def count(name):
        xm.wait_device_ops()        # execution is asynchronous: count what has finished, i.e. everything
        return int(met.metric_data(name)[0]) if name in met.metric_names() else 0

    w = torch.ones(N, device=dev)
    grads = [g.to(dev) for g in grads]
    torch_xla.sync()                                  # inputs on the device before counting
    before = {k: count(k) for k in ("CompileTime", "ExecuteTime", "TransferFromDeviceTime")}
    for i, lr in enumerate(learning_rates()):
        w = fn(w, grads[i], torch.tensor(lr, device=dev) if lr_tensor else lr)
        torch_xla.sync()
    after = {k: count(k) for k in before}
    return {"compiled": after["CompileTime"] - before["CompileTime"],
            "executed": after["ExecuteTime"] - before["ExecuteTime"],
            "to_host": after["TransferFromDeviceTime"] - before["TransferFromDeviceTime"]}


def lesson_lr(xla: bool) -> list[str]:
    lines = [f"{STEPS} steps of w <- w - lr * g; lr from optim.cosine_lr, a different value every step"]
    if xla:
        lines.append("torch_xla: graphs compiled / graphs executed over the steps")
        for label, as_tensor in (("lr a Python float", False), ("lr a 0-d tensor", True)):
            r = run_xla(sgd, as_tensor, gradients())
            lines.append(f"  {label:<46} {r['compiled']:>3} / {r['executed']}")
        return lines
    lines.append("torch.compile: graphs compiled over the steps")
    for label, as_tensor, dynamic in (("lr a Python float, dynamic=False", False, False),
                                      ("lr a Python float, default (automatic dynamic)", False, None),
                                      ("lr a 0-d tensor", True, None)):
        r = run_compiled(sgd, as_tensor, gradients(), dynamic)
        lines.append(f"  {label:<46} {r['graphs']:>3}")
    return lines


def lesson_branch(xla: bool) -> list[str]:
    bad = 2
    lines = [f"{STEPS} steps that skip a non-finite step (step {bad + 1}'s gradient holds an inf)"]
    versions = (("Python if on the value", skip_with_if), ("multiply by a keep mask", skip_with_mask))
    if xla:
        lines.append("torch_xla: graphs compiled / graphs executed / values read by the host")
        for label, fn in versions:
            r = run_xla(fn, True, gradients(bad))
            lines.append(f"  {label:<28} {r['compiled']:>3} / {r['executed']:>3} / {r['to_host']:>3}")
        return lines
    lines.append("torch.compile: graphs compiled / graph breaks")
    for label, fn in versions:
        r = run_compiled(fn, True, gradients(bad))
        lines.append(f"  {label:<28} {r['graphs']:>3} / {r['graph_breaks']:>3}")
    return lines


def lesson_sync(xla: bool) -> list[str]:
    lines = [f"{STEPS} steps of clipped SGD; the clip factor from the grad norm"]
    versions = (("norm.item() on the host", clip_on_host), ("torch.clamp on the device", clip_on_device))
    if xla:
        lines.append("torch_xla: graphs compiled / graphs executed / values read by the host")
        for label, fn in versions:
            r = run_xla(fn, True, gradients())
            lines.append(f"  {label:<28} {r['compiled']:>3} / {r['executed']:>3} / {r['to_host']:>3}")
        return lines
    lines.append("torch.compile: graphs compiled / graph breaks")
    for label, fn in versions:
        r = run_compiled(fn, True, gradients())
        lines.append(f"  {label:<28} {r['graphs']:>3} / {r['graph_breaks']:>3}")
    return lines


LESSONS = {"lr": lesson_lr, "branch": lesson_branch, "sync": lesson_sync}


@cli.command
def main(argv=None) -> int:
    p = flags.Parser(prog="python -m nanohlat.classroom.compile_lessons",
                     description="Tutorial chapter 2: graph compiler lessons, counted.")
    p.add_argument("lesson", nargs="+", choices=sorted(LESSONS), help="one or more, run in this order")
    p.add_argument("--xla", action="store_true", help="run on torch_xla (PJRT_DEVICE=CPU on a laptop)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.xla:
        try:
            import torch_xla  # noqa: F401
        except ImportError:
            raise UserError("--xla needs torch_xla (bash .ci/xla-lane installs it into .venv-xla)") from None
    for lesson in args.lesson:
        print("\n".join(LESSONS[lesson](args.xla)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
