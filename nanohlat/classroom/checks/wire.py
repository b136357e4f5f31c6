"""What moves, and when: every collective, recorded where it enters torch.distributed,
with whether it was started asynchronously and when it was waited."""

from __future__ import annotations

from fractions import Fraction

import torch


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# torch.distributed function -> (kind, the argument whose bytes are the payload). The payload
# is nanohlat/comm.py's: the input of an all-reduce, the gathered output of an all-gather, the
# unreduced input of a reduce-scatter; the wire bytes follow from it as comm.wire_bytes says.
_COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"), "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"), "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"), "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"), "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"), "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"), "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "send": ("send", "tensor"), "recv": ("recv", "tensor"), "isend": ("send", "tensor"), "irecv": ("recv", "tensor"),
}


def _wire(kind: str, n: int, payload: int) -> Fraction:
    """A ring's bytes on the wire from one rank (comm.wire_bytes' formulas, not rounded down
    per call: a check's small buckets would otherwise make more calls look cheaper)."""
    if kind == "all_reduce":
        return Fraction(2 * (n - 1) * payload, n)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return Fraction((n - 1) * payload, n)
    return Fraction(payload)


class Call:
    """One collective as a rank called it: what, on which group, its bytes, and when.

    `started` and `waited` are ticks of `Wire.now()`, one clock for the calls and the
    check's own marks: a blocking call (async_op=False) is waited when it returns, a
    started one (async_op=True, isend, irecv) when its work handle's `wait()`
    returns; `waited` is None while it is still in flight."""

    __slots__ = ("kind", "pg", "payload", "wire", "async_op", "started", "waited", "peer", "at")

    def __init__(self, kind, pg, payload, wire, async_op, started, peer=None, at=""):
        self.kind, self.pg, self.payload, self.wire = kind, pg, payload, wire
        self.async_op, self.started, self.waited = async_op, started, None
        self.peer, self.at = peer, at      # (a send's or recv's other rank; where the code called it)


def _caller() -> str:
    """file:line of the innermost frame outside torch, this file and nanohlat/comm.py: the code
    that called the collective (or waited on it)."""
    import os
    import sys
    f = sys._getframe(1)
    skip = (os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "comm.py"))
    while f is not None:
        name = os.path.abspath(f.f_code.co_filename)
        if name not in skip and f"{os.sep}torch{os.sep}" not in name:
            return f"{os.path.relpath(name)}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _name(call) -> str:
    """'the recv from rank 2 started at nanohlat/beyond/context_parallel.py:412'."""
    peer = "" if call.peer is None else (f" to rank {call.peer}" if call.kind == "send" else f" from rank {call.peer}")
    return f"the {call.kind}{peer} started at {call.at}"


class _Waited:
    """A started collective's work handle, as torch.distributed returned it: the same object
    to the caller, except that its `wait()` is noted on the call."""

    def __init__(self, handle, call):
        self._handle, self._call = handle, call

    def wait(self, *args, **kwargs):
        Wire.waiting(f"the wait() of {_name(self._call)}", _caller())
        out = self._handle.wait(*args, **kwargs)
        Wire.waiting(None)
        if self._call.waited is None:
            self._call.waited = Wire.now()
        return out

    def __getattr__(self, name):
        return getattr(self._handle, name)


class Wire:
    """The collectives this rank called since `reset` (`Call`s: kind, process group, payload,
    wire bytes, whether started asynchronously and when it was waited).

    `install` wraps torch.distributed's collectives (and nanohlat/comm.py's
    references to them) in this worker process, so a collective is seen
    whether the student calls nanohlat.comm, torch.distributed or
    torch.distributed.nn. Wire bytes are a ring implementation's, as the comm
    ledger counts them: all-reduce 2 (n-1)/n x S, all-gather and
    reduce-scatter (n-1)/n x S; anything else, the whole payload."""

    calls: list = []
    _depth = [0]
    _clock = [0]
    board = None     # (a shared array of bytes: what this rank waits in now, for its parent: grading.spawn)
    progress = None  # (a shared counter, bumped whenever a call starts or returns)
    case = None      # (the case running, grading.case: named on the board)

    @classmethod
    def waiting(cls, what: str | None, at: str = "") -> None:
        """Note on the board what this rank is blocked in (None: nothing), and that it moved."""
        if cls.progress is not None:
            cls.progress.value += 1
        if cls.board is not None:
            text = b"" if what is None else f"{cls.case}\x1f{what} (waited at {at})".encode()[:len(cls.board) - 1]
            cls.board.value = text

    @classmethod
    def reset(cls) -> None:
        cls.calls = []

    @classmethod
    def now(cls) -> int:
        """A tick of the clock the calls are stamped with: a check marks a moment (before and after
        the student's function) and sees which calls started, and which were waited, in between."""
        cls._clock[0] += 1
        return cls._clock[0]

    @classmethod
    def install(cls) -> None:
        import inspect
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        wrapped = {}
        for name, (kind, arg) in _COLLECTIVES.items():
            orig = getattr(dist, name, None)
            if orig is None or orig in wrapped:
                continue
            wrapped[orig] = cls._wrap(orig, kind, arg, inspect.signature(orig), name in ("isend", "irecv"))
            setattr(dist, name, wrapped[orig])
            if getattr(c10d, name, None) is orig:
                setattr(c10d, name, wrapped[orig])
        from nanohlat import comm
        for alias, value in list(vars(comm).items()):   # comm binds some at import (_all_gather_tensor ...)
            if callable(value) and value in wrapped:
                setattr(comm, alias, wrapped[value])

    @classmethod
    def _wrap(cls, orig, kind, arg, sig, always_async):
        import torch.distributed as dist

        def collective(*args, **kwargs):
            outer = cls._depth[0] == 0    # one call, even if torch implements it with another
            cls._depth[0] += 1
            try:
                if not outer:
                    return orig(*args, **kwargs)
                bound = sig.bind_partial(*args, **kwargs).arguments
                pg = bound.get("group") or dist.group.WORLD
                n = dist.get_world_size(pg)
                payload = _nbytes(bound.get(arg))
                peer = next((bound[a] for a in ("dst", "src") if bound.get(a) is not None), None)
                for a in ("group_dst", "group_src"):   # (batch_isend_irecv names the peer by its rank in the group)
                    if peer is None and bound.get(a) is not None:
                        peer = dist.get_global_rank(pg, bound[a])
                call = Call(kind, pg, payload, _wire(kind, n, payload),
                            always_async or bool(bound.get("async_op", False)), cls.now(), peer, _caller())
                cls.calls.append(call)
                if not call.async_op:
                    cls.waiting(f"a blocking {_name(call)}", call.at)
                out = orig(*args, **kwargs)
                if not call.async_op:
                    cls.waiting(None)
                    call.waited = cls.now()           # it returned done
                    return out
                return _Waited(out, call) if out is not None else out
            finally:
                cls._depth[0] -= 1
        return collective


def _describe(calls) -> str:
    """'1 all_reduce (96 bytes) + 2 all_gather (64 bytes)': calls and payload by kind."""
    if not calls:
        return "no collective"
    by = {}
    for c in calls:
        n, b = by.get(c.kind, (0, 0))
        by[c.kind] = (n + 1, b + c.payload)
    return " + ".join(f"{n} {kind} ({b} bytes)" for kind, (n, b) in by.items())


def comm_verdict(what: str, group, want: list[tuple[str, int]], rank: int) -> str | None:
    """Hold the collectives recorded since `Wire.reset` against the oracle's `want`,
    [(kind, payload bytes), ...] on `group`. None when every call ran on `group`,
    with no more wire bytes and no more calls than the oracle's: a different
    kind that costs no more passes (an all-reduce with op MAX for the all-gather
    + max of the cross-entropy). Called once the values are right."""
    import torch.distributed as dist
    got = list(Wire.calls)
    want_calls = [Call(k, group.pg, p, _wire(k, group.size, p), False, 0) for k, p in want]
    for c in got:
        kind, pg = c.kind, c.pg
        if pg is not group.pg:
            which = "the default (world) process group" if pg is dist.group.WORLD else "another process group"
            article = "an" if kind[0] in "aeiou" else "a"
            return (f"{what} on rank {rank}: right values, but {article} {kind} ran on {which}, not on the {group.name} "
                    f"group it was given (ranks {group.ranks}): in a job with several {group.name} groups it "
                    f"would mix in ranks that hold other data (pass the group: group=...pg, or nanohlat.comm)")
    got_wire, want_wire = sum(c.wire for c in got), sum(c.wire for c in want_calls)
    if got_wire > want_wire:
        return (f"{what} on rank {rank}: right values, but {round(got_wire)} bytes on the wire where "
                f"{round(want_wire)} suffice (this rank called {_describe(got)}; {_describe(want_calls)} is enough)")
    if len(got) > len(want_calls):
        return (f"{what} on rank {rank}: right values, but {len(got)} collective call(s) where the oracle makes "
                f"{len(want_calls)} (this rank called {_describe(got)}; the oracle {_describe(want_calls)})")
    return None
