"""Memory: what a CPU training step frees, kept in the process for the next step (glibc; the
allocator itself is chosen in :mod:`mt.allocator`), the kernels oneDNN and torch's front end
to it keep (:func:`bound_onednn_kernels`), and the process's resident memory and heap in use
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
    """Keep memory that training frees inside the process, for its next step (glibc only).

    A training step allocates and frees the same large temporaries every time (activations,
    the loss's float blocks). glibc returns freed blocks above its mmap threshold, and the top
    of its heap above the trim threshold, to the kernel, so the next step touches fresh pages:
    a page fault and a zero-fill per 4 KB, up to a millisecond for a 4 MB block (the loss's
    float copies cost 10x their own time that way). Fixing the mmap threshold at its 32 MB
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


ONEDNN_KERNELS = 16  # oneDNN's kernel cache for a training process (oneDNN's default: 1,024)


def bound_onednn_kernels(capacity: int = ONEDNN_KERNELS) -> bool:
    """Cap oneDNN's cache of built kernels, and the cache of built products that torch's
    oneDNN front end (ideep) keeps in front of it, for this process, unless the user set
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``LRU_CACHE_CAPACITY`` already; call it before any
    oneDNN product runs (both are read when the first product is built). Returns whether a
    cap was set here.

    oneDNN builds a kernel per product shape and keeps the last 1,024 it built, ~1 MB each in
    bfloat16. Training under CPU autocast gives its products (torch's own, on oneDNN) new
    shapes at most steps: batch lengths vary, and so do a product's rows and the attention's
    (B, T, S). On an AMD Zen 4, 300 updates of the default recipe in bf16 peaked at 2.72 GB
    resident with the default cache and 1.76 GB with 64 kernels, and ran no slower (2 min 26 s
    against 2 min 50 s: building a kernel again costs less than faulting in new memory). Once
    the attention's batched products stayed out of oneDNN (``mt.fast.attention``), 16 kernels
    peaked 120 MB lower than 64 at the same speed (``make bench train`` on Multi30k batches,
    three alternating rounds: 4,692 against 4,717 target tokens/s). Float32 products on MKL
    keep no such cache.

    ideep keeps 1,024 built products of its own (``LRU_CACHE_CAPACITY``), each holding its
    kernel: validation's decoding (oneDNN float32 products at many row counts) left 63 MB held
    for the rest of a run with both caches at their defaults, 32 MB with oneDNN's at 16 (AMD
    Zen 3, the default recipe's model after 600 updates, 1,014 sentences; heap in use after
    validation: +34 MB at 1,024 products, +21 at 64, +7 at 16, decoding no slower). Training
    on oneDNN's float32 products (the choice where they are faster, e.g. an AMD Zen 4) held
    290 MB of heap after 80 updates at 1,024, 244 MB at 16, and ran no slower (67-72 s against
    71-81 s, two rounds each on the Zen 3 with the choice forced).
    """
    import os

    caps = (  # each setting under the names a user may have given it, the one set here first
        ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),
        ("LRU_CACHE_CAPACITY",),
    )
    set_here = False
    for names in caps:
        if not any(n in os.environ for n in names):  # else the user's choice stands
            os.environ[names[0]] = str(capacity)
            set_here = True
    return set_here


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
