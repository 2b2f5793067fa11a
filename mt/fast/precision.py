"""Precision: which one the hardware computes fastest (``train.precision=auto``), the autocast
context of each (``mt.device.autocast``, training and decoding alike), and TF32 for float32
products on CUDA."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

import mt.fast.probe as probe
from mt.device import autocast

log = logging.getLogger(__name__)


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 arithmetic in hardware, so that bf16 training is faster
    than float32 there: a CUDA GPU that supports it (Ampere and later), or an x86 CPU with
    AVX512-BF16 or AMX (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later).

    Elsewhere (AVX2 CPUs such as AMD Zen 3, older GPUs) bfloat16 is emulated: a bf16 training
    step is many times slower than the float32 one, and oneDNN has no bf16 kernels there at all.
    """
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
) -> str:
    """The training precision for ``train.precision`` on ``device``.

    ``auto`` measures (``mt.fast.probe``): fp32 and bf16 each run a layer's products forward
    and backward at the run's ``shape`` (tokens per batch, d_model, d_ff; :func:`layer_step`),
    as the training step runs them (fp32 on oneDNN with ``cpu_kernels``, bf16 under autocast),
    and the faster wins.
    The only thing ruled out beforehand is what cannot run: bf16 on a GPU without it. An
    explicit choice is kept, with a warning when it is ``bf16`` on hardware that only emulates
    it. Returns ``fp32``, ``bf16`` or ``fp16``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        candidates = ["fp32", "bf16"]
        if device.type == "cuda" and not native_bf16(device):
            candidates = ["fp32"]
        if len(candidates) == 1:
            log.info("train.precision=auto: fp32 (%s has no bfloat16)", device)
            return "fp32"
        n, d, f = shape
        return probe.choose(
            "train.precision", device, f"layer {n}x{d}x{f}",
            lambda c, rows: layer_step(c, rows, d, f, device, _fp32_product(device, cpu_kernels)),
            candidates, n, min(n, 128), cache_dir,
        )  # fmt: skip
    if precision == "bf16" and not native_bf16(device):
        log.warning(
            "train.precision=bf16 on a %s without native bfloat16 arithmetic: it is emulated "
            "and many times slower than fp32 here (train.precision=auto picks fp32)",
            device.type,
        )
    return precision


def _fp32_product(device: torch.device, cpu_kernels: bool):
    import torch.nn.functional as F

    from mt.fast.onednn import linear

    return linear if device.type == "cpu" and cpu_kernels else F.linear


ROW_SHARES = (1.0, 0.85, 0.7)  # the row counts a probe's calls take in turn, as shares of n


def layer_step(precision: str, n: int, d: int, f: int, device: torch.device, product):
    """The products of one Transformer layer forward and backward (queries, keys and values
    (3d x d), the attention's output (d x d), the FFN (f x d, d x f)) in ``precision`` with
    ``product`` (a ``linear(x, weight)``), as training runs them: the work the training
    probes time.

    Each call takes the next of ``n x ROW_SHARES`` rows. A batch of ``n`` tokens rarely fills
    them: padding and sentence lengths leave fewer, and a kernel can be fast at one row count
    only (a library can tie another at a power of two and lose at the row counts around it).
    One call at every row count is made here, before timing,
    so kernels built per row count are built outside it.
    """
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    x, wqkv, wo, w1, w2 = (torch.randn(*s, generator=g).to(device).requires_grad_()
                           for s in ((n, d), (3 * d, d), (d, d), (f, d), (d, f)))  # fmt: skip
    batches = [x[: max(1, round(n * share))] for share in ROW_SHARES]
    turns = itertools.cycle(batches)

    def step() -> None:
        xi = next(turns)
        with autocast(device, precision):
            y = product(xi, wqkv).sum() + product(xi, wo).sum()
            y = y + product(F.relu(product(xi, w1)), w2).sum()
        y.float().backward()

    for _ in batches:
        step()
    return step


def projection_step(n: int, d: int, vocab: int, device: torch.device, product):
    """The two products of one block of the blockwise loss (``mt.fast.loss``) in float32 with
    ``product`` (a ``linear(x, weight)``): the scores ``x W^T`` of ``n`` rows and the input
    gradient ``G W`` (``W^T`` as the weight, as the loss passes it). The weight gradient
    ``G^T x`` is torch's whatever the product, so it is left out. Kernels are built on the
    call made here, before timing."""
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
    """What a figure was measured on: the device, the CPU model, whether the device has native
    bfloat16 arithmetic, and torch's intra-op threads (records, reports, README tables)."""
    out = {"device": str(device), "cpu": probe.cpu_model(), "native_bf16": native_bf16(device),
           "threads": torch.get_num_threads()}  # fmt: skip
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out
