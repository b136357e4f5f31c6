"""Data parallelism: same weights on every dp rank, different slices of the batch.

Each dp rank runs forward/backward on batch_size/dp sequences (split further
into micro-batches, whose gradients are added, one micro-batch at a time,
into one flat fp32 buffer per parameter group: see optim.py). The loss of
every micro-batch is divided by the token count of the *global* batch, so
summing the ranks' gradients gives exactly the gradient of the global mean
loss: one process and dp processes compute the same number (up to the order
of the additions, i.e. fp32 round-off).

The flat gradient buffer is summed over the dp group once per step, after
accumulation, in buckets of --bucket-mb. With --overlap-grad-reduce (the
default on cpu and cuda) a bucket's all-reduce starts in the backward of the
last micro-batch, as soon as its last gradient is in (`BucketWatch` counts
them), and runs while autograd computes the rest; phase 1 of the step only
waits for it. The same buckets, the same sums, bit for bit, the same bytes.
(A group whose tp ranks hold partial sums, the SP norms and the kv copies,
is added over tp first, so its buckets wait for phase 1 as without overlap.)

Bytes per step: one all-reduce of 4 * (parameters on this rank) bytes.

`ReplicatedDP` (--zero 1: its subclass in zero1.py) is the DP strategy FlatAdamW
(optim.py) calls, its state for each flat group an object of its own (`Reduction`).
train.py's loop calls the other two: `split_batch` (this rank's micro-batches
of the global batch) and `global_mean` (the loss of the whole global batch).
"""

from __future__ import annotations

import torch

from . import comm


def bucket_ranges(n: int, bucket_elems: int):
    """[0, n) cut into consecutive ranges of at most bucket_elems."""
    bucket_elems = max(1, bucket_elems)
    return [(a, min(a + bucket_elems, n)) for a in range(0, n, bucket_elems)]


def accumulate_hook(grad: torch.Tensor, off: int, numel: int):
    """The post-accumulate-grad hook of the parameter at `off` of the flat fp32 buffer `grad`: add
    its fresh gradient (one micro-batch's) into it and free it (p.grad = None): nothing summed in bf16."""
    view = grad[off:off + numel]

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            view.add_(p.grad.reshape(-1))
            p.grad = None
    return hook


def all_reduce_buckets(flat: torch.Tensor, group, bucket_elems: int) -> torch.Tensor:
    """Sum a flat gradient buffer over the dp group, in place, bucket by bucket."""
    if group.size == 1:
        return flat
    # exercise 3a: begin
    for a, b in bucket_ranges(flat.numel(), bucket_elems):
        flat[a:b] = comm.all_reduce(flat[a:b].contiguous(), group, inplace=True)
    return flat
    # exercise 3a: end


class BucketWatch:
    """Which buckets of a flat gradient buffer each parameter's gradient fills. A bucket
    is a list of flat [lo, hi) ranges (ZeRO: one per dp row); it is full once its real
    elements (not the padding) got `every` gradients each: the last micro-batch's completes it
    (an overlapped all-reduce or ZeRO-1 reduce-scatter; `every` 1: each micro-batch's). It counts
    elements: right while each parameter gets one gradient per micro-batch (and, with `every` 1,
    one micro-batch's backward ends before the next starts)."""

    def __init__(self, buckets: list, numel: int, every: int):
        self.buckets = buckets
        self.need = [every * sum(max(0, min(hi, numel) - lo) for lo, hi in b) for b in buckets]
        self.got = [0] * len(buckets)

    def pieces(self, off: int, n: int) -> list:
        """(bucket, lo, hi, where in the packed bucket) of the parameter at flat [off, off + n)."""
        out = []
        for k, bucket in enumerate(self.buckets):
            at = 0
            for lo, hi in bucket:
                if max(lo, off) < min(hi, off + n):
                    out.append((k, max(lo, off), min(hi, off + n), at + max(lo, off) - lo))
                at += hi - lo
        return out

    def filled(self, k: int, n: int) -> bool:
        """n more elements of bucket k arrived: is it full now? (then it starts over)"""
        self.got[k] += n
        if self.got[k] < self.need[k]:
            return False
        self.got[k] = 0
        return True

    def reset(self) -> None:
        self.got = [0] * len(self.buckets)


class Reduction:
    """A DP strategy's own state for one flat group (FlatGroup.dp_state): its fp32 gradient buffer; with
    overlap, which buckets are full (`watch`, else None), the collectives started, (ZeRO-1) the shard
    they fill."""

    param_shard = None   # this rank's parameters kept apart from the flat buffer, by a strategy that
                         # empties it (a seam: docs/design.md 1); None: they are the buffer's [start, stop)

    def __init__(self, g, watch=None):
        self.grad, self.watch, self.pending, self.reduced = g.grad, watch, [], None


def wait_all(r: Reduction) -> None:
    """Phase 1 with overlap: finish the collectives the backward started on a group's buckets."""
    if len(r.pending) != len(r.watch.buckets):   # else a bucket would go unsummed, silently
        raise RuntimeError(f"overlapped gradient reduction: {len(r.pending)} of {len(r.watch.buckets)} "
                           f"buckets started (a parameter got no gradient); run with "
                           f"--no-overlap-grad-reduce")
    for work, *_ in r.pending:
        work.wait()
    r.pending.clear()


class ReplicatedDP:
    """Plain data parallelism: every dp rank keeps all of every flat buffer."""

    in_backward = False        # summed over dp in phase 1 (True: in the backward, by the hooks)

    def __init__(self, group, bucket_elems: int, microbatches: int = 1, overlap: bool = False):
        self.group, self.bucket_elems, self.every = group, bucket_elems, microbatches
        self.overlap = overlap and group.size > 1

    def layout(self, numel: int) -> tuple[int, int, int]:
        """(padded length, start, stop): no padding, and this rank owns all of it."""
        return numel, 0, numel

    def grad_length(self, padded: int) -> int:
        """Elements of the fp32 gradient buffer kept between micro-batches: all of them."""
        return padded

    def buckets(self, padded: int) -> list:
        return [[r] for r in bucket_ranges(padded, self.bucket_elems)]

    def unit_of(self, name: str) -> int:
        """Which flat buffers parameter `name` joins, besides its kind (optim.FlatAdamW): the same for all."""
        return 0

    def gathered(self, g) -> torch.Tensor:
        """Group g's whole flat parameter buffer: kept (aliased), or on XLA gathered from the parameters."""
        return g.flat if g.aliased else g.flatten([p.detach() for p in g.params], g.params[0].dtype)

    def track(self, g) -> Reduction:
        """Group g's Reduction; with overlap, a BucketWatch of its buckets (else: reduced in phase 1)."""
        return Reduction(g, BucketWatch(self.buckets(g.padded), g.numel, self.every)
                         if self.overlap and not g.partial else None)

    def grad_hook(self, r: Reduction, off: int, numel: int):
        """The hook of the parameter at `off` of a group (its Reduction r): add its gradient into
        the fp32 buffer (accumulate_hook); with overlap, also start each bucket it completes."""
        add = accumulate_hook(r.grad, off, numel)
        if r.watch is None:
            return add
        pieces = r.watch.pieces(off, numel)

        def hook(p):
            if p.grad is None:                # (a backward that leaves this weight's gradient for later)
                return
            add(p)
            for k, lo, hi, _ in pieces:
                if r.watch.filled(k, hi - lo):
                    r.pending.append(self.start(r, k))
        return hook

    def start(self, r: Reduction, k: int) -> tuple:
        (lo, hi), = r.watch.buckets[k]
        return (comm.start_all_reduce(r.grad[lo:hi], self.group),)

    def reduce_gradients(self, r: Reduction, flat: torch.Tensor) -> torch.Tensor:
        """The gradients summed over dp, in place."""
        if r.watch is not None:
            wait_all(r)
            return flat
        return all_reduce_buckets(flat, self.group, self.bucket_elems)

    def sum_norm_squares(self, sq: torch.Tensor) -> torch.Tensor:
        """dp replicas hold the same summed gradients: count them once."""
        return sq

    def gather_parameters(self, full: torch.Tensor) -> torch.Tensor:
        """Every rank updated all of it: nothing to gather."""
        return full

    def write_back(self, g) -> None:
        """Phase 4 for group g: its master (gathered, ZeRO-1 and 2) -> the flat parameter buffer."""
        g.flat.copy_(self.gather_parameters(g.master.to(g.flat.dtype)))


def split_batch(batch: torch.Tensor, mesh, tcfg, dev) -> tuple[list, list]:
    """Global batch (B, T+1), on the host -> this dp rank's M micro-batches:
    lists of M token and M target tensors (mb, T), each sent to the device on
    its own (on XLA a micro-batch is then a graph input, not a slice of one).
    Each sequence is shifted into (input, target) first, then the mesh keeps
    the part of it this rank trains on (Mesh.sequence_part: all of it)."""
    per_rank = tcfg.batch_size // mesh.dp
    mine = batch[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
    mine = mine.view(tcfg.microbatches, per_rank // tcfg.microbatches, tcfg.seq_len + 1)
    pairs = [mesh.sequence_part(mb[:, :-1], mb[:, 1:]) for mb in mine]
    tokens = [x.contiguous().to(dev.torch_device) for x, _ in pairs]
    targets = [y.contiguous().to(dev.torch_device) for _, y in pairs]
    return tokens, targets


def global_mean(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's share of a mean -> the mean over the whole global batch, on every rank.

    `x` is already divided by the global token count, and only the last pipeline stage
    holds a loss (the others 0), so summing over the
    pipeline group and then over the ranks holding the same weights and other tokens
    (mesh.grad_group: the data-parallel group) gives the global mean.
    The tensor-parallel ranks of a stage already agree on it (vocab-parallel
    cross-entropy), so no sum over tp."""
    return comm.all_reduce(comm.all_reduce(x, mesh.pp_group), mesh.grad_group, what="loss")
