"""Every byte that moves between ranks goes through this file.

Four operations are enough for 3D parallelism + ZeRO-1, 2 and 3, and all of them exist
on gloo (CPU), nccl (CUDA) and xla (Trainium) (docs/design.md section 3):

    all_reduce      x_i -> sum_i x_i on every rank        (tp row-parallel, dp grads)
    all_gather      x_i -> [x_0; x_1; ...] on every rank   (sequence parallel, ZeRO-1 params)
    reduce_scatter  x_i -> (sum_i x_i)[my chunk]           (sequence parallel, ZeRO-1 grads)
    exchange        2 ranks swap one tensor each           (pipeline send/recv)

Two more, on gloo and nccl, for layouts that send each rank its own rows or pass
blocks round a ring (nothing in the core calls them):

    all_to_all        rows of x_i -> rank j, in counts both sides know
    start_ring_shift  send x to the next rank, receive from the previous

`start_all_reduce` and `start_reduce_scatter` are the first and third, started
and not waited for: the overlapped gradient reduction (data_parallel.py). A group's
`trace` (--timeline: tools/comm_trace.py:CommTrace; the straggler watch's
run/stragglers.py:WaitClock) is told when these two, all_reduce, reduce_scatter, all_gather,
all_to_all, start_ring_shift and exchange are issued and end, with the caller's
`what` (what the collective is: 'loss', 'grad norm', (flat gradient buffer, k), its bucket k):
it names and times them and changes nothing.

`exchange` is a 2-rank all-gather: point-to-point send/recv is missing or slow
on the xla backend, while an all-gather between two neighbours is a
collective every backend runs well. Both sides must call it at the same time
with tensors of the same shape and dtype: the pipeline schedule guarantees it.

A group of size 1 makes every operation a no-op, so single-process code runs
the exact same lines.

The `CommLedger` counts, per collective and group kind, three byte figures and
the number of calls, on this rank (tutorial.md chapter 3 works them through):

    payload  what the operation delivers: the input of an all-reduce, the
             gathered output of an all-gather, the unreduced input of a
             reduce-scatter, the real tensors of an exchange (both directions)
    wire     what a ring implementation sends from this rank for it, with n
             ranks in the group and S the payload:
                 all-reduce                    2 (n-1)/n x S  (a reduce-scatter, then an all-gather)
                 all-gather, reduce-scatter      (n-1)/n x S
                 all-to-all                      (n-1)/n x S  (the piece it keeps stays home)
                 exchange, ring shift          the real tensor this rank sends
    padding  zeros sent only because `exchange` is an all-gather: a rank with
             nothing to send in a tick still contributes a tensor of zeros
    calls    how many times the collective ran

The wire figure is what comm time depends on: ZeRO-1's reduce-scatter plus
all-gather puts on the wire what one all-reduce does, and SP's all-gather plus
reduce-scatter what one tp all-reduce does (--sp-regather adds an all-gather).
`plan.comm_per_step` predicts all four figures from the model shape; the tests
hold the two to the byte. (Wire bytes are rounded down
to whole bytes per call; every tensor in nanohlat splits evenly anyway.)
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives and warns about the
# old names; torch 2.9 (torch-neuronx) only has the old ones. Pick once, here.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Group:
    """One process group as this rank sees it: who is in it and where I stand.
    mesh.py builds them; every operation below takes one."""

    name: str                   # 'tp', 'dp', 'pp', 'pair' ... (the comm ledger's key)
    ranks: list[int]
    rank: int                   # my index inside `ranks`
    pg: object = None           # torch.distributed ProcessGroup, None when size 1
    ledger: object = None       # CommLedger shared by all groups of the mesh
    trace: object = None        # None, or told of its collectives (module docstring)

    @property
    def size(self) -> int:
        return len(self.ranks)


FIGURES = ("payload", "wire", "padding", "calls")


def wire_bytes(op: str, n: int, payload: int) -> int:
    """Bytes a ring implementation sends from one rank for a collective of
    `payload` bytes over n ranks (see the module docstring)."""
    if op == "all_reduce":
        return 2 * (n - 1) * payload // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * payload // n
    if op == "ring_shift":
        return payload
    raise ValueError(f"no ring formula for {op!r}")


class CommLedger:
    """Per 'group.op' key (e.g. 'tp.all_reduce'): payload, wire and padding bytes
    and calls on this rank, summed since the last `reset`; and `open`, the last call
    issued: (key, file, line, function) of the code outside this file that issued
    it, what a collective that times out was waiting in (run/launch.py names it)."""

    def __init__(self):
        self.entries: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIGURES, 0))
        self.open = None

    def record(self, key: str, payload: int, wire: int, padding: int = 0) -> None:
        caller = sys._getframe(1)
        while caller.f_code.co_filename == __file__:   # (the first frame outside comm.py)
            caller = caller.f_back
        self.open = (key, caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)
        e = self.entries[key]
        e["payload"] += payload
        e["wire"] += wire
        e["padding"] += padding
        e["calls"] += 1

    def reset(self) -> None:
        self.entries.clear()

    def snapshot(self, figure: str | None = None) -> dict:
        """{key: {payload, wire, padding, calls}}, or {key: that one figure}."""
        if figure is None:
            return {k: dict(v) for k, v in sorted(self.entries.items())}
        return {k: v[figure] for k, v in sorted(self.entries.items())}


def _record(group, op: str, payload: int) -> None:
    if group.ledger is not None:
        group.ledger.record(f"{group.name}.{op}", payload, wire_bytes(op, group.size, payload))


def _issued(group, op: str, x: torch.Tensor, payload: int, what, work=None):
    """--timeline: tell the group's trace that `op` of x was issued (blocking: work None); returns what
    stands in for `work` (blocking: what to tell that it ended), or without a trace `work` itself."""
    return group.trace.issued(f"{group.name}.{op}", x, payload, what, work) if group.trace else work


def _check_device(x: torch.Tensor, group) -> None:
    # gloo silently does nothing with an XLA tensor; refuse loudly instead.
    backend = dist.get_backend(group.pg)
    if backend == "gloo" and x.device.type != "cpu":
        raise RuntimeError(f"gloo collective got a tensor on {x.device}; collectives must see tensors on "
                           f"their backend's device")


def all_reduce(x: torch.Tensor, group, inplace: bool = False, what=None) -> torch.Tensor:
    """Sum of x over the group, on every rank (a new tensor unless `inplace`). `what`: only for the trace."""
    if group.size == 1:
        return x
    _check_device(x, group)
    _record(group, "all_reduce", x.numel() * x.element_size())
    out = x if inplace else x.clone()
    traced = _issued(group, "all_reduce", out, x.numel() * x.element_size(), what)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group.pg)
    if traced:
        traced.ended()
    return out


def start_all_reduce(x: torch.Tensor, group, what=None):
    """all_reduce of a contiguous x in place, started, not finished: returns the handle to
    `.wait()` on before x is read (overlapped gradient reduction, data_parallel.py). Same ledger entry."""
    _check_device(x, group)
    _record(group, "all_reduce", x.numel() * x.element_size())
    work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.pg, async_op=True)
    return _issued(group, "all_reduce", x, x.numel() * x.element_size(), what, work)


def start_reduce_scatter(x: torch.Tensor, out: torch.Tensor, group, what=None):
    """reduce_scatter of a flat x into `out` (x.numel() / size elements), started: returns the handle."""
    _check_device(x, group)
    _record(group, "reduce_scatter", x.numel() * x.element_size())
    work = _reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group.pg, async_op=True)
    return _issued(group, "reduce_scatter", x, x.numel() * x.element_size(), what, work)


def all_gather(x: torch.Tensor, group, dim: int = 0, what=None) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in group order."""
    if group.size == 1:
        return x
    _check_device(x, group)
    # The collective concatenates along dim 0; other dims go through a transpose.
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * xt.shape[0],) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    _record(group, "all_gather", out.numel() * out.element_size())
    traced = _issued(group, "all_gather", xt, out.numel() * out.element_size(), what)
    _all_gather_tensor(out, xt, group=group.pg)
    if traced:
        traced.ended()
    # contiguous: otherwise every matmul that reads the gathered sequence
    # (wq, wk, wv; gate, up) saves its own contiguous copy for backward
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int = 0, what=None) -> torch.Tensor:
    """Sum x over the group and keep this rank's 1/size chunk along `dim`."""
    if group.size == 1:
        return x
    _check_device(x, group)
    xt = x.movedim(dim, 0).contiguous()
    out = torch.empty((xt.shape[0] // group.size,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    _record(group, "reduce_scatter", xt.numel() * xt.element_size())
    traced = _issued(group, "reduce_scatter", xt, xt.numel() * xt.element_size(), what)
    _reduce_scatter_tensor(out, xt, op=dist.ReduceOp.SUM, group=group.pg)
    if traced:
        traced.ended()
    return out.movedim(0, dim)


def exchange(x: torch.Tensor, pair, sends: bool = True, receives: bool = True) -> torch.Tensor:
    """Swap tensors with the other rank of a 2-rank group; returns the other's tensor.

    Implemented as an all-gather of [mine; theirs] in which each side keeps the
    half it did not write. Used by the pipeline for both directions at once:
    the left stage contributes an activation, the right stage a gradient.
    `sends` / `receives`: whether x / the other's tensor carry data or are the
    zeros of an idle direction (the ledger counts those as padding).
    """
    assert pair.size == 2, "exchange needs a 2-rank group"
    _check_device(x, pair)
    x = x.contiguous()
    out = torch.empty((2,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    size = x.numel() * x.element_size()
    if pair.ledger is not None:
        pair.ledger.record(f"{pair.name}.exchange", payload=size * (sends + receives), wire=size * sends,
                           padding=size * (not sends))
    traced = _issued(pair, "exchange", x, size * (sends + receives), None)
    _all_gather_tensor(out, x.unsqueeze(0), group=pair.pg)
    if traced:
        traced.ended()
    return out[1 - pair.rank]


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, what=None) -> torch.Tensor:
    """Rows of x to every rank: the first send[0] rows to rank 0 of the group, the next
    send[1] to rank 1, ...; returns the rows received, recv[r] from rank r, in rank order
    (both sides know the counts first). The ledger's payload is what this rank sends,
    its wire what goes to other ranks (its own rows stay)."""
    if group.size == 1:
        return x
    _check_device(x, group)
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    row = x.element_size() * (x.numel() // max(x.shape[0], 1) if x.shape[0] else 0)
    if group.ledger is not None:
        group.ledger.record(f"{group.name}.all_to_all", sum(send) * row, (sum(send) - send[group.rank]) * row)
    traced = _issued(group, "all_to_all", x, sum(send) * row, what)
    dist.all_to_all_single(out, x, output_split_sizes=list(recv), input_split_sizes=list(send),
                           group=group.pg)
    if traced:
        traced.ended()
    return out


def start_ring_shift(x: torch.Tensor, group, step: int = 1, what=None):
    """Send x to the rank `step` places on in the group (wrapping round) and receive the tensor
    of the rank `step` places back, started, not finished: returns (the tensor that will hold
    what arrives, the handles to `.wait()` on before reading it or writing x). Every rank of the
    group calls it together with the same shape and step."""
    _check_device(x, group)
    x = x.contiguous()
    out = torch.empty_like(x)
    n, me = group.size, group.rank
    nbytes = x.numel() * x.element_size()
    _record(group, "ring_shift", nbytes)
    ops = [dist.P2POp(dist.isend, x, group.ranks[(me + step) % n], group.pg),
           dist.P2POp(dist.irecv, out, group.ranks[(me - step) % n], group.pg)]
    return out, _issued(group, "ring_shift", x, nbytes, what, dist.batch_isend_irecv(ops))
