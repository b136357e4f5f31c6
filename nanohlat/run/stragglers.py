"""Stragglers named: the rank the others wait for (--straggler-every, --straggler-factor).

In synchronous training every rank's step takes as long as the slowest
rank's: the others wait for it in their collectives. A rank that is merely
slow (a throttled chip, a noisy neighbour, a bad link) raises no error; the
whole job just runs at its pace. So the clock that finds it is not the step's
wall time, the same on every rank, but each rank's *own* time: the step's
wall time less the time the rank waited in collectives. The rank the others
wait for waits least and has the largest own time.

Each rank measures it with the host's clock: from the end of one step's
session work (Session.end_step) to the start of the next end_step (the first
step of a run, which warms up, is not timed), minus the
seconds its host was blocked in a collective. A `WaitClock` on each of the
mesh's process groups (comm.py's `trace` seam, which --timeline's CommTrace
uses too: it is kept, and told everything as before) times every blocking
collective, the pipeline's exchanges included, and every wait() on a started
one. Every
--straggler-every steps one all-gather of one number per rank (its mean own
time over those steps; through comm.py, in the comm ledger as world.all_gather)
gives every rank every rank's figure, and rank 0 names each rank whose own
time is more than --straggler-factor times the median of the other ranks',
with its coordinates (dp, pp, tp and, with --cp, cp) and by how much. The
summary lists them (summary.json's "stragglers").

Where the host's clock does not see the work: on cuda and xla the host runs
ahead of the device and a collective's call returns before it completes, so
there the watch is off (it would need the device's own timers: CUDA events).
It runs on the cpu (gloo), where a collective blocks its caller.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from nanohlat import comm
from nanohlat.mesh import coords


class _Blocked:
    """A blocking collective in flight: ended() adds its seconds to the clock (and tells the inner trace)."""

    def __init__(self, clock, inner):
        self.clock, self.inner, self.t0 = clock, inner, time.perf_counter()

    def ended(self) -> None:
        self.clock.blocked += time.perf_counter() - self.t0
        if self.inner is not None:
            self.inner.ended()


class _Waited:
    """A started collective's handle: its wait() is timed; everything else goes to the handle."""

    def __init__(self, clock, work):
        self.clock, self.work = clock, work

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.clock.blocked += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self.work, name)


class WaitClock:
    """A process group's `trace` (comm.py): the seconds this rank's host spends blocked in its
    collectives while `open`; `inner` (--timeline's CommTrace, or None) is told everything as before."""

    def __init__(self, inner=None):
        self.inner, self.open, self.blocked = inner, False, 0.0

    def issued(self, op: str, x: torch.Tensor, payload: int, what=None, work=None):
        inner = self.inner.issued(op, x, payload, what, work) if self.inner is not None else work
        if not self.open:
            return inner
        if work is None:
            return _Blocked(self, inner)
        return [_Waited(self, w) for w in inner] if isinstance(inner, list) else _Waited(self, inner)

    def timed(self, fn, *args):
        """--cp's attention timed by --timeline's trace (context_parallel.py), when there is one."""
        return self.inner.timed(fn, *args) if self.inner is not None else fn(*args)


class Stragglers:
    """One rank's watch (module docstring): `start` and `stop` bracket a step's own work, `check` every
    --straggler-every steps gathers and names. `found`: rank 0's findings, for the summary."""

    def __init__(self, mesh, tcfg, dev, say=print):
        self.mesh, self.tcfg, self.say = mesh, tcfg, say
        self.every, self.factor = tcfg.straggler_every, tcfg.straggler_factor
        self.on = self.every > 0 and mesh.world > 1 and dev.kind == "cpu"
        self.found: list[dict] = []
        self.own, self.steps, self.first, self.t0 = 0.0, 0, None, None
        if not self.on:
            return
        for group in {id(g): g for g in mesh.groups.values()}.values():   # every group this rank is in
            group.trace = WaitClock(group.trace)

    def _clocks(self) -> list[WaitClock]:
        clocks = {id(g.trace): g.trace for g in self.mesh.groups.values() if isinstance(g.trace, WaitClock)}
        return list(clocks.values())

    def start(self, step: int) -> None:
        """Step `step` begins: the clocks open (Session.end_step calls it for the next step; the first step
        of a run, or of a resumed one, is never timed: it does once what no later step does, the allocator's
        first blocks, the process groups' first connections, seconds on some ranks, none of it a rank's pace)."""
        if not self.on:
            return
        for c in self._clocks():
            c.open, c.blocked = True, 0.0
        self.first = step if self.first is None else self.first
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        """The step's own work is done (Session.end_step begins): its wall time less the waits."""
        if not self.on or self.t0 is None:
            return
        wall = time.perf_counter() - self.t0
        blocked = sum(c.blocked for c in self._clocks())
        for c in self._clocks():
            c.open = False
        self.own += max(0.0, wall - blocked)
        self.steps += 1
        self.t0 = None

    def check(self, step: int) -> None:
        """Every --straggler-every steps (every rank: a collective): one all-gather of each rank's mean
        own time since the last check; rank 0 names the ranks above --straggler-factor x the others' median."""
        if not self.on or step % self.every or not self.steps:
            return
        mine = torch.tensor([self.own / self.steps], dtype=torch.float64)
        world = self.mesh.group("world")
        times = comm.all_gather(mine, dataclasses.replace(world, trace=None)).tolist()   # (in the ledger)
        first, self.own, self.steps, self.first = self.first, 0.0, 0, None
        if self.mesh.rank != 0:
            return
        for r, t in enumerate(times):
            others = statistics.median(times[:r] + times[r + 1:])
            if others > 0 and t > self.factor * others:
                where = self.coordinates(r)
                self.found.append({"rank": r, **where, "steps": [first, step], "own_s": t, "others_median_s": others,
                                   "ratio": t / others})
                self.say(f"warning: straggler: rank {r} ({', '.join(f'{k} {v}' for k, v in where.items())}) took "
                         f"{t / others:.2f}x the other ranks' median own time in steps {first}-{step} "
                         f"({t * 1e3:.1f} ms a step against {others * 1e3:.1f} ms; own time: the step's wall time "
                         f"less its waits in collectives; --straggler-factor {self.factor:g})", file=sys.stderr)

    def coordinates(self, rank: int) -> dict:
        """Rank `rank`'s place in the mesh: dp, pp, tp (and cp with --cp), as the layout table prints them."""
        tp, pp, cp = self.mesh.tp, self.mesh.pp, self.tcfg.cp
        d, p, inner = coords(rank, tp * cp, pp, self.mesh.world // (tp * pp * cp))
        c, t = divmod(inner, tp)
        return {"dp": d, "pp": p, "tp": t, **({"cp": c} if cp > 1 else {})}

    def summary_line(self) -> str:
        """The run's end (rank 0): the stragglers named, or "" when none was."""
        if not self.found:
            return ""
        ranks = sorted({f["rank"] for f in self.found})
        worst = {r: max(f["ratio"] for f in self.found if f["rank"] == r) for r in ranks}
        return "stragglers: " + "; ".join(f"rank {r} named {sum(f['rank'] == r for f in self.found)} time(s), at "
                                          f"most {worst[r]:.2f}x the others" for r in ranks)
