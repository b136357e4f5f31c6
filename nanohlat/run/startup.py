"""Start-up that a signal always ends: Ctrl-C or SIGTERM before training begins stop a run at once.

Before a rank trains there is nothing of this run to save, so a signal then ends the
process at once, whatever it is doing: one line ("interrupted" after Ctrl-C, "stopped
by SIGTERM") and exit code 130 / 143 (128 + the signal), the run lock released. Once
the rank trains, preempt.py's handler takes over (finish the step, save, exit).

Why the interpreter's own KeyboardInterrupt is not enough. Raised inside an import it
can be swallowed: torch's start-up imports numpy from C++ and takes any error there as
"no numpy", so the signal is lost (measured: `import train` went on after 1 SIGINT in 20;
`train.py --nproc 2` trained all its steps after 9 Ctrl-C's in 12 sent in its first
seconds, exit 0). And a process waiting in C++ (a rank joining the process group) runs
no Python handler until the call returns, which after a peer died is never. So the
handler installed here never raises: it ends the process; and a watcher thread reads
each signal from the interpreter's wakeup pipe (signal.set_wakeup_fd), which the C-level
handler writes from any state, and ends the process from there while the handler
installed is this module's. Which one it is decides:

  * `guard()`: train.py's first statement, in the launcher and in each worker of
    `--nproc N` (which runs train.py's top as __mp_main__): at once, until
  * preempt.catch_signals (around train()) asks the run to stop after its step; joining
    the process group (launch.rendezvous_deadline: `at_once()`) is at once again;
  * the launcher of `--nproc N`: torch's elastic agent installs its own handler as it
    starts the workers (it forwards the signal to them, then waits for their checkpoint):
    from then on the watcher leaves signals to it, and launch.spawn puts the guard back
    once the workers are gone.

A worker of `--nproc N` that leaves at once leaves a note (`left`) in the launcher's
folder; a rank that already trains (its stop, at its step's end, needs every rank) ends
at once too when it sees a peer's note after a signal, instead of waiting
--collective-timeout in a collective that the peer never joins.

The first milliseconds of a worker's interpreter, before train.py's first line runs, would
turn a signal into a KeyboardInterrupt traceback from its `site` import (1 try in 27 hit them):
the workers start with both signals blocked (`workers_start_blocked`), until `guard()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# set by launch.spawn for its workers (nothing here imports: a signal can come in the middle of an import)
LAUNCHER_ENV = "NANOHLAT_LAUNCHER_PID"   # the launcher's pid (launch.follow_launcher)
ERRORS_ENV = "NANOHLAT_WORKER_ERRORS"    # its folder for the workers' one-line errors (launch.report_error)
POLL_S = 0.1             # how often a rank that trains looks for a peer's note, once signalled
HANDLER_FIRST_S = 0.5    # how long the watcher leaves a signal to the main thread's handler
_read_fd: int | None = None
_ending = threading.Lock()   # the handler and the watcher: one of them ends the process,
_ender: int | None = None    # this thread
_polling = threading.Event()


def guard() -> None:
    """(Main thread.) From now on SIGINT and SIGTERM end this process at once (the module docstring).
    A worker of --nproc N starts with both blocked (`workers_start_blocked`): one that came meanwhile
    is delivered here, to this handler."""
    for sig in SIGNALS:
        signal.signal(sig, _at_once)
    _watch()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


@contextlib.contextmanager
def workers_start_blocked():
    """(A launcher's main thread, around starting its workers.) SIGINT and SIGTERM blocked in this
    thread, so that the processes it starts inherit them blocked until their `guard()`: a signal in
    the first milliseconds of a worker's interpreter is otherwise a KeyboardInterrupt traceback from
    its `site` import. This process still gets them: the kernel hands them to a thread that does not
    block them (the watcher), and Python runs their handlers in the main thread as always. Only with
    the watcher running (train.py's guard): without another thread, blocking would ignore them."""
    if _read_fd is None:
        yield
        return
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()   # (started later, it would unblock both in this thread as it is made)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class at_once:
    """`with at_once(): ...`: the body (joining the process group) ends at once on a signal;
    the handlers in place before come back after it. (Main thread.)"""

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, _at_once) for sig in SIGNALS}
        _watch()
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


def _at_once(signum, frame) -> None:
    end(signum)


def end(signum: int) -> None:
    """End this process now with 128 + `signum`: its one line (a launcher's, a single process's,
    torchrun's rank 0's; a worker of --nproc says nothing: its launcher speaks), a worker's note
    for its peers, the run locks released (runlock.release_all), then os._exit."""
    global _ender
    if not _ending.acquire(blocking=False):
        if _ender == threading.get_ident():   # a second signal, in the handler of the first: it goes on
            return
        while True:                           # the other thread is ending the process
            time.sleep(1)
    _ender = threading.get_ident()
    if _worker():
        _leave_note()
    elif os.environ.get("RANK", "0") == "0":
        print("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
              file=sys.stderr, flush=True)
    runlock = sys.modules.get("nanohlat.run.runlock")
    if runlock is not None:
        try:
            runlock.release_all()
        except Exception:   # (best effort: the kernel drops the locks with the process anyway)
            pass
    sys.stdout.flush()
    os._exit(128 + signum)


def _watch() -> None:
    """The wakeup pipe and its reader thread, once per process."""
    global _read_fd
    if _read_fd is not None:
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _read_fd = r
    threading.Thread(target=_watcher, args=(r,), daemon=True, name="signal-watch").start()


def _watcher(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum not in SIGNALS:
                continue
            if signal.getsignal(signum) is _at_once:
                # the handler first: running Python, the main thread runs it within milliseconds (ending
                # from here meanwhile, the main thread would go on with its run lock closed under it)
                time.sleep(HANDLER_FIRST_S)
                end(signum)   # (the main thread waits in C++: joining, a collective, a lock)
            elif _worker() and not _polling.is_set():   # a rank that trains: its peers may have left
                _polling.set()
                threading.Thread(target=_poll_peers, args=(signum,), daemon=True, name="peer-watch").start()


# ---------------------------------------------------------------------------
# Notes between the workers of `--nproc N` (in the launcher's folder for their errors)
# ---------------------------------------------------------------------------

def _worker() -> bool:
    launcher = os.environ.get(LAUNCHER_ENV)
    return bool(launcher) and launcher != str(os.getpid())


def _note(rank: str) -> str | None:
    folder = os.environ.get(ERRORS_ENV)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.path.join(folder, f"left-{attempt}-rank{rank}") if folder and os.path.isdir(folder) else None


def _leave_note() -> None:
    path = _note(os.environ.get("RANK", "0"))
    if path:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError:
            pass


def _poll_peers(signum: int) -> None:
    """(A worker that trains, signalled.) End at once when a peer of this attempt left a note."""
    mine, pattern = _note(os.environ.get("RANK", "0")), _note("")
    if not pattern:
        return
    folder, prefix = os.path.split(pattern)
    while True:
        try:
            names = os.listdir(folder)
        except OSError:
            return
        if any(n.startswith(prefix) and os.path.join(folder, n) != mine for n in names):
            end(signum)
        time.sleep(POLL_S)
