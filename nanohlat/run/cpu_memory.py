"""On the CPU, keep the memory a training step frees for the next step (glibc's malloc).

A training step frees and allocates the same tensors every step: the activations, the
logits, each gradient before it is added into its buffer. On the CPU those come from the
C library's malloc, and glibc's gives memory back to the operating system in two ways:

- a block above its mmap threshold (128 KB at first; freeing such a block raises the
  threshold to that block's size, up to 32 MB) gets pages of its own (mmap), returned
  when it is freed;
- when more than the trim threshold (128 KB at first; twice the mmap threshold once that
  has risen) lies free at the top of its heap, it shrinks the heap.

Memory given back is handed out again by the kernel one 4 KB page at a time, each page
zeroed on its first touch (a page fault). At the default preset, one process, one thread:
`python train.py` took 2,400 and 8,400 more faults a step without this than with it (two
runs of 30 steps: how much is trimmed depends on where the freed blocks lie); in the
bench, nanohlat's step about 8,000 (12-36 ms of system time in a 750 ms step) and Hugging
Face's Llama about half as many (its gradients live from one backward to the next step's
zero_grad, so its heap stays large; nanohlat adds each gradient into its flat buffer and
frees it at once).

`keep_freed_memory` asks glibc to keep what it has: blocks up to 32 MB (the largest
threshold it takes) come from its heap, and the heap never shrinks. After the first few
steps a step faults almost no page (tests/run/test_cpu_memory.py counts them). The cost:
the process keeps its peak heap until it exits, which a training process reaches every
step anyway.

preflight.join calls it for a CPU run; the bench calls it once for the process, so
nanohlat and Hugging Face's models are timed with the same allocator. Elsewhere (macOS,
musl, Windows) it does nothing, and the bench says so. Another allocator put in front
does the same (LD_PRELOAD of jemalloc or tcmalloc, which PyTorch's performance tuning
guide suggests for the CPU); this needs none.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # mallopt's parameters (glibc's malloc.h)
MMAP_ABOVE = 32 << 20   # the largest mmap threshold glibc takes on 64-bit (half HEAP_MAX_SIZE, 64 MB)
NEVER_TRIM = -1         # mallopt(M_TRIM_THRESHOLD, -1): never shrink the heap (mallopt(3))


def glibc() -> bool:
    """Is this process's C library glibc (whose mallopt takes these parameters)?"""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):   # no such name here: not glibc
        return False


def keep_freed_memory() -> bool:
    """Keep freed memory in the process (module docstring). True where glibc took both settings."""
    if not glibc():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)   # (the C library the process already runs on)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE)) \
        and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
