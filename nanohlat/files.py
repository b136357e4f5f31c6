"""Crash-safe file writing and file hashes, shared by the data cache and checkpoints."""

from __future__ import annotations

import hashlib
import os


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write) -> None:
    """write(f) into `path + '.partial'`, flush + fsync, then rename over `path`:
    readers see the old file or the whole new one, never a prefix."""
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()
