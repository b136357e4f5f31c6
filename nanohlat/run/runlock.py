"""One run per out-dir: an advisory lock held for the life of a run.

Two runs writing into one out-dir interleave their checkpoints and metrics
and leave neither run usable. So the process that owns a run (the only
process of `python train.py`, the launcher of `--nproc N`, rank 0 under
torchrun) takes an exclusive `flock` on `<out-dir>/run.lock` before it reads
or writes anything there, and keeps it until the run ends; its PID is written
into the file so that a second run can say who holds it. The operating system
drops an flock when its process dies, however it dies, so a lock left by a
crashed or killed run is simply taken over by the next one.

The workers of `--nproc N` write into the out-dir too, so they hold the lock
with their launcher: before it starts them the launcher turns its lock into a
shared one (`share_all`), and each worker takes a shared lock of its own
(`hold_shared`). A second run needs the exclusive lock, which it gets only
once the last of them is gone; and the workers do not outlive their launcher
(launch.follow_launcher). So after `kill -9` of the launcher its workers die
within a second, and a run started meanwhile waits those few seconds for
them (the PID in the file is dead: `WAIT_FOR_ORPHANS_S`) instead of writing
beside them.

Also here, because they are decided at the same moment: an out-dir that holds
something other than a nanohlat run is refused (training would write over it),
and a run that ends before training a single step removes what it wrote
(config.json, an empty metrics.jsonl, the lock, an out-dir it created), so
that a retry with `--resume never` is not refused as "already holds a run"
(nor an import into a folder it found empty as "not empty").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time

from nanohlat.config import UserError
from nanohlat.system import files

LOCK_NAME = "run.lock"
WAIT_FOR_ORPHANS_S = 10.0       # how long a new run waits for the workers of a launcher that died
_held: list["RunLock"] = []     # this process's locks (release_all: before an abrupt exit)
_shared: list[int] = []         # a worker's shared locks (hold_shared): held until the process ends
# Files and folders a nanohlat run (or eval.py, or `nanohlat.serving.hf import`) writes into its out-dir.
RUN_FILES = {"checkpoints", "metrics.jsonl", "config.json", "summary.json", "timeline.txt", "timeline.png",
             "timeline.json", "report.html", "eval.json", "eval_curves.png", "tokenizer.model", LOCK_NAME}


def foreign_entries(out_dir: str) -> list[str]:
    """Entries of an existing out-dir when none of them is a nanohlat run's (else [])."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(os.listdir(out_dir))
    ours = [n for n in names if n in RUN_FILES and (n != "config.json" or _is_run_config(os.path.join(out_dir, n)))]
    return [] if ours or not names else names


def _is_run_config(path: str) -> bool:
    """nanohlat's config.json has "model" and "train" sections (a Hugging Face one does not)."""
    try:
        with open(path) as f:
            d = json.load(f)
        return isinstance(d, dict) and "model" in d and "train" in d
    except (OSError, ValueError):
        return False


def _open_lock(path: str) -> int:
    """The lock file, opened (made if missing) but never through a symbolic link:
    O_NOFOLLOW refuses one, which nanohlat never makes, so it is removed (not its
    target) and the file made anew (O_EXCL: ours)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o644)


def check_out_dir(out_dir: str) -> None:
    """Refuse, before any work (pre-flight, then again under the lock), an out-dir a run cannot
    write into without losing something: one that is not a folder, one holding other files than a
    run's, and one where a run keeps a file (RUN_FILES, checkpoints/latest) holding something else
    than a regular file (a folder, a FIFO, a device, a socket: files.not_a_file), or a
    `checkpoints` that is no folder."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):   # (a link to a folder is followed: the path you chose)
        raise UserError(f"--out-dir {out_dir!r} is {files.not_a_file(os.path.realpath(out_dir)) or 'a file'}, not a "
                        f"folder; choose a folder (a new one is made)")
    foreign = foreign_entries(out_dir)
    if foreign:
        raise UserError(f"--out-dir {out_dir!r} holds other files ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}), not a nanohlat run; training would write "
                        f"over them: choose a new or empty --out-dir")
    ckpts = os.path.join(out_dir, "checkpoints")
    for name in sorted(RUN_FILES - {"checkpoints"}) + [os.path.join("checkpoints", "latest"), "checkpoints"]:
        path = os.path.join(out_dir, name)
        what = files.not_a_file(path)
        if path == ckpts:
            what = None if what == "a folder" or not os.path.lexists(path) or os.path.isdir(path) else \
                what or "a file"
        if what == "a folder":   # (metrics.jsonl/ would have received metrics.jsonl/metrics.jsonl)
            raise UserError(f"{path!r} is a folder, where a run keeps its file of that name; move it away or "
                            f"choose another --out-dir")
        if what:
            raise UserError(f"{path!r} is {what}, where a run keeps its {'folder' if path == ckpts else 'file'} of "
                            f"that name; move it away or choose another --out-dir")


class RunLock:
    """The held lock (see the module docstring); release() ends it."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        check_out_dir(out_dir)
        self.created = not os.path.exists(out_dir)
        self.was_empty = self.created or (os.path.isdir(out_dir) and not os.listdir(out_dir))
        self.path = os.path.join(out_dir, LOCK_NAME)
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.fd = _open_lock(self.path)
        except OSError as e:
            raise UserError(f"cannot use --out-dir {out_dir!r}: {e.strerror} ({e.filename}); "
                            f"choose a writable folder") from None
        try:
            _lock_or_wait_for_orphans(self.fd)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            if holder.isdigit() and not _alive(int(holder)):
                raise UserError(f"--out-dir {out_dir!r} is still held by the workers of a run whose launcher "
                                f"(PID {holder}) is gone, {WAIT_FOR_ORPHANS_S:g}s after it; stop them (they are "
                                f"its children: ps -o pid,ppid,cmd), then start again") from None
            raise UserError(f"--out-dir {out_dir!r} is in use by another run (PID {holder}); wait for it to "
                            f"end or stop it, or choose another --out-dir") from None
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:    # a full disk (or quota): leave nothing behind, name the path
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            with contextlib.suppress(OSError):
                os.remove(self.path)
                if self.created:
                    os.rmdir(out_dir)
            raise UserError(f"cannot write {self.path!r}: {e.strerror}; free some space on that disk "
                            f"(a few KB are needed to start; checkpoints need more) or choose another "
                            f"--out-dir") from None
        _held.append(self)

    def share(self) -> None:
        """Turn the exclusive lock into a shared one, so that workers can hold it too (a
        second run still cannot take it). Raises BlockingIOError if another run took the
        lock meanwhile (flock's conversion is not promised to be atomic)."""
        fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def release(self) -> None:
        """Unlock; first, if the run trained no step, remove what it wrote."""
        if self.fd < 0:
            return
        try:
            forget_untrained_run(self.out_dir)
            if self.was_empty and sorted(os.listdir(self.out_dir)) == [LOCK_NAME]:
                os.remove(self.path)      # (a run waiting on it would have failed at once: LOCK_NB)
                if self.created:
                    os.rmdir(self.out_dir)
        except OSError:
            pass   # best effort: a read-only or vanished out-dir keeps what it has
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
        if self in _held:
            _held.remove(self)


def release_all() -> None:
    """Release every lock this process holds (a watchdog calls this before os._exit)."""
    for lock in list(_held):
        lock.release()


def acquire(out_dir: str) -> RunLock:
    return RunLock(out_dir)


def share_all() -> list[str]:
    """(A launcher, before it starts workers) every lock this process holds, made
    shared; returns their paths, for the workers' `hold_shared`."""
    for lock in _held:
        try:
            lock.share()
        except BlockingIOError:
            raise UserError(f"--out-dir {lock.out_dir!r} was taken by another run while this one started its "
                            f"workers; wait for it to end, or choose another --out-dir") from None
    return [lock.path for lock in _held]


def hold_shared(path: str) -> None:
    """(A worker of a launcher that holds `path`, shared) hold it too, until this process ends."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except (OSError, BlockingIOError) as e:
        raise UserError(f"cannot hold the run lock {path!r} beside the launcher ({e.strerror or e}); another "
                        f"run may have taken the out-dir: choose another --out-dir") from None
    _shared.append(fd)


def _lock_or_wait_for_orphans(fd: int) -> None:
    """The exclusive lock, at once; or, when the PID in the file is gone (a launcher
    killed with -9 whose workers still hold it for the second they need to die),
    within WAIT_FOR_ORPHANS_S. BlockingIOError when it stays held."""
    deadline = time.monotonic() + WAIT_FOR_ORPHANS_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if not holder.isdigit() or _alive(int(holder)) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (dead, its exit status not yet collected)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True    # another user's
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True    # no /proc: it exists


def forget_untrained_run(out_dir: str) -> None:
    """A run with no checkpoint and no logged step trained nothing: remove its
    config.json, summary.json, report.html and empty metrics.jsonl (nothing else)."""
    from nanohlat.run.checkpoint import ckpt_root
    root = ckpt_root(out_dir)
    if os.path.isdir(root) and any(n.startswith("step_") for n in os.listdir(root)):
        return
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, "rb") as f:   # (bytes: a damaged, non-UTF-8 file is a record too)
            if any(line.strip() for line in f):
                return
    for name in ("metrics.jsonl", "config.json", "summary.json", "report.html"):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and (name != "config.json" or _is_run_config(path)):
            os.remove(path)
    if os.path.isdir(root) and not os.listdir(root):
        os.rmdir(root)
