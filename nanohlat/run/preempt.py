"""Preemption-safe stopping: SIGTERM or Ctrl-C finish the step, save, exit.

(Before a rank trains, while it imports, checks, joins the job and builds its
model, there is nothing of the run to save: there a signal ends the process at
once, run/startup.py. This module's handler takes over from the Session on:
`catch_signals(until_training=True)` and `training_begins`.)

A cluster scheduler or a spot reclaim announces the end with SIGTERM and
kills a little later; a person presses Ctrl-C. Either way the step in flight
is the only work at risk, so a worker does not die at once: the first signal
sets a flag, the training loop finishes its step, every rank agrees to stop
there, the usual final checkpoint is saved, and the process exits with the
conventional code (128 + signal: 143 for SIGTERM, 130 for Ctrl-C).
`--resume auto` then continues from exactly that step. A second Ctrl-C means
"now": it raises KeyboardInterrupt wherever the process is; checkpoints are
written atomically, so the previous one is intact even mid-save.

Under `--nproc N` the launcher forwards the signal to its workers (PyTorch's
elastic agent does that, and torchrun's too). A Ctrl-C in a terminal also
reaches the workers directly, so they see it twice within milliseconds: a
repeat within DOUBLE_DELIVERY_S counts as the same press. A second Ctrl-C
that reaches only the launcher (`kill -INT` of its PID) is passed on by
PyTorch's agent as SIGTERM: after a SIGINT, a SIGTERM is that second press.

Agreeing on the step: ranks receive the signal at slightly different times,
and a rank that stopped one step before the others would leave them waiting
in a collective. So the flag is summed over the world group once per step
(the session's vote, run/session.py:Session.vote): one all-reduce of 2 numbers (the other: whether a
--async-save writer is still writing), ~0.1 ms on gloo, negligible next
to a step. On CUDA the loop synchronises every step anyway. On XLA reading a
device value stalls the host until the device catches up, so there the vote
is taken every XLA_CHECK_EVERY steps only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

DOUBLE_DELIVERY_S = 1.0
XLA_CHECK_EVERY = 10

_received: int | None = None      # the first signal, once one arrived
_received_at = 0.0


def _handler(signum, frame) -> None:
    global _received, _received_at
    if _received is None:
        _received, _received_at = signum, time.monotonic()
        if os.environ.get("RANK", "0") == "0":
            print(f"\n{signal.Signals(signum).name}: finishing this step, saving a checkpoint, then exiting"
                  + (" (Ctrl-C again to quit at once)" if signum == signal.SIGINT else ""), file=sys.stderr)
    elif time.monotonic() - _received_at > DOUBLE_DELIVERY_S and signal.SIGINT in (signum, _received):
        raise KeyboardInterrupt   # the second Ctrl-C: now (the last checkpoint is intact)


class catch_signals:
    """`with catch_signals() as signals: train(...)`: SIGTERM and SIGINT set the
    stop flag inside; on exit the previous handlers return, and
    `signals.exit_code` is 128 + the signal that stopped the run (143 SIGTERM,
    130 SIGINT), or 0. `until_training`: only from `training_begins()` on (the
    Session, once the run is built and resumed): before it, in its start-up, a
    rank has nothing of the run to save, and the handlers in place (train.py's:
    end at once, run/startup.py) stay."""

    def __init__(self, until_training: bool = False):
        self.until_training = until_training

    def __enter__(self):
        global _received, _waiting
        _received, self.exit_code = None, 0
        self.previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        _waiting = self.until_training
        if not _waiting:
            training_begins(now=True)
        return self

    def __exit__(self, *exc):
        global _received, _waiting
        for sig, handler in self.previous.items():
            if handler is not None:   # (None: a handler not set from Python, which stays)
                signal.signal(sig, handler)
        self.exit_code = 128 + _received if _received is not None else 0
        _received, _waiting = None, False
        return False


_waiting = False   # a catch_signals(until_training=True) waits for training_begins


def training_begins(now: bool = False) -> None:
    """(Session, its run built and resumed) From here a signal asks the run to stop after its step,
    when a catch_signals(until_training=True) is waiting for this (or `now`)."""
    global _waiting
    if _waiting or now:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _handler)
        _waiting = False


def requested() -> bool:
    return _received is not None
