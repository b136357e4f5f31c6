"""Starting workers: `train.py --nproc N`, torchrun, or one plain process.

Three ways in, one worker function:
  * `python train.py` (nproc 1): the worker runs in this process, no
    torch.distributed at all (every process group has size 1).
  * `python train.py --nproc N`: we start N local workers with PyTorch's
    elastic launcher (the machinery behind `torchrun`), on a free loopback
    port, restarting them up to --max-restarts times after a failure.
  * `torchrun --nproc_per_node N [--nnodes ...] train.py ...`: torchrun
    started us; RANK / WORLD_SIZE / LOCAL_RANK come from the environment.

After a restart the new workers resume from the newest complete checkpoint
(preflight.py asks `restart_count()`). One PyTorch wrinkle: since torch 2.5 the
workers share the launcher's rendezvous store by default, and a restarted
group can read the dead group's addresses from it and fail to connect
(pytorch/pytorch#135712). `spawn` therefore gives every attempt its own store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a documented PyTorch runtime variable);
under `torchrun --max-restarts` set it yourself (`torchrun_restart_warning`).

Nothing here may hang or speak in tracebacks: RANK / WORLD_SIZE /
LOCAL_RANK are checked before use, joining the process group has a deadline
(--rendezvous-timeout; a rank whose partners never come says so in one line
and exits 2), a rank stopped or stuck mid-run ends the job after
--collective-timeout (`StuckRankWatch` below), and a job stopped by SIGTERM or Ctrl-C (nanohlat/run/preempt.py)
ends with 143 or 130 after its workers saved a checkpoint. Nor may a worker
outlive its launcher: one whose launcher died (`kill -9`) ends at once,
saving nothing (`follow_launcher`), so no process of a dead run writes into
an out-dir that a new run holds (the workers also hold its lock: runlock.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid

from nanohlat.config import UserError
from nanohlat.run import startup
from nanohlat.system import files
from nanohlat.system.cli import not_done

ENV_HINT = "RANK, WORLD_SIZE (and MASTER_ADDR, MASTER_PORT)"


def _env_int(name: str, default: int | None = None, low: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < low:
        raise UserError(f"environment variable {name}={raw!r} is not an integer >= {low}; a launcher such as "
                        f"torchrun sets {ENV_HINT} for each process: unset them to train in one process")
    return value


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when a launcher started this process,
    checked: integers, 0 <= RANK < WORLD_SIZE (UserError otherwise)."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        missing = "RANK" if "RANK" not in os.environ else "WORLD_SIZE"
        raise UserError(f"{missing} is not set but {'WORLD_SIZE' if missing == 'RANK' else 'RANK'} is; "
                        f"set both (a launcher such as torchrun does) or neither")
    world = _env_int("WORLD_SIZE", low=1)
    rank = _env_int("RANK")
    if rank >= world:
        raise UserError(f"RANK={rank} is not below WORLD_SIZE={world}; ranks are 0 .. WORLD_SIZE-1")
    return rank, world, _env_int("LOCAL_RANK", 0)


def check_nproc(nproc: int, env) -> None:
    """--nproc N in a process a launcher started (`env`: torchrun_env()) with
    another world size: refused, not silently ignored (the launcher, not
    --nproc, decides how many processes there are)."""
    if env and nproc > 1 and nproc != env[1]:
        raise UserError(f"--nproc {nproc}, but a launcher started this process as one of WORLD_SIZE={env[1]} "
                        f"(RANK and WORLD_SIZE are set): drop --nproc and start {nproc} with the launcher "
                        f"(torchrun --nproc_per_node {nproc}), or unset RANK and WORLD_SIZE")


def local_world_size() -> int:
    return _env_int("LOCAL_WORLD_SIZE", 1, low=1)


@contextlib.contextmanager
def rendezvous_deadline(seconds: float, rank: int, world: int, on_timeout=None):
    """Run the body (joining the process group), but never for longer than `seconds`.

    The join blocks inside C++ until every rank has arrived, where no Python
    exception can reach it; so a watchdog thread prints one line and ends the
    process (exit code 2) when the deadline passes. `on_timeout` runs first
    (e.g. releasing the run lock). Errors raised while joining (an address in
    use, a refused connection) become one line too.
    """
    done = threading.Event()

    def watchdog():
        if done.wait(seconds):
            return
        others = "rank 0" if rank else ("rank 1" if world == 2 else f"some of ranks 1..{world - 1}")
        env = ", ".join(f"{k}={os.environ.get(k)}" for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
        print(f"error: rank {rank} of {world} waited {seconds:g}s for the other ranks to join; {others} did not "
              f"arrive ({env}): start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, "
              f"or raise --rendezvous-timeout", file=sys.stderr, flush=True)
        if on_timeout:
            on_timeout()
        os._exit(2)

    threading.Thread(target=watchdog, daemon=True, name="rendezvous-watchdog").start()
    try:
        with startup.at_once():   # a signal while joining: nothing trained yet, end now (run/startup.py)
            yield
    except (RuntimeError, ValueError) as e:   # torch.distributed's errors (DistNetworkError, ...) are RuntimeErrors
        first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        raise UserError(f"rank {rank} of {world} could not join the process group ({first}); check "
                        f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT={os.environ.get('MASTER_PORT')}") \
            from None
    finally:
        done.set()


def restart_count() -> int:
    """How often the launcher (torchrun, or train.py --max-restarts) has
    restarted this worker group after a failure; 0 on the first start. A
    restarted job resumes from its newest checkpoint, whatever --resume said."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NEW_LINE = "\n"   # before a failure's lines, after a progress bar a failed worker left unfinished
RESUME_HINT = "; --resume auto continues from the last complete checkpoint"   # (saved on the way out, but
                                                                               # for a second Ctrl-C)


def spawn(entry, args: tuple, nproc: int, max_restarts: int = 0, collective_timeout: float | None = None,
          stop_hint: str = RESUME_HINT, progress: bool = False) -> int:
    """Run entry(*args) in nproc local workers; returns an exit code. `stop_hint`
    follows "stopped by a signal" (sample.py, which saves nothing, gives "").
    `progress`: rank 0 draws a progress bar, whose line a failure's line starts below.

    A worker that dies (exception, exit code, SIGKILL) makes the launcher stop
    all the others promptly, then restart the group (up to max_restarts) or
    report which rank failed and why. A worker stopped (SIGSTOP) for longer
    than `collective_timeout` is killed and named (`StuckRankWatch`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    extra = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:   # (newer torch)
        # on SIGTERM / Ctrl-C the launcher forwards the signal, then waits this long for
        # the workers to save their checkpoint before it kills them (torch's default: 30 s)
        extra["shutdown_timeout"] = SHUTDOWN_TIMEOUT_S
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn", **extra,
    )
    from nanohlat.run import runlock
    locks = runlock.share_all()     # our run lock, made shared: the workers hold it with us (follow_launcher)
    saved = {k: os.environ.get(k) for k in (_OWN_STORE, ERRORS_ENV, PIDS_ENV, LAUNCHER_ENV, LOCKS_ENV)}
    os.environ[_OWN_STORE] = "1"    # a fresh store per attempt (see the module docstring)
    os.environ[LAUNCHER_ENV] = str(os.getpid())   # the workers die with us (follow_launcher)
    os.environ[LOCKS_ENV] = os.pathsep.join(locks)
    errors = tempfile.mkdtemp(prefix="nanohlat-errors-")
    os.environ[ERRORS_ENV] = errors  # workers leave their one-line errors here (report_error)
    pids = tempfile.mkdtemp(prefix="nanohlat-pids-")
    os.environ[PIDS_ENV] = pids      # workers note their pids here (note_worker_pid), for the watch
    watch = StuckRankWatch(pids, collective_timeout) if collective_timeout else None
    logging.disable(logging.ERROR)   # torch's launcher logs each failure as a traceback: we say it in one line
    # from the workers' start the agent's signal handlers (it forwards the signal, then waits for the
    # checkpoint); before them, and after, this process's own (train.py's: at once, run/startup.py)
    handlers = {sig: signal.getsignal(sig) for sig in startup.SIGNALS}
    try:
        if watch:
            watch.start()
        with startup.workers_start_blocked():   # (until each worker's guard: run/startup.py)
            elastic_launch(config, _worker_main)(entry, *args)
        return 0
    except SignalException as e:   # we were signalled: the workers got it too, saved, and stopped
        print(f"{NEW_LINE if progress else ''}stopped by {e.sigval.name}{stop_hint}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if progress:   # (the bar's line ends with no newline: ours start below it, not on it)
            print(NEW_LINE, end="", file=sys.stderr)
        if watch and watch.stuck:
            return watch.report()
        return _report_failures(e.failures, errors, stop_hint)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if watch:
            watch.stop()
        logging.disable(logging.NOTSET)
        shutil.rmtree(errors, ignore_errors=True)
        shutil.rmtree(pids, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_main(entry, *args):
    """What each worker of `spawn` runs: entry(*args), tied to its launcher first."""
    follow_launcher()
    return entry(*args)


def follow_launcher() -> None:
    """A worker of `spawn` does not outlive its launcher, and holds the run lock with it.

    If the launcher dies without stopping its workers (`kill -9`, the OOM killer),
    they must not go on training and saving into an out-dir that a new run may
    take meanwhile. On Linux the kernel kills this worker the moment its parent
    dies (prctl's PR_SET_PDEATHSIG, with SIGKILL: nothing more is written, no
    checkpoint published); elsewhere, and for a launcher already gone before
    that was set, a thread sees the parent change within POLL_PARENT_S and ends
    the process. The worker also takes a shared lock of the launcher's out-dir
    (runlock.hold_shared), so a new run starts only after the last worker is gone."""
    from nanohlat.run import runlock
    launcher = int(os.environ.get(LAUNCHER_ENV) or 0)
    if not launcher:
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(1)                              # it died before we got here

    def watch():
        while os.getppid() == launcher:
            time.sleep(POLL_PARENT_S)
        print(f"error: rank {os.environ.get('RANK', '?')}: the launcher (PID {launcher}) is gone: this worker "
              f"stops without saving", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="follow-launcher").start()
    try:
        for path in filter(None, os.environ.get(LOCKS_ENV, "").split(os.pathsep)):
            runlock.hold_shared(path)
    except UserError as e:
        report_error(str(e))
        sys.exit(2)


def start_method() -> str:
    """How the tests' and the classroom checks' worker groups start processes.

    "spawn" starts a fresh Python per worker, and each imports torch again:
    2-3 s of CPU apiece. On Linux these groups use "forkserver": one server
    process, started at the first group, imports torch once, and each worker
    is a fork of it, ready in milliseconds. (Not "fork": a copy of the caller,
    whose threads and locks a child must not inherit. On macOS forking after
    some system libraries have loaded is unsafe, so there we spawn.)

    A forkserver worker inherits the server's environment and stdout, not the
    caller's as they are now, and it is the server's child, not the caller's.
    That is fine where results come back through a queue or files and the
    environment is passed explicitly; `spawn` above (train.py --nproc) keeps
    "spawn": its workers print to the terminal as it is, read the environment
    of the moment, and a dead worker is seen and named at once.
    """
    if not sys.platform.startswith("linux"):
        return "spawn"
    import multiprocessing
    multiprocessing.set_forkserver_preload(["torch"])
    return "forkserver"


def _report_failures(failures: dict, errors: str, stop_hint: str = RESUME_HINT) -> int:
    """One line per distinct cause the workers reported (report_error: usually one),
    `error: rank R: <cause>`, and one per failed rank that said nothing (killed);
    returns the job's exit code: 2 when every failed rank exited 2 (a user error)."""
    codes = [f.exitcode for f in failures.values()]
    if codes and all(c in (128 + signal.SIGTERM, 128 + signal.SIGINT) for c in codes):
        print(f"stopped by a signal{stop_hint}", file=sys.stderr)
        return codes[0]
    reported = {}    # rank -> its one-line cause (report_error)
    for name in os.listdir(errors):
        if name.startswith("rank") and name.endswith(".txt") and name[4:-4].isdigit():
            with open(os.path.join(errors, name), errors="replace") as f:
                reported[int(name[4:-4])] = f.read().strip()
    by_cause = {}
    for rank in sorted(reported):           # the same cause from every rank: said once
        by_cause.setdefault(reported[rank], []).append(rank)
    lines, stubs = [], []                   # a classroom stub's line comes last: it is the cause to act on
    # A rank killed, or dead before it could say why, first: the others' lost connections follow from it
    # (after kill -9 of one cp worker, rank 0's "Connection closed by peer" came first)
    for rank, failure in sorted(failures.items(), key=lambda rf: (rf[1].exitcode >= 0, rf[0])):   # signals first
        if rank not in reported:
            how = f" (signal {failure.signal_name()})" if failure.exitcode < 0 else ""
            lines.append(f"error: rank {rank} failed with exit code {failure.exitcode}{how}")
    for cause, ranks in by_cause.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        (stubs if NOT_DONE.match(cause) else lines).append(f"error: {who}: {cause}")
    if lines or stubs:
        print("\n".join(lines + stubs), file=sys.stderr)
    return 2 if stubs or (codes and all(c == 2 for c in codes)) else 1


def report_error(message: str) -> None:
    """A worker's one-line error: to the launcher (which says each distinct one once)
    when `spawn` started us, else to stderr."""
    folder = os.environ.get(ERRORS_ENV)
    if folder and os.path.isdir(folder):
        try:   # the launcher's temporary folder (a full disk must not hide the cause: stderr then)
            files.write_text(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt"), message)
            return
        except OSError:
            pass
    print(f"error: {message}", file=sys.stderr)


def worker_stub(e: BaseException) -> None:
    """In a worker's catch-all: an exercise stub reached (system/cli.py:command) is this
    worker's one-line error (report_error) and exit code 2; else nothing.
    A worker whose peer stopped at a stub (its collective then fails:
    "connection closed by peer") says so in one line, exit 2, no traceback:
    the peer's line, which `_report_failures` prints last, is the cause.
    os._exit: a process group torn down at interpreter exit can abort the
    process (gloo, see preflight.worker) and turn the 2 into a signal."""
    line = not_done(e)
    if line is None and _peer_reached_a_stub():
        line = "stopped: a peer rank reached an exercise stub (below)"
    if line is not None:
        report_error(line)
        hard_exit(2)   # (torchrun's rank 0 holds the run lock itself: released there)


def hard_exit(code: int) -> None:
    """End this worker now with `code`: its run locks released, stdout and stderr
    flushed, then os._exit, skipping the interpreter's exit, where tearing down a
    process group can wait seconds for the peers or abort (gloo). The one way a
    worker leaves early (worker_stub, preflight.worker's second Ctrl-C and
    collective timeout); nothing is saved."""
    from nanohlat.run import runlock
    runlock.release_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


NOT_DONE = re.compile(r"exercise \d+[a-z] is not done yet \(")   # system/cli.py:not_done's line


def _peer_reached_a_stub() -> bool:
    """Whether another worker of this `spawn` reported an exercise stub (report_error)."""
    folder = os.environ.get(ERRORS_ENV)
    try:
        names = os.listdir(folder) if folder else []
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(folder, name), errors="replace") as f:
                if NOT_DONE.match(f.read().strip()):
                    return True
        except OSError:
            continue
    return False


def crash_line(e: BaseException) -> str:
    """An unexpected exception as one line: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


_OWN_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ERRORS_ENV = startup.ERRORS_ENV         # workers leave their one-line errors there (report_error)
PIDS_ENV = "NANOHLAT_WORKER_PIDS"
LAUNCHER_ENV = startup.LAUNCHER_ENV     # set by `spawn` for its workers (follow_launcher)
LOCKS_ENV = "NANOHLAT_RUN_LOCKS"         # the run locks they hold with it
POLL_PARENT_S = 0.2
_PR_SET_PDEATHSIG = 1                    # <linux/prctl.h>
SHUTDOWN_TIMEOUT_S = 300


def torchrun_restart_warning() -> str | None:
    """A warning for `torchrun --max-restarts R` runs that share the agent's
    store (TORCHELASTIC_* variables are set by torchrun for its workers)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (f"warning: torchrun --max-restarts {restarts} with a shared rendezvous store: restarted workers "
                f"may fail to connect (pytorch/pytorch#135712); start torchrun with "
                f"{_OWN_STORE}=1 in its environment")
    return None


# ---------------------------------------------------------------------------
# Stuck ranks (--collective-timeout)
# ---------------------------------------------------------------------------
#
# Two parts. Every rank's process group is made with --collective-timeout
# (device.init_process_group): on gloo and nccl a collective that waits longer
# than that for a peer raises, and `preflight.worker` turns the error into one
# line (`collective_timeout_message`) and exit 1. That part works anywhere,
# torchrun included, but it can only say "a peer of rank r stopped", not which.
# Under `train.py --nproc N` the launcher also watches its workers: one that
# the kernel reports stopped (SIGSTOP, a debugger: state T in /proc/PID/stat)
# for longer than the timeout is killed (a stopped process does not act on SIGTERM, so
# torch's shutdown would wait 30 s for it) and named in the job's one line.

def note_worker_pid(rank: int) -> None:
    """A worker started by `spawn` tells the launcher its pid (a file per rank)."""
    folder = os.environ.get(PIDS_ENV)
    if folder and os.path.isdir(folder):
        files.write_text(os.path.join(folder, f"rank{rank}"), str(os.getpid()))


def is_collective_timeout(e: BaseException) -> bool:
    """gloo's "Timed out waiting 5000ms for recv operation to complete" (or send),
    nccl's watchdog "... ran for 5000 milliseconds before timing out"."""
    text = str(e)
    return isinstance(e, RuntimeError) and ("Timed out waiting" in text or "before timing out" in text)


def code_path(path: str) -> str:
    """A file of the repository as its README names it: nanohlat/pipeline.py, train.py."""
    at = path.rfind(f"{os.sep}nanohlat{os.sep}")
    return path[at + 1:] if at >= 0 else os.path.basename(path)


def open_collective(e: BaseException | None) -> str:
    """'in pp.exchange, issued at nanohlat/pipeline.py:253 (_exchange),': the collective a rank timed
    out in and the line of code that issued it. A blocking call is in `e`'s traceback: the innermost
    frame of comm.py names the operation and its group, the frame that called it the line. A
    started collective waited on elsewhere (the overlapped gradient buckets) is the comm ledger's
    open call, the last one this rank issued (comm.CommLedger.open, held by the mesh or group of a
    frame). 'in a collective' when neither is there."""
    frames = [f for f, _ in traceback.walk_tb(e.__traceback__ if e is not None else None)]
    inside = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(f"{os.sep}nanohlat{os.sep}comm.py")]
    if inside and inside[0] > 0:
        op, caller = frames[inside[-1]], frames[inside[0] - 1]
        group = op.f_locals.get("group", op.f_locals.get("pair"))
        return (f"in {getattr(group, 'name', '?')}.{op.f_code.co_name}, issued at "
                f"{code_path(caller.f_code.co_filename)}:{caller.f_lineno} ({caller.f_code.co_name}),")
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            call = getattr(getattr(value, "ledger", None), "open", None)
            if isinstance(call, tuple) and len(call) == 4:
                key, path, line, function = call
                return f"waiting on {key}, the last collective it issued, at {code_path(path)}:{line} ({function}),"
    return "in a collective"


def collective_timeout_message(rank: int, world: int, seconds: float, e: BaseException | None = None) -> str:
    """The one line of a rank whose collective timed out (`e`, gloo's or nccl's error): where it waited."""
    return (f"rank {rank} of {world} waited {seconds:g}s (--collective-timeout) {open_collective(e)} for a peer "
            f"rank that made no progress (stopped, hung, or stuck outside the collectives); the job ends; "
            f"--resume auto continues from the last complete checkpoint")


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R running, S sleeping, T stopped, ...),
    if it is a child of this process; None otherwise or without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # "pid (name) state ppid ...": name may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0] if len(fields) > 1 and fields[1] == str(os.getpid()) else None


class StuckRankWatch:
    """A launcher thread: every second, the state of each worker; a worker stopped
    for `timeout` seconds in a row is killed and remembered in `stuck`
    ({rank: (pid, seconds stopped)}). If the launcher itself was paused (Ctrl-Z
    stops the whole job), the count starts again."""

    POLL_S = 1.0

    def __init__(self, pid_folder: str, timeout: float):
        self.folder, self.timeout, self.stuck = pid_folder, timeout, {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stuck-rank-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def workers(self) -> dict[int, int]:
        found = {}
        for name in os.listdir(self.folder):
            try:
                with open(os.path.join(self.folder, name)) as f:
                    found[int(name.removeprefix("rank"))] = int(f.read())
            except (OSError, ValueError):    # being written
                continue
        return found

    def _run(self) -> None:
        since, last = {}, time.monotonic()
        while not self._done.wait(self.POLL_S):
            now = time.monotonic()
            if now - last > 5 * self.POLL_S:   # we were not running: nothing we saw is current
                since.clear()
            last = now
            for rank, pid in self.workers().items():
                if process_state(pid) not in ("T", "t"):
                    since.pop(pid, None)
                    continue
                stopped = now - since.setdefault(pid, now)
                if stopped >= self.timeout and self.stuck.get(rank, (None,))[0] != pid:
                    self.stuck[rank] = (pid, stopped)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def report(self) -> int:
        """The job's one line (exit 1: a run-time failure; 2 is for inputs the user can fix)."""
        names = ", ".join(f"rank {r} (pid {pid})" for r, (pid, _) in sorted(self.stuck.items()))
        longest = max(s for _, s in self.stuck.values())
        print(f"error: {names} stopped (SIGSTOP or a debugger) for {longest:.0f}s, longer than "
              f"--collective-timeout {self.timeout:g}s, so the other ranks could not go on: the job was ended; "
              f"--resume auto continues from the last complete checkpoint", file=sys.stderr)
        return 1
