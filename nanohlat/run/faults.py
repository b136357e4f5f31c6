"""Faults on purpose, for the fault lab and the tests: NANOHLAT_FAULTS.

A test-only environment variable, not a flag of train.py, so that no user
sets it by mistake (`python -m nanohlat.classroom fault ...` sets it for the
lab; classroom/fault_lab.py). Unset, every function here does nothing. Its
value is a list of faults separated by `;`, each a kind and its `key=value`
fields separated by `:`:

    kill:rank=1:step=5           kill -9 of rank 1 at the end of step 5 (once it is logged, before any
                                 evaluation or save of that step): the launcher sees a worker die
    hang:rank=1:step=5           rank 1 stops taking part at the same point of step 5: it sleeps, and
                                 the others wait in their next collective until --collective-timeout
    slow:rank=1:seconds=0.2      rank 1 sleeps 0.2 s before each of its steps (from=S: from step S on;
                                 until=S: up to step S), a straggler the others wait for
    kill-saving:rank=0:step=4    kill -9 of rank 0 half-way through writing its shard of step 4
    disk-full:rank=0:step=4      rank 0's disk fills half-way through its shard of step 4 (ENOSPC)

Every fault but `slow` acts on the first start only: a job the launcher
restarted (--max-restarts; TORCHELASTIC_RESTART_COUNT) would otherwise meet
it again. `attempt=N` moves it to the N-th restart, so that one run can be
killed again and again (the lab's many kills); `slow` acts on every attempt
unless given one. `rank` defaults to 0. A malformed value is one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
import time

from nanohlat.config import UserError

ENV = "NANOHLAT_FAULTS"
KINDS = ("kill", "hang", "slow", "kill-saving", "disk-full")
FIELDS = {"rank": int, "step": int, "attempt": int, "seconds": float, "from": int, "until": int}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = 0
    step: int = 0
    attempt: int | None = 0       # None: every attempt
    seconds: float = 0.0
    start: int = 1                # slow: the first and last step it slows
    stop: int = 2**62

    def now(self, rank: int, step: int | None = None) -> bool:
        """Whether this fault strikes rank `rank` (at `step`, if given) in this attempt."""
        if rank != self.rank or (self.attempt is not None and self.attempt != _attempt()):
            return False
        if self.kind == "slow":
            return step is None or self.start <= step <= self.stop
        return step is None or step == self.step


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)


def parse(text: str) -> list[Fault]:
    """NANOHLAT_FAULTS' value as Faults (module docstring); UserError for a malformed one."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise UserError(f"{ENV}: unknown fault {kind!r} in {item!r}; the kinds are {', '.join(KINDS)}")
        values = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in FIELDS or not value:
                raise UserError(f"{ENV}: {pair!r} in {item!r} is not one of "
                                f"{', '.join(k + '=...' for k in FIELDS)}")
            try:
                values[key] = None if key == "attempt" and value == "*" else FIELDS[key](value)
            except ValueError:
                raise UserError(f"{ENV}: {key}={value!r} in {item!r} is not a number") from None
        if kind != "slow" and values.get("step", 0) < 1:
            raise UserError(f"{ENV}: {item!r} needs step=S (a step from 1 on)")
        if kind == "slow" and not 0 < values.get("seconds", 0.0) < 3600:
            raise UserError(f"{ENV}: {item!r} needs seconds=X (more than 0, less than an hour)")
        faults.append(Fault(kind, values.get("rank", 0), values.get("step", 0),
                            values.get("attempt", None if kind == "slow" else 0), values.get("seconds", 0.0),
                            values.get("from", 1), values.get("until", 2**62)))
    return faults


_cache: tuple[str, list[Fault]] | None = None


def planted() -> list[Fault]:
    """The faults of this process's NANOHLAT_FAULTS (parsed once per value); [] when unset."""
    global _cache
    text = os.environ.get(ENV, "")
    if _cache is None or _cache[0] != text:
        _cache = (text, parse(text))
    return _cache[1]


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def at_step_end(step: int, rank: int) -> None:
    """Session.end_step, first thing: `kill` (kill -9 of this process) or `hang` (sleep for good: SIGTERM
    sets the stop flag and the sleep goes on, as a rank stuck in a call that never returns; the launcher
    kills it) of this rank at `step`."""
    for f in planted():
        if f.kind == "kill" and f.now(rank, step):
            _die()
        if f.kind == "hang" and f.now(rank, step):
            print(f"{ENV}: rank {rank} hangs at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)


def before_step(step: int, rank: int) -> None:
    """The end of Session.end_step (before step `step` starts): `slow` sleeps, a straggler."""
    for f in planted():
        if f.kind == "slow" and f.now(rank, step):
            time.sleep(f.seconds)


class _Struck:
    """A file that `kill-saving`s (kill -9) or fills (`disk-full`: ENOSPC, as the OS says it) once
    `half` bytes are written."""

    def __init__(self, f, fault: Fault, half: int):
        self.f, self.fault, self.room = f, fault, half

    def write(self, b):
        if len(b) > self.room:
            if self.fault.kind == "kill-saving":
                self.f.write(b[:self.room])
                self.f.flush()
                _die()
            raise OSError(errno.ENOSPC, "No space left on device", getattr(self.f, "name", None))
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)


def writer(f, step: int, rank: int, nbytes: int = 0):
    """saving.write_shard's file `f` for step `step`'s shard of rank `rank` (`nbytes` long, about):
    itself, or with a `kill-saving` or `disk-full` fault planted there, a file that strikes half-way."""
    for fault in planted():
        if fault.kind in ("kill-saving", "disk-full") and fault.now(rank, step):
            return _Struck(f, fault, max(1, nbytes // 2))
    return f
