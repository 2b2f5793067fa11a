"""Process-wide settings of a device that training and decoding share: the autocast context of a
precision, and which of SDPA's CUDA kernels attention may take. Neither is the paper
(``mt.model``) nor one of mt's kernels (``mt.fast``): the torch decoding path and the training
copy both set them the same way."""

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
    batches by tokens bring a new shape nearly every step, in training and in decoding. On an
    H200 (torch 2.11, CUDA 13.0), ``base`` in bf16 on real news batches of 25k tokens trained
    at 46k and 43k target tokens/s with SDPA's default choice (cuDNN's) and at 349k without
    it; ``big`` at 193k. Process-wide, as TF32 is; a no-op elsewhere and when already off.
    """
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("attention on %s: flash / memory-efficient SDPA (cuDNN's builds a plan per shape)",
             device)  # fmt: skip
