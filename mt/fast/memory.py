"""Memory: what a CPU training step frees, kept in the process for the next step (glibc; the
allocator itself is chosen in :mod:`mt.allocator`, which also bounds the kernels oneDNN keeps:
:func:`mt.allocator.bound_onednn_kernels`), and the process's resident memory and heap in use
for the log (:func:`resident_fields`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from mt.allocator import active_allocator, heap_in_use

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
_held = False


def hold_freed_memory() -> bool:
    """Keep memory that training (or decoding, ``mt.fast.decoding.for_decoding``) frees inside
    the process, for its next step or batch (glibc only).

    A training step allocates and frees the same large temporaries every time (activations,
    the loss's float blocks). glibc returns freed blocks above its mmap threshold, and the top
    of its heap above the trim threshold, to the kernel, so the next step touches fresh pages:
    a page fault and a zero-fill per 4 KB, which can cost a short copy many times its own
    work (the loss's float blocks, above all). Fixing the mmap threshold at its 32 MB
    ceiling and never trimming keeps those pages; the process's resident memory then stays at
    its peak instead of shrinking between steps. Returns whether glibc took the settings.
    """
    global _held
    if _held:
        return True
    if not sys.platform.startswith("linux") or active_allocator() != "system":
        return False  # tcmalloc or jemalloc serves malloc: glibc's settings would do nothing
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    _held = bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        and mallopt(_M_TOP_PAD, 64 << 20)
    )
    if _held:
        log.info("glibc malloc: freed memory kept for reuse (mmap threshold 32 MB, no trim)")
    return _held


def resident_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in MB (Linux; (0, peak) elsewhere)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0, peak
    return rss, max(peak, rss)  # the kernel updates its peak lazily


def resident_fields() -> dict[str, float]:
    """:func:`resident_mb` as a metrics record's ``rss_mb`` and ``peak_rss_mb``, and the part
    of it the program holds from malloc (``heap_mb``, where the allocator tells: resident
    memory that grows while it stays level is freed memory kept, not a leak)."""
    rss, peak = resident_mb()
    fields = {"rss_mb": round(rss, 1), "peak_rss_mb": round(peak, 1)}
    held = heap_in_use()
    if held is not None:
        fields["heap_mb"] = round(held / 2**20, 1)
    return fields
