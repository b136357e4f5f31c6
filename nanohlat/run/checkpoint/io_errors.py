"""Diagnosing a failed write: one line naming the file, the cause and the space it needs."""

from __future__ import annotations

import errno
import os
import shutil

import torch

from nanohlat.config import UserError


def state_bytes(state) -> int:
    """Roughly what torch.save writes for `state`: its tensors' bytes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def io_error(e: Exception, path: str, need: int) -> UserError:
    """A failed write as one line naming the path and what is needed. torch.save
    wraps the file's OSError (disk full, ...) in a RuntimeError ("enforce fail at
    inline_container.cc"): the OSError is found in its chain; a RuntimeError
    without one is not an I/O error and is raised as it is."""
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        if "inline_container" not in str(e) and "file write failed" not in str(e):
            raise e
        cause = OSError(errno.EIO, (str(e).strip().splitlines() or ["write failed"])[0])
    where = cause.filename if isinstance(cause.filename, str) else path   # (a file opened by descriptor: its number)
    what = cause.strerror or str(cause) or cause.__class__.__name__
    try:
        free = shutil.disk_usage(os.path.dirname(path)).free
    except OSError:
        free = None
    if cause.errno in (errno.ENOSPC, errno.EDQUOT) and need:
        more = f"free at least {max(1, -(-(need - (free or 0)) // 2**20))} MB" if free is not None else "free space"
        advice = f"this shard needs ~{need / 2**20:.1f} MB, {(free or 0) / 2**20:.1f} MB are free: {more}"
    else:
        advice = "free space or fix the permissions"
    return UserError(f"cannot write checkpoint file {where!r}: {what}; {advice}, or choose another --out-dir "
                     f"(the checkpoint was not saved; the previous one is intact)")
