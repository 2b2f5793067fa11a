"""Precision: which one the hardware computes fastest (``train.precision=auto``), the autocast
context of each (``mt.device.autocast``, training and decoding alike), and TF32 for float32
products on CUDA."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

import mt.fast.probe as probe
from mt.device import autocast
from mt.fast.onednn import bucketed_linear, linear, onednn_available, size_kernel_cache

log = logging.getLogger(__name__)


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 arithmetic in hardware: a CUDA GPU from Ampere on, or an
    x86 CPU with AVX512-BF16 or AMX (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4 and later).
    Elsewhere (AVX2 CPUs, older GPUs) bfloat16 is emulated, many times slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    checks = (getattr(torch.cpu, name, None) for name in _CPU_BF16_CHECKS)
    return any(check() for check in checks if check is not None)


# torch's own CPU feature checks (private, present since torch 2.1): either means native bf16.
_CPU_BF16_CHECKS = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


def resolve_precision(
    precision: str,
    device: torch.device,
    shape: tuple[int, int, int] = (2048, 512, 2048),
    cpu_kernels: bool = True,
    cache_dir: str | Path | None = None,
    vocab: int = 8000,
) -> str:
    """The training precision for ``train.precision`` on ``device``: ``fp32``, ``bf16`` or
    ``fp16``.

    ``auto`` measures (``mt.fast.probe``): fp32 and bf16 each run a layer's products forward
    and backward at the run's ``shape`` (tokens per batch, d_model, d_ff; :func:`layer_step`)
    as the training step runs them, and the faster wins; bf16 is ruled out beforehand only on a
    GPU without it. Where oneDNN computes float32 products in bfloat16 when asked
    (:func:`onednn_bf32_available`), float32 with that math (``bf32``) is timed too: it returns
    ``fp32`` and is applied by :func:`apply_fp32_math`. On a CPU the kernel caches are first
    sized for the run (``mt.fast.onednn.size_kernel_cache``), so the probe's products keep
    their kernels as the run's will. An explicit choice is kept, with a warning for ``bf16`` on
    hardware that only emulates it.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    n, d, f = shape
    size_kernel_cache(n, d, f, vocab, device)
    if precision == "auto":
        candidates = ["fp32", "bf16"]
        if device.type == "cuda" and not native_bf16(device):
            candidates = ["fp32"]
        if device.type == "cpu" and onednn_bf32_available():
            candidates.append("bf32")
        if len(candidates) == 1:
            log.info("train.precision=auto: fp32 (%s has no bfloat16)", device)
            return "fp32"
        choice = probe.choose(
            "train.precision", device, f"layer {n}x{d}x{f}",
            lambda c, rows: layer_step(c, rows, d, f, device, _product(c, device, cpu_kernels)),
            candidates, n, min(n, 128), cache_dir,
        )  # fmt: skip
        return "fp32" if choice == "bf32" else choice
    if precision == "bf16" and not native_bf16(device):
        log.warning(
            "train.precision=bf16 on a %s without native bfloat16 arithmetic: it is emulated "
            "and many times slower than fp32 here (train.precision=auto picks fp32)",
            device.type,
        )
    return precision


def _product(precision: str, device: torch.device, cpu_kernels: bool):
    """The product ``mt.fast.for_training`` runs a layer with in ``precision``: on a CPU with
    ``cpu_kernels``, oneDNN's for float32, autocast's over bucketed row counts for 16-bit."""
    if device.type != "cpu" or not cpu_kernels:
        return F.linear
    return bucketed_linear if precision in ("bf16", "fp16") else linear


@contextlib.contextmanager
def bf32_math(enabled: bool = True):
    """Within: oneDNN may compute float32 products with bfloat16 inputs and float32 sums
    (torch's ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``; oneDNN's "bf32"), where
    its kernels for the CPU have that math (AMX); elsewhere it keeps float32 math."""
    flags = torch.backends.mkldnn.matmul
    before = flags.fp32_precision
    if enabled:
        flags.fp32_precision = "bf16"
    try:
        yield
    finally:
        flags.fp32_precision = before


@functools.cache
def onednn_bf32_available() -> bool:
    """Whether oneDNN here computes float32 products in bfloat16 when asked (:func:`bf32_math`),
    told by the numbers (bfloat16's rounding, 2^-8 relative, not float32's): torch sets the
    mode on every CPU, but oneDNN has such kernels on AMX only. The product is of a layer's
    size: oneDNN hands tiny ones (16 x 64, say) to float32 kernels even on AMX."""
    if not onednn_available():
        return False
    n = 256  # rows, inputs and outputs of the check's product
    x = torch.full((n, n), 1.0 + 2.0**-12)  # exact in float32, 1.0 in bfloat16
    w = torch.ones(n, n)
    try:
        with bf32_math():
            y = linear(x, w)
    except RuntimeError:
        return False
    exact = n * (1.0 + 2.0**-12)
    return bool((y - exact).abs().max() > n * 2.0**-14)


def apply_fp32_math(device: torch.device) -> bool:
    """Turn on oneDNN's bfloat16 math in float32 products for the rest of the process where the
    precision probe (or rank 0's, ``mt.fast.probe.adopt``) chose ``bf32``. Returns whether."""
    if device.type != "cpu":
        return False
    chose = any(k.startswith("train.precision|") and v == "bf32"
                for k, v in probe.decided().items())  # fmt: skip
    if chose:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        log.info("float32 products on %s: oneDNN's bfloat16 math (bf32, the probe's choice)",
                 device)  # fmt: skip
    return chose


ROW_SHARES = (1.0, 0.85, 0.7)  # the row counts a probe's calls take in turn, as shares of n


def layer_step(precision: str, n: int, d: int, f: int, device: torch.device, product):
    """The products of one Transformer layer forward and backward (queries, keys and values
    (3d x d), the attention's output (d x d), the FFN (f x d, d x f)) in ``precision`` (fp32,
    bf16, fp16, or bf32: float32 with :func:`bf32_math`) with ``product`` (a
    ``linear(x, weight)``), as training runs them: the work the training probes time.

    Each call takes the next of ``n x ROW_SHARES`` rows: a batch of ``n`` tokens rarely fills
    them, and a kernel can be fast at one row count only (a library can tie another at a power
    of two and lose around it). One call at every row count is made here, so kernels built per
    row count are built before timing.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    x, wqkv, wo, w1, w2 = (torch.randn(*s, generator=g).to(device).requires_grad_()
                           for s in ((n, d), (3 * d, d), (d, d), (f, d), (d, f)))  # fmt: skip
    batches = [x[: max(1, round(n * share))] for share in ROW_SHARES]
    turns = itertools.cycle(batches)

    def step() -> None:
        xi = next(turns)
        with bf32_math(precision == "bf32"):  # the backward's products too
            with autocast(device, "fp32" if precision == "bf32" else precision):
                y = product(xi, wqkv).sum() + product(xi, wo).sum()
                y = y + product(F.relu(product(xi, w1)), w2).sum()
            y.float().backward()

    for _ in batches:
        step()
    return step


def projection_step(n: int, d: int, vocab: int, device: torch.device, product):
    """The two products of a block of the blockwise loss (``mt.fast.loss``) in float32 through
    ``product``: the scores ``x W^T`` of ``n`` rows and the input gradient ``G W``; the weight
    gradient is torch's whatever the product. Kernels are built here, before timing."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x, w, grad = (torch.randn(*s, generator=g).to(device)
                  for s in ((n, d), (vocab, d), (n, vocab)))  # fmt: skip

    def step() -> None:
        product(x, w)
        product(grad, w.t())

    step()
    return step


def set_fp32_precision(device: torch.device, tf32: bool) -> None:
    """On CUDA, let float32 matrix products use TF32 tensor cores (``train.tf32``): a 10-bit
    mantissa for the inputs, float32 accumulation. CPUs are left alone."""
    if device.type != "cuda":
        return
    # The documented switch; it keeps torch's legacy and new TF32 flags consistent.
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    log.info("float32 matrix products on %s: %s", device, "TF32" if tf32 else "full float32")


def machine(device: torch.device) -> dict:
    """What a figure was measured on (records, reports): the device, the CPU model, native
    bfloat16 or not, and torch's intra-op threads."""
    out = {"device": str(device), "cpu": probe.cpu_model(), "native_bf16": native_bf16(device),
           "threads": torch.get_num_threads()}  # fmt: skip
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
