"""Crash-safe, link-refusing file writing (every file a run, an eval or an export
writes goes through atomic_write or open_append) and file hashes."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import stat

from nanohlat.config import UserError


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path: str) -> str | None:
    """What stands at `path`, in words ("a FIFO (named pipe)", "a character device", "a folder", ...),
    when it is something nanohlat must not write over: neither absent, a regular file nor a
    symbolic link (a link is replaced, never followed: _create_new). None otherwise. Read with
    lstat alone: nothing is opened (opening a FIFO blocks until someone reads it)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return next((what for test, what in _KINDS if test(mode)), None) if not stat.S_ISREG(mode) \
        and not stat.S_ISLNK(mode) else None


def refuse_unless_file(path: str, choose: str = "another path") -> None:
    """UserError, one line, when something other than a regular file (or a link, or nothing)
    stands at `path`, a file nanohlat is about to write: writing it would replace a device
    node, a FIFO or a socket with a file of ours (a folder it cannot replace at all)."""
    what = not_a_file(path)
    if what:
        raise UserError(f"{path!r} is {what}, not a regular file: nanohlat writes only regular files there "
                        f"and would replace it; move it away or choose {choose}")


def _create_new(path: str, flags: int) -> int:
    """Open `path` as a new regular file of ours: O_CREAT|O_EXCL|O_NOFOLLOW never
    follows a link there (nor any file made by someone else meanwhile). Whatever
    stands at `path` already (a `.partial` a killed run left, or a symbolic link)
    is removed first: unlink removes a link itself, never its target."""
    flags |= os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    return os.open(path, flags, 0o644)


def atomic_write(path: str, write) -> None:
    """write(f) into `path + '.partial'`, flush + fsync, then rename over `path`:
    readers see the old file or the whole new one, never a prefix. A write
    that fails (disk full, Ctrl-C) removes its `.partial`; only a killed
    process leaves one behind.

    Every file a run writes goes through here (or open_append), so none is ever
    written over a device, a FIFO or a socket (refused: refuse_unless_file), nor through a symbolic link: the temporary is created anew, refusing to
    follow a link (_create_new), and the rename replaces a link at `path` by the
    file itself, leaving the link's target untouched."""
    tmp = path + ".partial"
    refuse_unless_file(path)   # (every command checks its targets before any work; this is the last guard)
    refuse_unless_file(tmp)
    try:
        with os.fdopen(_create_new(tmp, os.O_WRONLY), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:   # (a full disk): name the file being written, not the temporary's descriptor
        if not isinstance(e.filename, str):
            e.filename = path
        raise
    finally:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path) or ".")


def write_text(path: str, text: str) -> None:
    """atomic_write of a UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def copy_file(source: str, path: str) -> None:
    """Copy `source` to `path` through atomic_write (never through a link at `path`)."""
    with open(source, "rb") as src:
        atomic_write(path, lambda f: shutil.copyfileobj(src, f, 1 << 24))


def open_append(path: str):
    """`path` opened for appending text (metrics.jsonl), never through a link:
    O_NOFOLLOW refuses one, which is then removed (not its target) and the file
    created anew. A regular file already there is continued; anything else refused
    (refuse_unless_file: a FIFO would block the open)."""
    refuse_unless_file(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        fd = _create_new(path, os.O_WRONLY | os.O_APPEND)
    return os.fdopen(fd, "a", encoding="utf-8")


NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}   # repr(x) -> how strict JSON says it


def json_text(obj, **kwargs) -> str:
    """json.dumps for the JSON files that can hold a measured number (metrics.jsonl,
    summary.json, config.json, eval.json, an HF export's configs): strict JSON, which has no NaN
    or Infinity (Python's json writes them bare by default, and other readers
    refuse the file). A float that is not finite is written as the string "NaN",
    "Infinity" or "-Infinity" (Python's float() and JavaScript's Number() read each
    back); docs/robustness.md states the convention."""
    return json.dumps(_strict(obj), allow_nan=False, **kwargs)


def _strict(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else NON_FINITE[repr(float(v))]
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes, int)):   # numpy scalars, 0-d tensors
        return _strict(v.item())
    return v


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def os_error_in(e: BaseException, path: str | None = None) -> OSError | None:
    """The OSError (a full disk, ...) behind `e`, itself or in its chain: torch.save
    raises a RuntimeError ("enforce fail at inline_container.cc") around the file's
    OSError. Its filename is set to `path` when it has none (a file written through
    its descriptor). None when `e` is no I/O error (a bug: raise it as it is)."""
    seen = set()
    while e is not None and id(e) not in seen and not isinstance(e, OSError):
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if isinstance(e, OSError) and path and not isinstance(e.filename, str):
        e.filename = path
    return e if isinstance(e, OSError) else None


def os_error_message(e: OSError) -> str:
    """A file-system error (read-only, disk full, not a directory, ...) as one line naming the path."""
    path = f" {e.filename!r}" if e.filename else ""
    what = e.strerror or e.__class__.__name__
    return f"cannot write or read{path}: {what}; free space, fix the permissions or choose another path"

