"""One run per out-dir: an advisory lock held for the life of a run.

Two runs writing into one out-dir interleave their checkpoints and metrics
and leave neither run usable. So the process that owns a run (the only
process of `python train.py`, the launcher of `--nproc N`, rank 0 under
torchrun) takes an exclusive `flock` on `<out-dir>/run.lock` before it reads
or writes anything there, and keeps it until the run ends; its PID is written
into the file so that a second run can say who holds it. The operating system
drops an flock when its process dies, however it dies, so a lock left by a
crashed or killed run is simply taken over by the next one.

Also here, because they are decided at the same moment: an out-dir that holds
something other than a nanohlat run is refused (training would write over it),
and a run that ends before training a single step removes what it wrote
(config.json, an empty metrics.jsonl, the lock, an out-dir it created), so
that a retry with `--resume never` is not refused as "already holds a run".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os

from nanohlat.config import UserError

LOCK_NAME = "run.lock"
_held: list["RunLock"] = []     # this process's locks (release_all: before an abrupt exit)
# Files and folders a nanohlat run (or eval.py, or `nanohlat.serving.hf import`) writes into its out-dir.
RUN_FILES = {"checkpoints", "metrics.jsonl", "config.json", "summary.json", "timeline.txt", "timeline.png",
             "eval.json", "eval_curves.png", "tokenizer.model", LOCK_NAME}


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


class RunLock:
    """The held lock (see the module docstring); release() ends it."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        foreign = foreign_entries(out_dir)
        if foreign:
            raise UserError(f"--out-dir {out_dir!r} holds other files ({', '.join(foreign[:3])}"
                            f"{', ...' if len(foreign) > 3 else ''}), not a nanohlat run; training would write "
                            f"over them: choose a new or empty --out-dir")
        self.created = not os.path.exists(out_dir)
        self.path = os.path.join(out_dir, LOCK_NAME)
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.fd = _open_lock(self.path)
        except OSError as e:
            raise UserError(f"cannot use --out-dir {out_dir!r}: {e.strerror} ({e.filename}); "
                            f"choose a writable folder") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
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

    def release(self) -> None:
        """Unlock; first, if the run trained no step, remove what it wrote."""
        if self.fd < 0:
            return
        try:
            forget_untrained_run(self.out_dir)
            if self.created and sorted(os.listdir(self.out_dir)) == [LOCK_NAME]:
                os.remove(self.path)      # (a run waiting on it would have failed at once: LOCK_NB)
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


def forget_untrained_run(out_dir: str) -> None:
    """A run with no checkpoint and no logged step trained nothing: remove its
    config.json, summary.json and empty metrics.jsonl (nothing else)."""
    from nanohlat.run.checkpoint import ckpt_root
    root = ckpt_root(out_dir)
    if os.path.isdir(root) and any(n.startswith("step_") for n in os.listdir(root)):
        return
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            if any(line.strip() for line in f):
                return
    for name in ("metrics.jsonl", "config.json", "summary.json"):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and (name != "config.json" or _is_run_config(path)):
            os.remove(path)
    if os.path.isdir(root) and not os.listdir(root):
        os.rmdir(root)
