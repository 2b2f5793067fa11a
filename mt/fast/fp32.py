"""float32 decoding on mt's own product (``torch.ops.mt.f32_linear``, ``mt/fast/csrc/
f32_linear.cpp``: AVX2 and FMA): every ``nn.Linear`` and the tied pre-softmax projection of a
decoding copy, the weights laid out once in blocks of 16 output channels.

What it offers beside oneDNN's packed products (``mt.fast.onednn``): at a decoder step's rows
on an AMD Zen 3 it ran 1.0-1.25x as fast (2 threads, a base-size step's 37 products one after
the other; 1.3-1.7x at 32 rows), and a row's result depends on that row alone, whatever the
batch. ``mt.fast.decoding`` decodes on it where a probe measures it the fastest float32 product
here (``decode.onednn=null``, the default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mt.fast.native as native
from mt.fast.modules import products_copy
from mt.model.transformer import Transformer

BLOCK = 16  # output channels per block of the kernel's weight layout


def blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight (N, K) as ``torch.ops.mt.f32_linear`` takes it: (Np/16, K, 16), the
    rows padded with zeros to Np (a multiple of 16), each block of 16 output channels stored
    input by input (a copy)."""
    n, k = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


class Fp32Linear(nn.Module):
    """``y = act(x W^T + b)`` for float32 ``x`` on ``torch.ops.mt.f32_linear`` (no autograd).

    Args:
        weight: (out, in); laid out in the kernel's blocks (a copy).
        bias: (out,) or None (shared, not copied).
        relu: apply ReLU inside the kernel (the FFN's first layer).

    Raises:
        RuntimeError: where mt's float32 kernel is not available (``mt.fast.native``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> None:
        super().__init__()
        op = native.f32_linear()
        if op is None:
            raise RuntimeError("Fp32Linear: mt's float32 kernel is not available here ("
                               f"{native.unavailable_reason() or 'no AVX2 and FMA'})")
        self._op = op
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", blocks(weight), persistent=False)
        b = None if bias is None else bias.detach().float()
        self.register_buffer("bias", b, persistent=False)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) float32 -> (..., out) float32."""
        return self._op(x, self.packed, self.bias, self.out_features, self.relu)

    def subset(self, ids: torch.Tensor) -> Fp32Linear:
        """The same product over output rows ``ids`` only, without activation: a vocabulary
        shortlist's columns of the projection (the full product's to the bit: each output is
        its row's and column's own sum)."""
        # row i of the weight is lane i % 16 of block i // 16, over all its inputs
        rows = self.packed[ids // BLOCK, :, ids % BLOCK]
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return Fp32Linear(rows, bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, "
                f"bias={self.bias is not None}, relu={self.relu}, mt f32-avx2")  # fmt: skip


class Fp32FeedForward(nn.Module):
    """FFN(x) = W2 relu(W1 x + b1) + b2 on mt's float32 kernel, the ReLU inside the first
    product (for decoding; ``ffn`` is an ``mt.model.transformer.FeedForward``)."""

    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        self.w1 = Fp32Linear(ffn.w1.weight, ffn.w1.bias, relu=True)
        self.w2 = Fp32Linear(ffn.w2.weight, ffn.w2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        return self.w2(self.w1(x))


def fp32_copy(model: Transformer) -> tuple[nn.Module, Fp32Linear]:
    """A copy of ``model`` whose Linear layers run on mt's float32 kernel, and its projection.

    Returns:
        ``(copy, head)``: the copy in eval mode, for decoding only (the other parameters
        shared with ``model``, not copied), and the pre-softmax projection (all
        ``padded_vocab`` rows); ``model`` is not modified.
    """
    clone = products_copy(model, Fp32FeedForward, lambda c: Fp32Linear(c.weight, c.bias))
    return clone, Fp32Linear(clone.output_weight, None).eval()
