"""FlatAdamW made faster on the CPU and under --compile: the same numbers, sooner.

optim.py:FlatAdamW is the algorithm. This subclass changes only how its
arithmetic walks the flat buffers, never what it computes; build.py picks it
on the CPU and with --compile.

Cache blocking (CPU). The optimizer's passes over its big flat buffers are
memory-bound: one pass over a 13.8M-element buffer streams 55 MB from RAM,
and AdamW makes about a dozen. Done block by block, each block's dozen passes
find it still in the cache (what a fused kernel does in one loop): about
twice as fast. A block is 2 MiB of fp32 per buffer, 8 MiB for the four
buffers AdamW touches, within a laptop's L3 cache. The update is elementwise,
so every element gets the same bits as from whole-buffer passes. GPUs stream
memory fast and pay per kernel launch, and XLA fuses the passes itself: both
take whole buffers (`block_size`).

--compile (`FastFlatAdamW.compile`): torch.compile the step's arithmetic, not
its collectives: the grad norm's fp64 sum of squares and the AdamW update,
each fused by Inductor into one loop over a whole buffer (so no cache blocks).
"""

from __future__ import annotations

import torch

from nanohlat.optim import NORM_CHUNK, FlatAdamW, sum_of_squares

CPU_BLOCK = 1 << 19
# The grad norm's fp64 copy (optim.sum_of_squares), one chunk of a buffer at a time: on the CPU
# 2^16 elements (512 KiB). A chunk the size of a block (4 MiB of fp64) can go back to the operating
# system when freed and be faulted in again, page by page, at the next step's norm: where another
# model's step runs between two of ours (the bench), the moe preset's step took 22.9 ms with it
# against 22.5 ms with 2^16 (2-core CPU, 40 paired rounds); back to back the two were level. The
# chunks' sums add in another order than whole-buffer passes would: at most a last-bit difference in fp64.
CPU_NORM_CHUNK = 1 << 16


def norm_chunk(device_kind: str) -> int:
    """Elements of a buffer the grad norm copies to fp64 at a time on this device (the plan counts them)."""
    return CPU_NORM_CHUNK if device_kind == "cpu" else NORM_CHUNK


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
    """FlatAdamW whose passes run a cache-sized block at a time on the CPU (or compiled)."""

    def __init__(self, model, mesh, tcfg, device, strategy=None):
        super().__init__(model, mesh, tcfg, device, strategy)
        self.block = block_size(device.kind)
        self.chunk = norm_chunk(device.kind)
        self.kernel = super()._adamw      # FlatAdamW's AdamW, run on one block at a time
        self.squares = None               # --compile: the compiled fused_sum_of_squares

    def compile(self) -> None:
        """--compile: one fused loop per buffer for the sum of squares and for
        AdamW (so no cache blocks). One graph per buffer size (dynamic=False).
        build.py calls it (compile.py says what stays eager)."""
        self.block = None
        self.squares = torch.compile(fused_sum_of_squares, dynamic=False)
        self.kernel = torch.compile(self.kernel, dynamic=False)

    def _sum_of_squares(self, grad: torch.Tensor) -> torch.Tensor:
        # the same fp64 rule; on the CPU in chunks of CPU_NORM_CHUNK (FlatAdamW's are NORM_CHUNK)
        return self.squares(grad) if self.squares else sum_of_squares(grad, self.exact, self.chunk)

    def _adamw(self, grad, m, v, w, c: dict, decay: bool) -> None:
        for sl in blocks(w.numel(), self.block):
            self.kernel(grad[sl], m[sl], v[sl], w[sl], c, decay)
