"""Memory: what a CPU training step frees, kept in the process for the next step (glibc; the
allocator itself is chosen in :mod:`mt.allocator`, which also bounds the kernels oneDNN keeps:
:func:`mt.allocator.bound_onednn_kernels`). The process's resident memory for the log is
``mt.train.tracking.resident_fields``."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

from mt.allocator import active_allocator

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems


@functools.cache
def hold_freed_memory() -> bool:
    """Keep memory that training frees inside the process, for its next step (glibc only).

    A step allocates and frees the same large temporaries every time. glibc returns freed
    blocks above its mmap threshold, and its heap's top above the trim threshold, to the
    kernel, so the next step pays a page fault and a zero-fill per 4 KB; a 32 MB mmap threshold
    (glibc's ceiling) and no trimming keep those pages, resident memory staying at its peak.
    Returns whether glibc took the settings.
    """
    if not sys.platform.startswith("linux") or active_allocator() != "system":
        return False  # tcmalloc or jemalloc serves malloc: glibc's settings would do nothing
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    held = bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        and mallopt(_M_TOP_PAD, 64 << 20)
    )
    if held:
        log.info("glibc malloc: freed memory kept for reuse (mmap threshold 32 MB, no trim)")
    return held
