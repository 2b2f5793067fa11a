"""Process-wide settings of a device that training and decoding share: the autocast context of a
precision, and which of SDPA's CUDA kernels attention may take."""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)


def autocast(device: torch.device | str, precision: str):
    """The autocast context for ``precision``: fp32 none, bf16 bfloat16, fp16 float16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def gpu_attention(device: torch.device) -> None:
    """On CUDA, SDPA without cuDNN's kernel (flash and memory-efficient attention stay).

    cuDNN's attention builds an execution plan for each new shape (batch, lengths), and
    batches by tokens bring a new shape nearly every step, in training and in decoding
    (docs/benchmarks/gpu-h100-h200-2026-11.md). Process-wide, as TF32 is.
    """
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("attention on %s: flash / memory-efficient SDPA (cuDNN's builds a plan per shape)",
             device)  # fmt: skip
