"""FlatAdamW made faster on the CPU and under --compile: the same numbers, sooner.

optim.py:FlatAdamW is the algorithm. This subclass changes only how its
arithmetic walks the flat buffers and how the gradients reach them, never what
it computes; build.py picks it on the CPU and with --compile.

Cache blocking (CPU). The optimizer's passes over its big flat buffers are
memory-bound: one pass over a 13.8M-element buffer streams 55 MB from RAM,
and AdamW makes about a dozen. Done block by block, each block's dozen passes
find it still in the cache (what a fused kernel does in one loop): about
twice as fast. A block is 2 MiB of fp32 per buffer, 8 MiB for the four
buffers AdamW touches, within a laptop's L3 cache. The update is elementwise,
so every element gets the same bits as from whole-buffer passes. GPUs stream
memory fast and pay per kernel launch, and XLA fuses the passes itself: both
take whole buffers (`block_size`).

torch's fused AdamW kernel (the CPU, eager and compiled: `fused_adamw`). Where torch has one for
the device (`torch._fused_adamw_`, which `torch.optim.AdamW(fused=True)` calls;
the CPU's since torch 2.4, in 2.9 and 2.13 alike), the update is that kernel,
one call a group: one pass that reads the gradient, the weights and both
moments once and writes them back, where the blocked passes above make about
a dozen. It computes AdamW in another order than FlatAdamW's lines (v as
b2 v + (1 - b2) g^2 rather than a lerp, the step size lr / bc1 in fp64, then
the product before the division), so its numbers are FlatAdamW's to a bound,
not bit for bit: tests/tools/test_fast_adamw.py derives the bound (`fused_bound`:
a few fp32 roundings of the weight and of the update) and checks both against
AdamW in fp64 within it. What stays exact: the clipped gradient
(FlatAdamW's own multiply), a skipped step (it changes nothing, as
FlatAdamW's), and the same bits in every layout: the kernel's vector loop
handles each element alike, its scalar loop the few past a multiple of the
vector width, so each buffer's last `ALIGN` or fewer elements go through the
kernel padded to `ALIGN` (a shard's tail in one layout is mid-buffer in
another). Where torch has no such kernel the blocked passes above run
(FlatAdamW's bits); no flag or variable switches between the two.

Gradients as views of the buffer (`FastFlatAdamW.attach`). FlatAdamW adds each
parameter's gradient into its group's fp32 buffer by a Python hook per parameter
per micro-batch, which then frees it. Where that hook would only add (fp32
parameters, so the gradient has the buffer's dtype; a whole buffer on the rank,
no ZeRO-2/3 shard; no bucket to start in the backward: one dp rank,
--no-overlap-grad-reduce, or a group first summed over tp (data_parallel.py's
`track`); not XLA, where no view outlives a graph), `p.grad` is
instead the parameter's own view of the buffer, and autograd adds each gradient
into it in place (what it does to any `p.grad` already there): the same sum, bit
for bit, without a Python call per parameter: with the hooks the moe preset's
step took 1.8% longer (one process, one and two threads, medians of 300 paired
steps, each middle half about +-3%). zero_grad clears the buffer and points
every `p.grad` at it again; between a step's update and the next zero_grad
`p.grad` shows whatever the update left in the buffer (AdamW's scratch), not
a gradient.

--compile (`FastFlatAdamW.compile`): torch.compile the step's arithmetic, not
its collectives: the grad norm's fp64 sum of squares, fused by Inductor into
one loop over a whole buffer, and the AdamW update where torch has no fused
kernel for the device (CUDA here: Inductor's loop is FlatAdamW's lines in
order). On the CPU the update stays torch's kernel: one loop already, and on
the moe preset 1.2 ms a step against 2.0 ms compiled (the default preset 11
against 18 ms; one thread, medians of 75 interleaved steps, measured under a load of
about 5 on 2 cores: indicative, not a quiet figure).
"""

from __future__ import annotations

import torch

from nanohlat.data_parallel import ReplicatedDP
from nanohlat.device import resolve_kind
from nanohlat.optim import NORM_CHUNK, FlatAdamW, sum_of_squares

CPU_BLOCK = 1 << 19
# The grad norm's fp64 copy (optim.sum_of_squares), one chunk of a buffer at a time: on the CPU
# 2^16 elements (512 KiB). A chunk the size of a block (4 MiB of fp64) can go back to the operating
# system when freed and be faulted in again, page by page, at the next step's norm: where another
# model's step runs between two of ours (the bench), the moe preset's step took 22.9 ms with it
# against 22.5 ms with 2^16 (2-core CPU, 40 paired rounds); back to back the two were level. The
# chunks' sums add in another order than whole-buffer passes would: at most a last-bit difference in fp64.
CPU_NORM_CHUNK = 1 << 16


# Elements that torch's CPU AdamW kernel hands to its vector loop as a unit: it splits a tensor among
# threads in cache lines (64 bytes: 16 fp32), and its vectors are 8 (AVX2) or 16 (AVX-512) fp32 wide;
# so a length that is a multiple of 16 goes through the vector loop alone.
ALIGN = 16


def fused_adamw(device_kind: str) -> bool:
    """Whether the update runs torch's fused AdamW kernel here: on the CPU, where torch has one
    (torch._fused_adamw_)."""
    return device_kind == "cpu" and hasattr(torch, "_fused_adamw_")


def norm_chunk(device_kind: str) -> int:
    """Elements of a buffer the grad norm copies to fp64 at a time on this device (the plan counts them)."""
    return CPU_NORM_CHUNK if device_kind == "cpu" else NORM_CHUNK


def grad_views(tcfg, grad_ranks: int) -> bool:
    """Whether FastFlatAdamW.attach gives the tp-sharded weights' gradients views of their buffer, from the
    recipe alone (what --plan knows): built (the CPU, or --compile off XLA), fp32, ZeRO 0 or 1, and no
    bucket started in the backward (one rank summing the gradients, or --no-overlap-grad-reduce)."""
    kind = resolve_kind(tcfg.device)
    return ((kind == "cpu" or tcfg.compile and kind != "xla") and tcfg.precision == "fp32" and tcfg.zero < 2
            and (grad_ranks == 1 or not tcfg.overlap_grad_reduce))


def block_size(device_kind: str) -> int | None:
    """Elements per block of the optimizer's passes on this device; None: whole buffers."""
    return CPU_BLOCK if device_kind == "cpu" else None


def blocks(n: int, size: int | None) -> list[slice]:
    """[0, n) in consecutive slices of `size` elements (one slice when size is None)."""
    size = size or max(n, 1)
    return [slice(a, min(a + size, n)) for a in range(0, n, size)] or [slice(0, 0)]


def fused_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) in fp64, written for torch.compile (FastFlatAdamW.compile): Inductor
    turns it into one loop that squares and adds each element in fp64, with no
    fp64 copy. Run eagerly, `x.double()` would be a full fp64 copy of x."""
    return x.double().square().sum()


class FastFlatAdamW(FlatAdamW):
    """FlatAdamW whose update is torch's fused kernel on the CPU (else its passes a cache-sized
    block at a time), or compiled."""

    def __init__(self, model, mesh, tcfg, device, strategy=None):
        self.views = []                   # (param, its view of its group's fp32 gradients): attach
        super().__init__(model, mesh, tcfg, device, strategy)
        self.block = block_size(device.kind)
        self.chunk = norm_chunk(device.kind)
        self.kernel = super()._adamw      # FlatAdamW's AdamW, run on one block at a time
        self.squares = None               # --compile: the compiled fused_sum_of_squares
        self.fused = fused_adamw(device.kind)
        self.now = None                   # (lr as fp32, whether the step is kept): set by update()
        self.step_number = torch.zeros((), dtype=torch.float32)   # the fused kernel's step n (it reads it)

    def attach(self, g) -> None:
        """p.grad a view of g.grad where FlatAdamW's hook would only add (module docstring), else its hook."""
        if not (g.aliased and type(g.dp).grad_hook is ReplicatedDP.grad_hook and g.dp_state.watch is None
                and all(p.dtype == g.grad.dtype for p in g.params) and g.grad.numel() == g.padded):
            super().attach(g)
            return
        for p, off in zip(g.params, g.offsets):
            view = g.grad[off:off + p.numel()].view_as(p)
            self.views.append((p, view))
            p.grad = view

    def zero_grad(self) -> None:
        super().zero_grad()               # (the buffers cleared, every p.grad set to None)
        for p, view in self.views:
            p.grad = view

    def compile(self) -> None:
        """--compile: one fused loop per buffer for the sum of squares, and for AdamW
        unless torch's fused kernel does the update here (the CPU: it is one loop
        already, and sooner than Inductor's, which also writes the gradient's
        scratch back and checks its guards on every call). One graph per buffer
        size (dynamic=False). build.py calls it (compile.py says what stays eager)."""
        self.block = None
        self.squares = torch.compile(fused_sum_of_squares, dynamic=False)
        if not self.fused:
            self.kernel = torch.compile(self.kernel, dynamic=False)

    def _sum_of_squares(self, grad: torch.Tensor) -> torch.Tensor:
        # the same fp64 rule; on the CPU in chunks of CPU_NORM_CHUNK (FlatAdamW's are NORM_CHUNK)
        return self.squares(grad) if self.squares else sum_of_squares(grad, self.exact, self.chunk)

    def update(self, grads, lr: float, norm: torch.Tensor, finite: torch.Tensor) -> None:
        if self.fused:   # what the kernel takes as numbers (on the CPU reading them costs no wait)
            self.now = (torch.tensor(float(lr), dtype=torch.float32).item(), bool(finite))
            self.step_number.fill_(int(self.step_count) + 1)
        super().update(grads, lr, norm, finite)

    def _adamw(self, grad, m, v, w, c: dict, decay: bool) -> None:
        if self.fused:
            self._fused(grad, m, v, w, c, decay)
            return
        for sl in blocks(w.numel(), self.block):
            self.kernel(grad[sl], m[sl], v[sl], w[sl], c, decay)

    def _fused(self, grad, m, v, w, c: dict, decay: bool) -> None:
        """The group's update in one call of torch's fused AdamW (module docstring)."""
        lr, kept = self.now
        if not kept:        # FlatAdamW's skipped step (keep = 0) leaves w, m and v as they were
            return
        if c["clip"].item() != 1.0:
            grad.mul_(c["clip"])                            # g <- clip g: FlatAdamW's multiply, its bits
        n = w.numel() - w.numel() % ALIGN
        ws, gs, ms, vs = [w[:n]], [grad[:n]], [m[:n]], [v[:n]]
        tail = slice(n, w.numel())
        if n < w.numel():   # the last few elements, zero-padded to ALIGN: the kernel's vector loop too
            padded = [torch.zeros(ALIGN, dtype=t.dtype) for t in (w, grad, m, v)]
            for p, t in zip(padded, (w, grad, m, v)):
                p[:w.numel() - n] = t[tail]
            for lst, p in zip((ws, gs, ms, vs), padded):
                lst.append(p)
        tcfg = self.tcfg
        torch._fused_adamw_(ws, gs, ms, vs, [], [self.step_number] * len(ws), lr=lr, beta1=tcfg.beta1,
                            beta2=tcfg.beta2, weight_decay=tcfg.weight_decay if decay else 0.0,
                            eps=tcfg.adam_eps, amsgrad=False, maximize=False)
        if n < w.numel():
            for t, p in zip((w, m, v), (ws[1], ms[1], vs[1])):
                t[tail] = p[:w.numel() - n]
