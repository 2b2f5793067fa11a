"""mt's own C++ kernels for CPU training, compiled on first use for the CPU in hand.

- ``torch.ops.mt.smoothed_ce`` (``csrc/smoothed_ce.cpp``): a row block of the CPU training loss
  (``mt.fast.loss``) and, in place, its gradient, in three passes over each row.
- ``torch.ops.mt.dropout`` and ``torch.ops.mt.masked_scale`` (``csrc/dropout.cpp``): the
  training copy's dropout (``mt.fast.dropout``) and its backward, one pass each.

Built by torch's C++ extension loader with ``-march=native`` (into ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``) under a name that digests the sources, flags, CPU, torch and
Python (:func:`build_name`), so a home shared by machines of different CPUs never loads another's
build. Processes that start at once build once (:func:`build_lock`). Where they cannot be built
(no C++ compiler or ninja), :func:`smoothed_ce` and :func:`dropout` return None, the reason is
said once, and torch's operators compute the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "smoothed_ce.cpp", CSRC / "dropout.cpp")
HEADERS = (CSRC / "vec.h",)  # included by the sources
# OpenMP: torch's own runtime, for its threads; no warnings about the vector types' ABI
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"]
STALE_LOCK_S = 120.0  # a build lock older than this was left by a killed build

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "loaded": whether the kernels are, "why": the reason they are not


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n")[0].splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return {key.strip(): value.strip() for key, value in fields}


def _cpu_identity() -> str:
    """What decides the code ``-march=native`` emits: the CPU's vendor, family, model and
    flags; the platform's name where /proc/cpuinfo is missing."""
    fields = cpu_fields()
    if not fields:
        import platform

        return platform.processor() or platform.machine()
    keys = ("vendor_id", "cpu family", "model", "flags")
    return "|".join(f"{k}={fields[k]}" for k in keys if k in fields)


def build_name() -> str:
    """The extension's name: a digest of the sources, flags, CPU, torch and Python."""
    digest = hashlib.sha256()
    identity = (" ".join(CFLAGS), _cpu_identity(), torch.__version__, sys.version)
    for part in [*(path.read_bytes() for path in SOURCES + HEADERS), *map(str.encode, identity)]:
        digest.update(part)
        digest.update(b"\0")
    return f"mt_native_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """``$TORCH_EXTENSIONS_DIR`` (or torch's default root) / :func:`build_name`."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / build_name()


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Without ``flock`` (:func:`build_lock`): wait for torch's ``lock`` file in ``directory``
    to go, removing it once older than ``max_age_s`` (left by a killed build)."""
    lock = directory / "lock"
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            return
        if age > max_age_s:
            log.warning("removing %s, left %.0f s ago by a build of mt's kernels "
                        "that did not finish", lock, age)  # fmt: skip
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.1)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold the build of ``directory``: an exclusive ``flock`` on ``directory/build.flock``,
    waited for as long as a build elsewhere takes and released by the kernel when its holder
    ends, killed or not. Holding it, a torch ``lock`` file found in ``directory`` was left by a
    killed build and is removed. Without ``fcntl``, or where the file system refuses the lock:
    :func:`clear_stale_lock`."""
    with open(directory / "build.flock", "a") as handle:
        if _flock(handle, directory):
            lock = directory / "lock"
            if lock.exists():
                log.warning("removing %s, left by a build of mt's kernels that did not finish",
                            lock)  # fmt: skip
                lock.unlink(missing_ok=True)
        else:
            clear_stale_lock(directory)
        yield


def _flock(handle, directory: Path) -> bool:
    """Take an exclusive ``flock`` on ``handle`` (waiting for its holder); False where there is
    none (not POSIX, or a file system without locks: some network mounts)."""
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX)
        return True
    except ImportError:
        return False
    except OSError as err:
        log.info("no flock in %s (%s): waiting on torch's lock file instead", directory, err)
        return False


def _load() -> None:
    """Build (or load the earlier build of) the kernels, registering their operators."""
    if not hasattr(torch.ops.mt, "smoothed_ce"):  # not yet loaded in this process
        from torch.utils.cpp_extension import load

        # torch runs ninja from PATH; the `ninja` wheel (mt's `all` extra) puts it beside the
        # interpreter, which is not on PATH when a virtual environment is used unactivated
        beside = Path(sys.executable).parent
        if shutil.which("ninja") is None and (beside / "ninja").exists():
            os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ.get('PATH', '')}"
        start = time.perf_counter()
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            load(directory.name, [str(source) for source in SOURCES], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], build_directory=str(directory),
                 is_python_module=False, verbose=False)  # fmt: skip
        log.info("mt's kernels for this CPU ready (%.1f s: built, or loaded from an earlier "
                 "build)", time.perf_counter() - start)  # fmt: skip


def _loaded() -> bool:
    """Whether the kernels are loaded (built on the first call); False, with the reason logged
    once and kept for :func:`unavailable_reason`, where they cannot be built."""
    with _LOCK:
        if "loaded" not in _STATE:
            try:
                _load()
                _STATE["loaded"] = True
            except Exception as exc:  # no compiler, no ninja, a failed build: torch's path
                _STATE["loaded"], _STATE["why"] = False, f"{type(exc).__name__}: {exc}".strip()
                first_line = str(_STATE["why"]).splitlines()[0][:300]
                log.warning(
                    "mt's kernels could not be built (%s); the training loss and dropout "
                    "through torch's operators instead (slower)", first_line,
                )  # fmt: skip
        return bool(_STATE["loaded"])


def smoothed_ce() -> Callable | None:
    """``torch.ops.mt.smoothed_ce(z, target, rows, eps_i, on_target, grad)``, or None where
    the kernels cannot be built."""
    return torch.ops.mt.smoothed_ce.default if _loaded() else None


def dropout() -> tuple[Callable, Callable] | None:
    """``(torch.ops.mt.dropout, torch.ops.mt.masked_scale)``, or None where the kernels cannot
    be built."""
    if not _loaded():
        return None
    return torch.ops.mt.dropout.default, torch.ops.mt.masked_scale.default


def unavailable_reason() -> str | None:
    """Why :func:`smoothed_ce` gave None (None when it was not asked, or it was built)."""
    return _STATE.get("why")  # type: ignore[return-value]
