"""mt's own C++ kernels for CPU decoding and training, compiled on first use for the CPU in hand.

``torch.ops.mt.short_attention`` (``csrc/short_attention.cpp``): the attention of a
decoder step over its caches, ``softmax(q k^T / sqrt(d_k) + bias) v`` for the few queries of a
row (one per hypothesis in self-attention, a sentence's G hypotheses in encoder-decoder
attention), in one pass over each row's keys and values. Through torch the same step is two
batched products of thousands of tiny matrices and a softmax, each call paying torch's
overhead for a few hundred multiply-adds (the figures: docs/performance.md).

``torch.ops.mt.int8_linear`` and ``torch.ops.mt.int8_linear_avx2`` (``csrc/int8_linear.cpp``):
int8 decoding's products (``mt.fast.quantize.Int8Linear``) on AVX-512 VNNI (8 bits) and on AVX2
(7 bits), each row of the activations quantized on its own; where the CPU lacks an instruction
set its kernel compiles to a stub (``mt::int8_linear_available``,
``mt::int8_linear_avx2_available`` say false), and without either int8 decoding stays on
fbgemm's products.

``torch.ops.mt.f32_linear`` (``csrc/f32_linear.cpp``): float32 decoding's products on AVX2 and FMA
(``mt.fast.fp32.Fp32Linear``), the weights in blocks of 16 output channels, a row's result
independent of the rows beside it, for the AVX2 CPUs where oneDNN's float32 products are the
slower (docs/performance.md), with the same outputs. Elsewhere a stub
(``mt::f32_linear_available`` says false) and float32 decoding runs on oneDNN's or torch's.

``torch.ops.mt.smoothed_ce`` (``csrc/smoothed_ce.cpp``): a row block of the CPU training loss
(``mt.fast.loss``): the label-smoothed cross-entropy of float32 or bfloat16 scores and, in place,
its gradient, three passes over each row where torch's operators make about ten over the block
(and cast it to float32 and back): the loss reads its block from the cache, not from memory.

``torch.ops.mt.best_token`` (``csrc/best_token.cpp``): a greedy decoding step's token and its
log-probability straight from the logits (and a shortlist's bias), two passes over each row in
place of a log-softmax written out, masked and searched; ``torch.ops.mt.top_tokens``, the same for
a beam step: each row's k best tokens and their log-probabilities.

``torch.ops.mt.decoder_step`` (``csrc/decoder_step.cpp``): a whole decoder step of a decoding
copy in one call from Python, every layer's products (mt's int8 kernels, mt's, oneDNN's or
torch's float32), cache writes, attention, residual additions and LayerNorms run from C++
(``mt.fast.step.FusedStep``); ``torch.ops.mt.greedy_search`` (``csrc/greedy_search.cpp``): a
batch's whole greedy search, those steps, the projection and each step's choice, in one call
(``FusedStep.greedy``); ``torch.ops.mt.beam_search`` (``csrc/beam_search.cpp``), the same for
beam search (``FusedStep.beam``).

``torch.ops.mt.dropout`` and ``torch.ops.mt.masked_scale`` (``csrc/dropout.cpp``): the CPU
training copy's dropout (``mt.fast.dropout``) in one pass, each element's 16 random bits hashed
from a seed and its index, the bool mask and the scaled output written together, and its
backward pass in one more, where torch's operators draw, compare, cast and multiply in passes
of their own (docs/performance.md).

The kernels are compiled with torch's C++ extension loader (``torch.utils.cpp_extension.load``,
into ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``) for this CPU's instruction
set (``-march=native``), once per CPU kind, torch and Python version and sources: ~1 minute on 2
cores, then loaded in milliseconds. The build directory's name carries a digest of them all, so
a home directory shared by machines of different CPUs never loads a kernel built for another.
Processes that start at once build it once (:func:`build_lock`: the others wait for the first),
and a build lock left by a killed build is removed (torch would wait for it for ever).
Where they cannot be built (no C++ compiler or ninja, an unwritable cache) or
``MT_NATIVE_KERNELS=0`` is set, :func:`short_attention`, :func:`int8_linear`,
:func:`f32_linear`, :func:`smoothed_ce`, :func:`best_token` and :func:`dropout` return None, the
reason is said once, and decoding takes torch's path (``mt.fast.step``), which computes the same,
and fbgemm's int8 products; the loss and dropout, torch's operators.
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

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("short_attention.cpp", "int8_linear.cpp", "smoothed_ce.cpp",
                             "best_token.cpp", "dropout.cpp", "decoder_step.cpp",
                             "greedy_search.cpp", "beam_search.cpp", "f32_linear.cpp"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name
                for name in ("vec.h", "step.h", "search.h"))  # included by the sources
# OpenMP: torch's own runtime, for its threads; no warnings about the vector types' ABI
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"]
ENV = "MT_NATIVE_KERNELS"
STALE_LOCK_S = 120.0  # a build lock older than this was left by a killed build

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "loaded": whether the kernels are, "why": the reason they are not


def enabled() -> bool:
    """False where ``MT_NATIVE_KERNELS`` is 0, false, no or off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_identity() -> str:
    """What decides the code ``-march=native`` emits: the CPU's vendor, family, model and
    flags (the first processor of /proc/cpuinfo); the platform's name elsewhere."""
    keys = ("vendor_id", "cpu family", "model", "flags")
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n")[0].splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    fields = (line.split(":", 1) for line in lines if ":" in line)
    return "|".join(f"{k.strip()}={v.strip()}" for k, v in fields if k.strip() in keys)


def build_name() -> str:
    """The extension's name: a digest of the source, the flags, the CPU, torch's and Python's
    versions."""
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), " ".join(CFLAGS).encode(),
                 _cpu_identity().encode(), torch.__version__.encode(), sys.version.encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"mt_native_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """Where the kernel is built: ``$TORCH_EXTENSIONS_DIR`` (or torch's default root, e.g.
    ``~/.cache/torch_extensions``) / :func:`build_name`."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / build_name()


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Where ``flock`` is missing (:func:`build_lock`): wait for a build in progress elsewhere
    (torch's ``lock`` file in ``directory``) to end; remove the lock when it is older than
    ``max_age_s``: left by a build that was killed, it would make torch wait for ever."""
    lock = directory / "lock"
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            return
        if age > max_age_s:
            log.warning("removing %s, left %.0f s ago by a build of mt's attention kernel "
                        "that did not finish", lock, age)  # fmt: skip
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.1)


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold the build of ``directory`` for this process: an exclusive ``flock`` on
    ``directory/build.flock``, waited for as long as a build elsewhere takes (a minute on 2 busy
    cores) and released by the kernel when its holder ends, killed or not (or when the file is
    closed here). Holding it, a torch ``lock`` file found in ``directory`` was left by a build
    that was killed (torch would wait for it for ever) and is removed. Without ``fcntl``, or
    where the file system refuses the lock: :func:`clear_stale_lock`."""
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
    none to take (not a POSIX system, or a file system without locks: some network mounts)."""
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
    if not hasattr(torch.ops.mt, "short_attention"):  # not yet loaded in this process
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
    once and kept for :func:`unavailable_reason`, where they are switched off or cannot be
    built."""
    if not enabled():
        return False
    with _LOCK:
        if "loaded" not in _STATE:
            try:
                _load()
                _STATE["loaded"] = True
            except Exception as exc:  # no compiler, no ninja, a failed build: torch's path
                _STATE["loaded"], _STATE["why"] = False, f"{type(exc).__name__}: {exc}".strip()
                first_line = str(_STATE["why"]).splitlines()[0][:300]
                log.warning(
                    "mt's kernels could not be built (%s); decoding and the training loss "
                    "through torch's and fbgemm's operators instead (slower)", first_line,
                )  # fmt: skip
        return bool(_STATE["loaded"])


def short_attention() -> Callable | None:
    """``torch.ops.mt.short_attention(q, k, v, bias, scale)`` (see the module docstring), built
    or loaded on the first call; None where it is switched off or cannot be built (the reason
    logged once, and kept in :func:`unavailable_reason`)."""
    return torch.ops.mt.short_attention if _loaded() else None


_INT8_OPS = {"vnni": "int8_linear", "avx2": "int8_linear_avx2"}  # each with its *_available


def int8_linear(kind: str = "vnni") -> Callable | None:
    """``torch.ops.mt.int8_linear(x, w, scale, comp, bias, n, relu)`` (``csrc/int8_linear.cpp``:
    int8 products for a few rows, activations quantized per row) on ``kind``: ``"vnni"``
    (AVX-512 VNNI's ``vpdpbusd``, 8 bits) or ``"avx2"`` (``torch.ops.mt.int8_linear_avx2``,
    the same arguments and weight layout: AVX2's ``vpmaddubsw``, 7 bits). None where the
    kernels are off or cannot be built, or this CPU lacks the instructions of that kind (int8
    decoding then takes another, ``mt.fast.quantize``)."""
    if kind not in _INT8_OPS:
        raise ValueError(f"int8_linear: kind {kind!r} is not vnni or avx2")
    if not _loaded():
        return None
    op = getattr(torch.ops.mt, _INT8_OPS[kind])
    return op.default if getattr(torch.ops.mt, f"{_INT8_OPS[kind]}_available")() else None


def f32_linear() -> Callable | None:
    """``torch.ops.mt.f32_linear(x, w, bias, n, relu)`` (``csrc/f32_linear.cpp``: float32
    products for decoding on AVX2 and FMA, a row's result independent of the rows beside it;
    ``mt.fast.fp32.Fp32Linear``), or None where the kernels are off or cannot be built, or this
    CPU lacks AVX2 or FMA (float32 decoding then runs on oneDNN's or torch's products)."""
    if not _loaded():
        return None
    return torch.ops.mt.f32_linear.default if torch.ops.mt.f32_linear_available() else None


def smoothed_ce() -> Callable | None:
    """``torch.ops.mt.smoothed_ce(z, target, rows, eps_i, on_target, grad)``
    (``csrc/smoothed_ce.cpp``: a block's label-smoothed cross-entropy and, in place, its
    gradient, for the CPU training loss), or None where the kernels are off or cannot be built
    (``mt.fast.loss`` then computes the same through torch's operators)."""
    return torch.ops.mt.smoothed_ce.default if _loaded() else None


def best_token() -> Callable | None:
    """``torch.ops.mt.best_token(logits, bias, forbid) -> (token, lprob)``
    (``csrc/best_token.cpp``: a greedy step's token and its log-probability from the logits,
    without writing their log-softmax), or None where the kernels are off or cannot be built
    (greedy search then takes torch's log-softmax and argmax, ``mt.decode.search``)."""
    return torch.ops.mt.best_token.default if _loaded() else None


def top_tokens() -> Callable | None:
    """``torch.ops.mt.top_tokens(logits, bias, width, forbid, k) -> (lprob, token)``
    (``csrc/best_token.cpp``: a beam step's k best next tokens of each row and their
    log-probabilities, without writing the log-softmax), or None where the kernels are off or
    cannot be built (beam search then takes torch's log-softmax and top-k)."""
    return torch.ops.mt.top_tokens.default if _loaded() else None


def dropout() -> tuple[Callable, Callable] | None:
    """``(torch.ops.mt.dropout, torch.ops.mt.masked_scale)`` (``csrc/dropout.cpp``: the CPU
    training copy's dropout, mask and scaled output in one pass, and its backward pass), or
    None where the kernels are off or cannot be built (``mt.fast.dropout`` then draws its masks
    through torch's operators)."""
    if not _loaded():
        return None
    return torch.ops.mt.dropout.default, torch.ops.mt.masked_scale.default


def decoder_step() -> Callable | None:
    """``torch.ops.mt.decoder_step`` (``csrc/decoder_step.cpp``: a decoding copy's whole
    decoder step, every layer, in one call; ``mt.fast.step.FusedStep``), or None where the
    kernels are off or cannot be built (the step then goes layer by layer through the modules,
    ``mt.fast.step.decoder_step``)."""
    return torch.ops.mt.decoder_step.default if _loaded() else None


def greedy_search() -> Callable | None:
    """``torch.ops.mt.greedy_search`` (``csrc/greedy_search.cpp``: a batch's whole greedy search
    on a decoding copy in one call; ``mt.fast.step.FusedStep.greedy``), or None where the
    kernels are off or cannot be built (greedy search then steps from Python,
    ``mt.decode.search``)."""
    return torch.ops.mt.greedy_search.default if _loaded() else None


def beam_search() -> Callable | None:
    """``torch.ops.mt.beam_search`` (``csrc/beam_search.cpp``: a batch's whole beam search on a
    decoding copy in one call; ``mt.fast.step.FusedStep.beam``), or None where the kernels are
    off or cannot be built (beam search then steps from Python, ``mt.decode.search``)."""
    return torch.ops.mt.beam_search.default if _loaded() else None


def unavailable_reason() -> str | None:
    """Why :func:`short_attention` gave None (None when it was not asked, or it was built)."""
    if not enabled():
        return f"{ENV}={os.environ.get(ENV)}"
    return _STATE.get("why")  # type: ignore[return-value]
