"""Faster kernels for training on a CPU, with the model's math unchanged (``train.cpu_kernels``).

:func:`training_copy` returns a copy of the model that shares its parameters (gradients land on
the model's own tensors, so the optimiser, checkpoints and validation see one model) and runs
four things differently:

* **Products through oneDNN** (float32 training without autocast): every ``nn.Linear`` and the
  tied pre-softmax projection compute ``y = x W^T + b`` and the input gradient ``dx = dy W``
  with oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``, the one decoding uses,
  see ``mt.fast.decoding``) instead of MKL's sgemm, which reaches only part of an AMD CPU's float32
  peak. The weight gradient ``dW = dy^T x`` stays on ``torch.mm``, which is as fast there. All
  products accumulate in float32; only the order of the sums differs.
* **Dropout masks from 16 random bits** per element (:func:`dropout`): torch's CPU dropout
  draws a float per element through ``bernoulli_``, about 4x the time of drawing the same
  number of 16-bit integers, and on the small model those draws were a tenth of a training
  step. A unit is dropped with probability ``round(p * 65536) / 65536`` (p = 0.1: 0.10001)
  and the kept units are scaled by the inverse of the exact keep probability, so the expected
  output is the input, as with ``F.dropout``.
* **The projection and the loss in row blocks** (``Transformer.blockwise_loss``,
  ``mt.model.loss.projected_cross_entropy``): the (n, V) logits and their gradient, 112 MB each in
  float32 for a 3,500-token batch at V = 8000, are never allocated. On a CPU each such
  allocation is fresh memory from the kernel every step (above glibc's largest mmap threshold),
  55,000 page faults a step for the two, and its passes run from DRAM instead of the cache.
* **Attention written out** (:data:`CPU_TRAINING`): ``softmax(q k^T / sqrt(d_k)) v`` as tensor
  ops, the attention dropout's mask drawn as above, instead of
  ``F.scaled_dot_product_attention``. On a CPU, SDPA with dropout takes its unfused reference
  path and draws its mask through ``bernoulli_``; without dropout it takes a flash kernel that
  is slower than the written-out form at sentence lengths in bfloat16.

Training on a CPU also calls :func:`hold_freed_memory` (glibc keeps freed memory for the next
step instead of handing it back to the kernel and faulting it in again): :func:`for_training`
does both.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.attention import Kernels

log = logging.getLogger(__name__)

_BITS = 16
_LEVELS = 1 << _BITS  # a 16-bit draw takes one of 65536 values


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``y = x W^T + b`` with the forward and the input gradient on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t(), None)  # dy W: W^T as the (in, out) "weight"
        grad_2d = grad.reshape(-1, grad.size(-1))
        if ctx.needs_input_grad[1]:
            grad_w = grad_2d.t().mm(x.reshape(-1, x.size(-1)))  # dy^T x: (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` with oneDNN's kernel for float32 on the CPU outside autocast (where torch's
    own bfloat16 products already run on oneDNN), ``F.linear`` otherwise."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _OneDNNLinear.apply(x, weight, bias)
    return _product(x, weight, bias)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout whose mask compares 16-bit random integers with a threshold (module docstring).

    Every unit is zeroed independently with probability ``round(p * 65536) / 65536``; the rest
    are multiplied by ``1 / (1 - that)``.
    """
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    dropped = round(p * _LEVELS)
    # Four 16-bit draws per 64-bit integer: random_(-2**63, None) fills all 64 bits uniformly.
    n = x.numel()
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=x.device).random_(-(2**63), None)
    draws = words.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
    keep = draws >= dropped - _LEVELS // 2  # P(keep) = (65536 - dropped) / 65536
    return x * keep.to(x.dtype).mul_(_LEVELS / (_LEVELS - dropped))


class Dropout(nn.Module):
    """``nn.Dropout`` through :func:`dropout`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, mask bits={_BITS}"


class CPUTrainingKernels(Kernels):
    """Teacher-forced attention for CPU training: the written-out formula, with
    :func:`dropout` on the weights. The same attention as ``mt.model.attention.SDPA``."""

    def explicit(self, q: torch.Tensor) -> bool:
        return True

    def dropout(self, weights: torch.Tensor, p: float) -> torch.Tensor:
        return dropout(weights, p)


CPU_TRAINING = CPUTrainingKernels()


class Linear(nn.Module):
    """An ``nn.Linear``'s own parameters (shared, not copied) through :func:`linear`."""

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, bias={self.bias is not None}, oneDNN"


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
    if not sys.platform.startswith("linux"):
        return False
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


def training_copy(model: nn.Module, products: bool = True) -> nn.Module:
    """A copy of ``model`` for the training forward pass on a CPU (see the module docstring).

    Parameters and buffers are the model's own (shared, not copied), so the copy's state dict
    equals the model's and an optimiser over ``model.parameters()`` updates both.

    Args:
        model: an ``mt.model.transformer.Transformer`` (any module with
        ``nn.Linear``/``nn.Dropout`` works).
        products: run the float32 products through oneDNN (when this torch has its kernel).

    Returns:
        The copy, in the model's training mode.
    """
    from mt.fast.decoding import onednn_available
    from mt.model.transformer import Transformer

    products = products and onednn_available()
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared)
    for parent in list(clone.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, Dropout(child.p))
            elif products and type(child) is nn.Linear:
                setattr(parent, name, Linear(child))
    if isinstance(clone, Transformer):
        clone.teacher_kernels = CPU_TRAINING
        clone.blockwise_loss = True
        if products:
            clone.product = linear  # the pre-softmax projection
    log.info(
        "CPU training kernels: attention written out, dropout masks from %d random bits%s",
        _BITS,
        ", float32 products on oneDNN" if products else "",
    )
    return clone


def expected_keep(p: float) -> float:
    """The keep probability :func:`dropout` realises for ``p`` (for tests and the docs)."""
    return 1.0 - round(p * _LEVELS) / _LEVELS if p > 0 else 1.0


def for_training(
    model: nn.Module, device: torch.device, enabled: bool, precision: str
) -> nn.Module:
    """What the training step runs (``mt.train.recipe`` and ``make bench``): on a CPU with
    ``train.cpu_kernels``, :func:`hold_freed_memory` and a :func:`training_copy` (oneDNN
    products in fp32 only: bf16 keeps autocast's); ``model`` itself otherwise."""
    if device.type != "cpu" or not enabled:
        return model
    hold_freed_memory()
    return training_copy(model, products=precision == "fp32")
