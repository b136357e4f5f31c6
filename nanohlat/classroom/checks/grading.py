"""Grading the checks: verdicts, and the gloo workers that distributed checks run on."""

from __future__ import annotations

import os
import traceback

import torch

from nanohlat.system.cli import STUB
from nanohlat.classroom.checks.wire import Wire

HERE = os.path.dirname(os.path.abspath(__file__))   # the checks' files: a verdict points past them
TOL = dict(rtol=1e-5, atol=1e-5)   # fp32 round-off of the same sums added in another order
from nanohlat.classroom.isolate import TIME_LIMIT   # seconds for one check (a distributed one: start-up included)


# ---------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------

def compare(what: str, got, want, rank: int | None = None, rtol=TOL["rtol"], atol=TOL["atol"]) -> str | None:
    """None when `got` equals `want` within tolerance, else a one-paragraph verdict."""
    where = f" on rank {rank}" if rank is not None else ""
    if not isinstance(got, torch.Tensor):
        return f"{what}{where}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got64, want64 = got.detach().double(), want.detach().double()
    bad = ~((got64 - want64).abs() <= atol + rtol * want64.abs())
    bad |= torch.isnan(got64) != torch.isnan(want64)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    diff = (got64 - want64).abs().nan_to_num(float("inf"))
    return (f"{what}{where} differs from the oracle in {int(bad.sum())} of {bad.numel()} elements; "
            f"first at index {list(idx)}: got {got64[idx].item():.6g}, expected {want64[idx].item():.6g} "
            f"(largest difference {diff.max().item():.3g}; tolerance {atol:g} + {rtol:g} x |expected|)")


class Kept:
    """A tensor handed to the student's code, as it was: its values (a clone) and its version
    counter, to see afterwards whether the code wrote into it (`untouched`)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.values, self.version = t, t.detach().clone(), t._version


def untouched(what: str, which: str, kept: Kept, why: str, rank: int | None = None) -> str | None:
    """None when the tensor `kept` holds still has its values and version, else a verdict: the code
    wrote into `which` (its input, say) in place, and `why` that is wrong. Values are compared, not
    only the version counter: torch.distributed's in-place collectives (all_reduce(x) ...) change
    a tensor without bumping its counter."""
    t = kept.t.detach()
    changed = t.shape != kept.values.shape or not torch.equal(t.isnan(), kept.values.isnan()) or \
        not torch.equal(t.nan_to_num(), kept.values.nan_to_num())
    if not changed and kept.t._version == kept.version:
        return None
    where = f" on rank {rank}" if rank is not None else ""
    if changed and t.shape == kept.values.shape:
        bad = (t.nan_to_num() != kept.values.nan_to_num()) | (t.isnan() != kept.values.isnan())
        idx = tuple(int(i) for i in bad.nonzero()[0])
        how = (f"{int(bad.sum())} of {bad.numel()} elements changed, first at index {list(idx)}: "
               f"{kept.values[idx].item():.6g} became {t[idx].item():.6g}")
    else:
        how = f"an in-place operation on it (version {kept.version} -> {kept.t._version})"
    return f"{what}{where}: right values, but it wrote into {which} in place ({how}): {why}"


_CASE = {"name": None}   # the case a check is running, named in an error raised during it


def case(name: str) -> str:
    """Mark the start of a named case: an exception raised from here on names it."""
    _CASE["name"] = Wire.case = name
    return name


def explain(e: BaseException, exercise: str | None = None) -> str:
    """A student's exception as a verdict: a stub (this exercise's, or one it
    needs first; the stub's message may arrive wrapped in another error), or
    where their code raised."""
    stub = STUB.search(str(e))
    if stub:
        if exercise and stub.group(1) != exercise:
            return f"not done yet: exercise {exercise} needs exercise {stub.group(1)} first ({stub.group(0)})"
        return f"not done yet: {stub.group(0)}"
    tb = traceback.extract_tb(e.__traceback__)
    kit = (HERE, os.path.join(os.path.dirname(HERE), "isolate.py"))   # not these files, nor the import machinery
    mine = [f for f in tb if os.path.dirname(os.path.abspath(f.filename)) != HERE and
            os.path.abspath(f.filename) not in kit and not f.filename.startswith("<frozen")] or tb
    at = f" at {os.path.relpath(mine[-1].filename)}:{mine[-1].lineno}" if mine else ""
    during = f"{_CASE['name']}: " if _CASE["name"] else ""
    return f"{during}raised {type(e).__name__}: {e}{at}"


# ---------------------------------------------------------------------------
# gloo workers
# ---------------------------------------------------------------------------

STALL_S = 10.0   # seconds every unfinished rank may sit blocked in a collective, none moving, before
                 # spawn calls it a deadlock (gloo moves a check's few bytes in microseconds)


def _worker(rank, world, port, fn, args, queue, board, progress):
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    told = False
    Wire.board, Wire.progress = board, progress
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIME_LIMIT))
        Wire.install()
        try:
            verdict = fn(rank, world, *args)
        except Exception as e:
            verdict = explain(e)
        except SystemExit as e:   # an exit is a failure, never a pass (isolate.py)
            verdict = f"the code exited on rank {rank} ({explain(e).removeprefix('raised ')}): an exit ends no check with a pass"
        queue.put((rank, verdict))
        told = True
        dist.destroy_process_group()
    except Exception as e:   # gloo itself failed (e.g. a peer died)
        if not told:         # (not the verdict's own aftermath: a peer that left with a message in flight)
            queue.put((rank, explain(e)))


def spawn(fn, world: int, *args) -> str | None:
    """Run fn(rank, world, *args) on `world` gloo processes; the first failing rank's verdict
    (a stub's first, wherever it was met)."""
    import queue as queue_mod
    import torch.multiprocessing as mp
    from nanohlat.run.launch import free_port, start_method
    ctx = mp.get_context(start_method())
    q = ctx.Queue()
    port = free_port()
    boards = [ctx.Array("c", 400, lock=False) for _ in range(world)]   # what each rank is blocked in (Wire)
    progress = [ctx.Value("q", 0, lock=False) for _ in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q, boards[r], progress[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    verdicts = {}
    import time
    deadline = time.monotonic() + TIME_LIMIT
    gone = {}   # rank -> exit code of a rank that ended without a verdict (os._exit, a crash)
    stalled = None   # [(rank, what it is blocked in)] once every unfinished rank sat blocked STALL_S
    moved, still_since = None, time.monotonic()
    try:
        while len(verdicts) < world and time.monotonic() < deadline and not gone and not stalled:
            try:
                rank, v = q.get(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
                verdicts[rank] = v
            except queue_mod.Empty:
                left = [r for r in range(world) if r not in verdicts]
                now = [(progress[r].value, boards[r].value) for r in left]
                if now != moved or not all(b for _, b in now):
                    moved, still_since = now, time.monotonic()
                elif time.monotonic() - still_since > STALL_S:
                    stalled = [(r, *b.decode(errors="replace").partition("\x1f")[::2]) for r, (_, b) in zip(left, now)]
                gone = {r: p.exitcode for r, p in enumerate(procs) if r not in verdicts and p.exitcode is not None}
                while gone:   # (a verdict put just before its rank exited is still in the queue)
                    try:
                        rank, v = q.get(timeout=0.2)
                    except queue_mod.Empty:
                        break
                    verdicts[rank] = v
                    gone.pop(rank, None)
    finally:
        for p in procs:
            p.join(timeout=5 if len(verdicts) == world else 0.1)
            if p.is_alive():
                p.kill()
    if gone:
        return (f"rank(s) {sorted(gone)} ended without a verdict (exit code {', '.join(map(str, gone.values()))}): "
                f"the code called os._exit or crashed, and an exit ends no check with a pass")
    if stalled:
        done = [r for r in range(world) if r in verdicts]
        return (f"{stalled[0][1]}: a deadlock: for {STALL_S:.0f} s no rank moved; "
                + "; ".join(f"rank {r} blocked in {what}" for r, _, what in stalled)
                + (f" (rank(s) {done} had finished)" if done else "")
                + ": each waits for a message or a collective that its peers never start (or that has "
                  "already been waited)")
    if len(verdicts) < world:
        stuck = [r for r in range(world) if r not in verdicts]
        return (f"rank(s) {stuck} did not finish within {TIME_LIMIT:.0f} s: usually a collective that only "
                f"some ranks call, so the others wait for it forever")
    # a stub on one rank is why its peers' collectives failed ("Connection closed by peer"): name it first
    failed = [verdicts[r] for r in range(world) if verdicts[r]]
    stubs = [v for v in failed if v.startswith("not done yet")]
    return (stubs or failed or [None])[0]


def make_group(rank: int, world: int, name: str, ranks: list[int] | None = None):
    """A group `name` ("tp", "dp", ...) of `ranks` (all `world` by default) as the model's layers expect it,
    on a process group of its own, not the default (world) one: a collective
    called on the default group instead of the one given is then seen (`Wire`).
    Every rank must make the same groups in the same order (torch.distributed's rule)."""
    import torch.distributed as dist
    from nanohlat.comm import Group
    ranks = list(range(world)) if ranks is None else ranks
    pg = dist.new_group(ranks)
    return Group(name, ranks, ranks.index(rank) if rank in ranks else -1, pg)
