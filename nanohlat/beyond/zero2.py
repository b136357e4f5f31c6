"""ZeRO stage 2: shard the gradients too (Rajbhandari et al. 2020, section 5.2).

ZeRO-1 still keeps the whole fp32 gradient buffer on every dp rank (4 bytes
per parameter, as much as the two fp32 moments together) although after the
reduce-scatter each rank only ever reads its own 1/dp of it. ZeRO-2 keeps
only that shard. The buckets are ZeRO-1's (columns [a, b) of the (dp, S)
view of the flat buffer), but they are reduce-scattered *during* every
micro-batch's backward, each as soon as its last gradient arrives
(`data_parallel.BucketWatch`), and the summed columns are added into the
shard: in fp32, so accumulating over micro-batches stays exact up to
round-off, as in the full buffer.

    backward of micro-batch i:  p.grad -> its bucket's staging (dp x columns, fp32)
                                bucket full -> reduce-scatter -> shard[a:b] += my columns
    between micro-batches:      only the 1/dp shard (and no staging) is kept

Costs: a bucket is staged only while it fills, but a bucket holds a piece of
every dp row, far apart in the buffer: the last layers' gradients start every
bucket, the first layers' complete them, and at the backward's midpoint the
staging is the whole buffer's 4 bytes per parameter (the plan counts that
much; tutorial chapter 3 says what frameworks do instead). And the gradients cross the wire once per
*micro-batch*, not once per step: M micro-batches send M times ZeRO-1's
reduce-scatter bytes. The sums over tp that some groups need (the SP norms,
the kv copies: optim.FlatAdamW.reduce_gradients) then run on the shard.

With --overlap-grad-reduce the reduce-scatter runs while autograd goes on, and
all are waited on (and added) once the micro-batch started its last bucket: no
staging kept between micro-batches. Without, each runs right away. Bit for bit.
"""

from __future__ import annotations

import torch

from nanohlat import comm
from nanohlat.data_parallel import BucketWatch, Reduction
from nanohlat.zero1 import ZeroOneDP


class Staging(Reduction):
    """ZeRO-2's own state for one flat group: also each filling bucket's staging, the reduce-scatters in flight."""

    def __init__(self, g, watch):
        super().__init__(g, watch)
        self.staged, self.flight = {}, {}   # bucket -> its staging; bucket -> (work, out, staging)


class ZeroTwoDP(ZeroOneDP):
    """ZeRO-1's sharded update, with the gradient buffer itself the shard [start, stop)."""

    in_backward = True         # summed over dp in the backward: tp sums come after (optim.py)
    state = Staging            # its per-group state (ZeRO-3: zero3.Shard)

    def grad_length(self, padded: int) -> int:
        return padded // self.group.size

    def track(self, g) -> Staging:
        """Group g's state: every micro-batch fills every bucket once; nothing staged or in flight yet."""
        return self.state(g, BucketWatch(self.buckets(g.padded), g.numel, 1))

    def grad_hook(self, s: Staging, off: int, numel: int):
        """Copy the parameter's gradient into the staging of each bucket it falls in, and
        reduce-scatter each bucket it completes (the staging is zeros where nothing falls: padding)."""
        pieces = s.watch.pieces(off, numel)

        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            grad = p.grad.reshape(-1)
            for k, lo, hi, at in pieces:
                if k not in s.staged:
                    size = sum(b - a for a, b in s.watch.buckets[k])
                    s.staged[k] = torch.zeros(size, dtype=torch.float32, device=grad.device)
                s.staged[k][at:at + hi - lo].copy_(grad[lo - off:hi - off])
                if s.watch.filled(k, hi - lo):
                    self.reduce_bucket(s, k)
            p.grad = None
        return hook

    def reduce_bucket(self, s: Staging, k: int) -> None:
        """Bucket k is full: reduce-scatter it (started, with overlap) and free its staging."""
        # exercise 3d: begin
        self.finish(s, k)                                # the previous micro-batch's, if still in flight
        piece, (a, b) = s.staged.pop(k), s.watch.buckets[k][0]
        if self.overlap:
            out = torch.empty(b - a, dtype=piece.dtype, device=piece.device)
            s.flight[k] = (comm.start_reduce_scatter(piece, out, self.group, what=(s.grad, k)), out, piece)
            if len(s.flight) == len(s.watch.buckets):    # this micro-batch's last: keep no staging after it
                for j in sorted(s.flight):
                    self.finish(s, j)
        else:
            s.grad[a:b].add_(comm.reduce_scatter(piece, self.group, what=(s.grad, k)))
        # exercise 3d: end

    def finish(self, s: Staging, k: int) -> None:
        # exercise 3d: begin
        if k in s.flight:
            work, out, _ = s.flight.pop(k)
            work.wait()
            s.grad[s.watch.buckets[k][0][0]:s.watch.buckets[k][0][1]].add_(out)
        # exercise 3d: end

    def reduce_gradients(self, s: Staging, flat: torch.Tensor) -> torch.Tensor:
        """Phase 1: the shard already holds the dp sum; finish what is still in flight."""
        if s.staged:
            raise RuntimeError(f"ZeRO-2: buckets {sorted(s.staged)} of a gradient buffer never filled "
                               f"(a parameter got no gradient in some micro-batch); run with --zero 1")
        for k in sorted(s.flight):
            self.finish(s, k)
        return flat
