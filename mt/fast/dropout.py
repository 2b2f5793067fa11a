"""Dropout whose masks come from 16 random bits per element, for CPU training.

torch's CPU dropout draws a float per element through ``bernoulli_``, several times the time of
drawing as many 16-bit integers (docs/performance.md). Here a unit is dropped with probability
``round(p * 65536) / 65536`` and the kept ones are scaled by the inverse of the exact keep
probability, as with ``F.dropout``. mt's kernel (``mt.fast.native``, ``csrc/dropout.cpp``) makes
the draws, mask and output in one pass, hashing each element's 16 bits from a seed and its index;
elsewhere torch's operators draw them (:func:`keep_mask`). Either way the draws follow torch's
generator, so a seeded run is reproducible and a resumed one continues as it would have.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import mt.fast.native as native

_BITS = 16
_LEVELS = 1 << _BITS  # a 16-bit draw takes one of 65536 values
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what mt::dropout takes


def _threshold(p: float) -> tuple[int, float]:
    """How many of a 16-bit draw's 65536 values drop a unit at rate ``p``, and the kept units'
    scale, ``1 / P(keep)``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    dropped = round(p * _LEVELS)
    return dropped, _LEVELS / (_LEVELS - dropped)


def keep_mask(
    shape: torch.Size, p: float, device: torch.device | str
) -> tuple[torch.Tensor, float]:
    """The units kept at rate ``p`` (bool, ``shape``), from 16 random bits each drawn by torch's
    operators, and the kept units' scale."""
    dropped, scale = _threshold(p)
    # Four 16-bit draws per 64-bit integer: random_(-2**63, None) fills all 64 bits uniformly.
    n = math.prod(shape)
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_(-(2**63), None)
    draws = words.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    keep = draws >= dropped - _LEVELS // 2  # P(keep) = (65536 - dropped) / 65536
    return keep, scale


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` with the units outside ``keep`` zeroed and the rest multiplied by ``scale``."""
    fused = _kernels(x)
    if fused is not None:
        return fused[1](x, keep, scale)
    return x * keep.to(x.dtype).mul_(scale)


def drop(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Dropout at rate ``p`` on ``x``: ``(dropped x, keep, scale)``, ``keep`` the bool mask of
    the kept units, ``scale`` their factor; one pass of mt's kernel where it is built."""
    fused = _kernels(x)
    if fused is None:
        keep, scale = keep_mask(x.shape, p, x.device)
        return apply_mask(x, keep, scale), keep, scale
    dropped, scale = _threshold(p)
    seed = int(torch.empty((), dtype=torch.int64).random_())  # from torch's generator
    y, keep = fused[0](x, seed, dropped, scale)
    return y, keep, scale


def _kernels(x: torch.Tensor):
    """(``mt::dropout``, ``mt::masked_scale``) for ``x``, or None where they do not apply (not
    on a CPU, another dtype) or cannot be built."""
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES:
        return None
    return native.dropout()


class _Dropout(torch.autograd.Function):
    """``drop`` whose backward keeps the bool mask (1 byte an element), where autograd would
    keep the scaled float mask it multiplied by (2-4 bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        y, keep, ctx.scale = drop(x, p)
        ctx.save_for_backward(keep)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return apply_mask(grad, keep, ctx.scale), None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout`` with 16-bit masks (module docstring), kept as booleans for backward."""
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p)


class Dropout(nn.Module):
    """``nn.Dropout`` through :func:`dropout`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, mask bits={_BITS}"
