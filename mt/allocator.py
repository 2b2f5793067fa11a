"""The memory allocator of an mt command: tcmalloc or jemalloc where installed, else glibc's.

glibc's malloc fragments under training (the heap keeps growing after the first validation);
tcmalloc, then jemalloc, keep a run's resident memory lower and flatter at the same speed or
better (docs/performance.md). A library replaces malloc only when loaded before the program, so
an mt command executes itself again with it in ``LD_PRELOAD`` (:func:`preload_allocator`) and
bounds oneDNN's kernel caches (:func:`bound_onednn_kernels`) before importing torch: this module
imports nothing heavy. ``MT_ALLOCATOR``: ``auto`` (default), ``tcmalloc``, ``jemalloc`` or
``system``; tcmalloc installs with ``apt install libtcmalloc-minimal4``, ``dnf install
gperftools-libs`` or ``conda install -c conda-forge gperftools``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

ALLOCATOR_ENV = "MT_ALLOCATOR"  # auto | tcmalloc | jemalloc | system
# jemalloc's settings: torch's CPU launcher's (torch.backends.xeon.run_cpu), and freed pages
# never returned to the kernel ("decay" -1), as hold_freed_memory does for glibc: with jemalloc's
# default decay (10 s) training pays for faulting the same pages in again and again.
JEMALLOC_CONF = (
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,"
    "dirty_decay_ms:-1,muzzy_decay_ms:-1"
)
AUTO_ORDER = ("tcmalloc", "jemalloc")
_SETTINGS = {  # the environment each allocator is started with (a user's own value wins)
    "jemalloc": ("MALLOC_CONF", JEMALLOC_CONF),
    # tcmalloc reports each allocation above 1 GB on stderr; a big model's CPU batch makes some
    "tcmalloc": ("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40)),
}
_LIBRARIES = {  # shared objects to look for, in order (the soname first)
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc.so"),
}
_INSTALL = {
    "jemalloc": "apt install libjemalloc2, or conda install -c conda-forge jemalloc",
    "tcmalloc": "apt install libtcmalloc-minimal4, or conda install -c conda-forge gperftools",
}
_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")  # fmt: skip


def find_allocator(name: str) -> str | None:
    """The path of allocator ``name``'s shared library: in this Python's environment first
    (conda), then the system's; None when it is not installed."""
    dirs = [Path(sys.prefix) / "lib", *map(Path, _SYSTEM_DIRS)]
    for filename in _LIBRARIES[name]:
        for d in dirs:
            if (d / filename).is_file():
                return str(d / filename)
    return None


def allocator_choice(setting: str, found: dict[str, str | None]) -> tuple[str, str | None]:
    """``(name, path to preload)`` for ``MT_ALLOCATOR=setting`` given the libraries ``found``
    (name -> path or None); path None for the system's own. ``auto`` takes the first of
    :data:`AUTO_ORDER` installed; a named one that is not installed is an error."""
    setting = (setting or "auto").strip().lower()
    if setting == "system":
        return "system", None
    if setting == "auto":
        name = next((n for n in AUTO_ORDER if found.get(n)), None)
        return (name, found[name]) if name else ("system", None)
    if setting not in _LIBRARIES:
        raise ValueError(
            f"{ALLOCATOR_ENV}={setting!r}: expected one of auto, tcmalloc, jemalloc, system"
        )
    if not found.get(setting):
        raise ValueError(f"{ALLOCATOR_ENV}={setting}: lib{setting} is not installed "
                         f"({_INSTALL[setting]})")  # fmt: skip
    return setting, found[setting]


def active_allocator() -> str:
    """The allocator serving this process's malloc: jemalloc, tcmalloc or system."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return "system"
    if hasattr(process, "mallctl"):
        return "jemalloc"
    if hasattr(process, "MallocExtension_GetNumericProperty"):
        return "tcmalloc"
    return "system"


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def heap_in_use() -> int | None:
    """Bytes the program holds from malloc now, as the allocator serving the process counts
    them; None where it cannot tell. Resident memory above it is freed memory the allocator
    keeps (or fragments of it)."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return None
    value = ctypes.c_size_t(0)
    name = active_allocator()
    if name == "tcmalloc":
        get = process.MallocExtension_GetNumericProperty
        ok = get(b"generic.current_allocated_bytes", ctypes.byref(value))
        return int(value.value) if ok else None
    if name == "jemalloc":
        mallctl = process.mallctl  # (name, old value, its size, new value, its size)
        mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                            ctypes.c_void_p, ctypes.c_size_t]  # fmt: skip
        size = ctypes.c_size_t(ctypes.sizeof(value))
        epoch = ctypes.c_uint64(1)  # its statistics are a snapshot, renewed by writing "epoch"
        mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
        if mallctl(b"stats.allocated", ctypes.byref(value), ctypes.byref(size), None, 0):
            return None
        return int(value.value)
    mallinfo2 = getattr(process, "mallinfo2", None)
    if mallinfo2 is None:  # not glibc, or older than 2.33
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)  # in the heaps' chunks + in chunks of their own


def describe_allocator() -> str:
    """The allocator serving this process, for the log."""
    name, setting = active_allocator(), os.environ.get(ALLOCATOR_ENV, "auto")
    if name != "system":
        return f"{name} ({ALLOCATOR_ENV}={setting})"
    installed = any(find_allocator(n) for n in AUTO_ORDER)
    if sys.platform.startswith("linux") and setting == "auto" and not installed:
        return (f"the system's ({ALLOCATOR_ENV}=auto, neither tcmalloc nor jemalloc installed: "
                "less memory with them)")  # fmt: skip
    return f"the system's ({ALLOCATOR_ENV}={setting})"


def preload_allocator(argv: list[str] | None = None) -> None:
    """Run this command under the allocator ``MT_ALLOCATOR`` names (:func:`allocator_choice`):
    where it is not serving the process yet, execute the same command line again with the
    library in ``LD_PRELOAD``. Linux only. Call it first thing, before threads start: the
    process is replaced, not forked (the same PID, as torchrun expects). Raises ValueError for
    an unknown ``MT_ALLOCATOR`` or a named allocator that is not installed.
    """
    if not sys.platform.startswith("linux"):
        return
    found = {name: find_allocator(name) for name in _LIBRARIES}
    name, path = allocator_choice(os.environ.get(ALLOCATOR_ENV, "auto"), found)
    if path is None or active_allocator() == name:
        return
    preloads = os.environ.get("LD_PRELOAD", "")
    if path in preloads.split(":"):  # preloaded already and still not serving: leave it be
        return
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (path, preloads) if p))
    env.setdefault(*_SETTINGS[name])
    argv = list(argv if argv is not None else sys.orig_argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def launched_as_command(argv: list[str] | None = None) -> bool:
    """Whether this process was started as an mt command (``python -m mt ...`` or an ``mt-*``
    script): only then may :func:`preload_allocator` execute it again, never a program that
    imports mt (a notebook, pytest)."""
    argv = list(argv if argv is not None else sys.orig_argv)
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None) == "mt"
        if arg in ("-X", "-W"):  # the interpreter's options with a value
            next(args, None)
        elif arg == "-c" or not arg.startswith("-"):
            return Path(arg).name.startswith("mt-")
    return False


ONEDNN_KERNELS = 16  # oneDNN's kernel cache for an mt process (oneDNN's default: 1,024)
# Each cache setting under the names a user may have given it, the one mt sets first: oneDNN's
# cache of built kernels, and the built products torch's oneDNN front end (ideep) keeps before it.
_CAPS = (("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),
         ("LRU_CACHE_CAPACITY",))  # fmt: skip
# The settings mt itself gave (not the user), so that a later stage may size them again; in
# the environment, so that a process that mt executes again or starts keeps knowing it.
_SET_BY_MT = "MT_ONEDNN_CAPS_SET_BY_MT"


def bound_onednn_kernels(capacity: int = ONEDNN_KERNELS) -> bool:
    """Cap oneDNN's and ideep's caches of built kernels for this process, unless the user set
    them; call it before any oneDNN product runs (both are read when the first one is built).
    Returns whether a cap was set here.

    oneDNN keeps the last 1,024 kernels it built, each large in bfloat16, and ideep as many
    products holding theirs; under CPU autocast, and in decoding, products meet new shapes at
    most steps, so a full cache mostly holds kernels never used again. Building one again costs
    less than faulting in that memory: at 16 a process runs as fast with a flat heap
    (docs/performance.md). A training step needs more and sizes the caches again before its
    first product (:func:`size_onednn_kernels`).
    """
    return _set_caps(capacity, resize=False)


def size_onednn_kernels(capacity: int) -> int:
    """Set both caches of :func:`bound_onednn_kernels` to ``capacity`` (training's need,
    ``mt.fast.onednn.training_kernels``) where mt set them or nothing did; a user's own setting
    stands. Returns oneDNN's capacity in effect. Like the cap, it counts only before the
    process's first oneDNN product."""
    _set_caps(capacity, resize=True)
    value = next((os.environ[name] for name in _CAPS[0] if name in os.environ), None)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1024  # oneDNN's default, where unset or unreadable


def _set_caps(capacity: int, resize: bool) -> bool:
    """Set each cache nobody set (with ``resize``, also those mt set) to ``capacity``; returns
    whether any was set."""
    ours = {n for n in os.environ.get(_SET_BY_MT, "").split(",") if n}
    set_here = False
    for names in _CAPS:
        if (resize and names[0] in ours) or not any(n in os.environ for n in names):
            os.environ[names[0]] = str(int(capacity))
            ours.add(names[0])
            set_here = True
    os.environ[_SET_BY_MT] = ",".join(sorted(ours))
    return set_here
