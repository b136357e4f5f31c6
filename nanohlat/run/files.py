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
    readers see the old file or the whole new one, never a prefix. A write
    that fails (disk full, Ctrl-C) removes its `.partial`; only a killed
    process leaves one behind."""
    tmp = path + ".partial"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path) or ".")


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def os_error_message(e: OSError) -> str:
    """A file-system error (read-only, disk full, not a directory, ...) as one line naming the path."""
    path = f" {e.filename!r}" if e.filename else ""
    what = e.strerror or e.__class__.__name__
    return f"cannot write or read{path}: {what}; free space, fix the permissions or choose another path"


def sample_hash(path: str, blocks: int = 64, block: int = 4096) -> str:
    """A cheap fingerprint of a large file: its size and `blocks` evenly spaced
    blocks (the first and last included; a small file is hashed whole). Catches
    truncation, extension and damage to any sampled block, reading ~256 KiB."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= blocks * block:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek(i * (size - block) // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()
