"""int8 decoding: every ``nn.Linear`` and the tied pre-softmax projection as int8 products
(weights int8 per output channel, symmetric; activations quantized at each call; int32
accumulation, float32 output). Embeddings, LayerNorm, softmax and attention stay float32.

The products run on mt's own kernels (built by ``mt.fast.native``), the activations quantized
per row: ``torch.ops.mt.int8_linear`` where the CPU has AVX-512 VNNI (8 bits), else
``torch.ops.mt.int8_linear_avx2`` where it has AVX2 (7 bits, as fbgemm's AVX2 products); where
neither can be built, on fbgemm's (``quantized::linear_dynamic``: per tensor, 7 bits), called
directly (:class:`Int8Linear`).
They were reached through ``torch.ao.quantization.quantize_dynamic`` before, the first part of
torch's quantization to be deprecated (its notice: "will be removed in 2.10"; still present in
2.13) in favour of the separate torchao package; :class:`Int8Linear` on fbgemm computes what that
path computed, to the bit (``tests/test_search.py``), without it. Its quantized weight tensor
(``quantize_per_channel``) is deprecated too, "in a future release", with no date. The core
operators that are not deprecated are no substitute on a CPU without VNNI: on a 2-core AMD Zen 3
at 32 rows x 512 -> 2048, fbgemm's product took 285 us, ``torch._weight_int8pack_mm`` (int8
weights, float activations) 40,434 us, ``torch._int_mm`` 35,290 us and oneDNN's
``qlinear_pointwise`` (with the activations quantized in torch) 801 us against fbgemm's 447 in a
second run.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

import mt.fast.native as native
from mt.fast.modules import products_copy

KERNEL_ENV = "MT_INT8_KERNEL"  # auto | vnni | avx2 | fbgemm: Int8Linear's default kernel
KERNELS = ("auto", "vnni", "avx2", "fbgemm")
_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default
_LINEAR_RELU_DYNAMIC = torch.ops.quantized.linear_relu_dynamic.default


class Int8Linear(nn.Module):
    """``x W^T + b`` for float32 ``x``, with ``W`` held as int8 per output channel.

    The weight's scales are those of torch's per-channel symmetric weight observer (the
    largest magnitude of each row over 127.5, at least float32's eps; zero points 0). Two
    kernels (``kernel``):

    - ``"vnni"``, mt's own (``torch.ops.mt.int8_linear``, ``mt/fast/csrc/int8_linear.cpp``),
      where the CPU has AVX-512 VNNI and mt's kernels are built: each row of ``x`` quantized on
      its own (8 bits, symmetric), so a row's output does not depend on the rows beside it.
    - ``"avx2"``, mt's own for AVX2 without VNNI (``torch.ops.mt.int8_linear_avx2``, the same
      weight layout): each row quantized on its own in 7 bits (AVX2's ``vpmaddubsw`` would
      saturate with 8), so it too is independent of the rows beside it.
    - ``"fbgemm"``: ``quantized::linear_dynamic``, ``x`` quantized per call from the range of
      the whole tensor (fbgemm's reduced range, 7 bits), as torch's dynamic quantization did.

    ``"auto"`` takes the first of them that is available; the default is ``$MT_INT8_KERNEL``,
    else ``"auto"``. All accumulate in int32. Not trainable; the float32 weight is not kept.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: str | None = None) -> None:  # fmt: skip
        super().__init__()
        kernel = kernel or os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
        if kernel not in KERNELS:
            raise ValueError(f"Int8Linear: kernel {kernel!r} (or ${KERNEL_ENV}) is not one of "
                             f"{', '.join(KERNELS)}")
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        largest = torch.maximum(-w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0))
        scale = torch.clamp(largest / 127.5, min=torch.finfo(torch.float32).eps)
        zero = torch.zeros(w.size(0), dtype=torch.int64)
        b = None if bias is None else bias.detach().float()
        self.bias = b
        with warnings.catch_warnings():  # quantized tensors' own deprecation notice (below)
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        self._layout, self._mt = _mt_kernel(kernel)
        # fbgemm's int8 weight and its scales (for subset()): unpacked from its packing when
        # first asked for; mt's kernels gather a subset's rows from their own layout
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if self._mt is not None:
            self._packed = vnni_layout(q.int_repr(), scale)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._packed = torch.ops.quantized.linear_prepack(q, b)

    @property
    def kernel(self) -> str:
        """``"vnni"``, ``"avx2"`` or ``"fbgemm"``: the kernel this layer runs on."""
        return self._layout or "fbgemm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) float32 -> (..., out) float32."""
        return self._product(x, relu=False)

    def subset(self, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product over output rows ``ids`` only (a vocabulary shortlist's columns of the
        projection): the same int8 weights and per-row scales, so the full product's columns
        up to float rounding. On fbgemm, packed per call as one per-tensor int8 matrix with
        the scales applied to the output: fbgemm packs a per-channel weight channel by channel
        (7.8 ms for 2,000 rows of 256 on an AMD Zen 4, against 1.1 ms per tensor)."""
        if self.bias is not None:
            raise ValueError("a subset of an Int8Linear with a bias is not supported")
        if self._mt is not None:
            return partial(self._mt_product, self.subset_packed(ids), None, False)
        weight, row_scales = self.int8_weight()
        rows, row_scales = weight.index_select(0, ids), row_scales.index_select(0, ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch._make_per_tensor_quantized_tensor(rows, 1.0, 0)
            packed = torch.ops.quantized.linear_prepack(q, None)
        return partial(_scaled_product, packed, row_scales)

    def subset_packed(self, ids: torch.Tensor) -> tuple:
        """mt's kernel's ``(w, scale, comp, n)`` of output rows ``ids`` only (see
        :meth:`subset`; not for fbgemm's)."""
        w, scales, comp, _ = self._packed
        # row i is lane i % 16 of block i // 16, over all its (Kp/4, 4) inputs: gathered as
        # 4-byte words (each 4 inputs one int32), 10x faster than byte by byte (0.29 ms against
        # 3.1 for 3,400 rows of 256 on an AMD Zen 3; 8% of a shortlisted greedy batch before)
        words = w.view(torch.int32).view(w.size(0), w.size(1), 16)
        rows = words[ids // 16, :, ids % 16].view(torch.int8).reshape(len(ids), -1)
        rows = rows[:, : self.in_features]
        # the rows' sums (VNNI): the full weight's (``comp``), gathered
        return vnni_layout(rows, scales.index_select(0, ids), comp.index_select(0, ids))

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 weight (out, in) and its float32 scales (out,), as quantized: unpacked
        from the kernel's layout (fbgemm's kept after the first call)."""
        if self._mt is not None:
            w, scales, _, n = self._packed
            full = w.transpose(1, 2).reshape(w.size(0) * 16, -1)  # (Np, Kp)
            return full[:n, : self.in_features], scales[:n]
        if self._rows is None:
            q, _ = torch.ops.quantized.linear_unpack(self._packed)
            self._rows = (q.int_repr(), q.q_per_channel_scales().float())
        return self._rows

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        """``max(0, x W^T + b)``, the ReLU inside the product (on its float32 output, so the
        same to the bit as ``relu(self(x))``, one pass over the output fewer)."""
        return self._product(x, relu=True)

    def _product(self, x: torch.Tensor, relu: bool) -> torch.Tensor:
        """The product (its ReLU inside where ``relu``) on this layer's kernel: mt's, or
        fbgemm's (reduced range)."""
        if self._mt is not None:
            return self._mt_product(self._packed, self.bias, relu, x)
        op = _LINEAR_RELU_DYNAMIC if relu else _LINEAR_DYNAMIC
        # subclasses' ``__torch_function__`` off: torch's Python binding asks every argument
        # for that attribute, and the packed weight (a TorchScript object) answers by throwing
        # a C++ exception, caught and turned into Python's AttributeError at every call; on an
        # AMD Zen 3 that was 25-55 us of the 67-120 us of a 32-row, 256-wide product
        with torch._C.DisableTorchFunctionSubclass():
            return op(x, self._packed, True)

    def _mt_product(self, packed: tuple, bias: torch.Tensor | None, relu: bool,
                    x: torch.Tensor) -> torch.Tensor:  # fmt: skip
        weight, scales, comp, n = packed
        return self._mt(x, weight, scales, comp, bias, n, relu)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel, {self.kernel}"


def _mt_kernel(kernel: str) -> tuple[str | None, Callable | None]:
    """The layout and operator of mt's own kernel for ``kernel`` (auto: VNNI, else AVX2), or
    ``(None, None)`` for fbgemm's (asked for, or auto where mt's is not available)."""
    if kernel == "fbgemm":
        return None, None
    for layout in (kernel,) if kernel != "auto" else ("vnni", "avx2"):
        op = native.int8_linear(layout)
        if op is not None:
            return layout, op
        if kernel != "auto":
            missing = "AVX-512 VNNI" if layout == "vnni" else "AVX2"
            raise RuntimeError(f"Int8Linear: mt's int8 kernel ({layout}) is not available here "
                               f"({native.unavailable_reason() or 'no ' + missing})")
    return None, None


def vnni_layout(weight: torch.Tensor, scales: torch.Tensor,
                comp: torch.Tensor | None = None) -> tuple:  # fmt: skip
    """An int8 weight (N, K) and its float32 scales (N,) as ``torch.ops.mt.int8_linear`` takes
    them: ``(w, scale, comp, N)`` with ``w`` (Np/16, Kp/4, 16, 4) the weight padded with zeros
    to Np (a multiple of 32) rows and Kp (of 4) columns, 16 channels by 4 inputs to a 64-byte
    block; ``scale`` padded with ones; ``comp`` (Np,) int32 = 128 x each row's sum (what the
    kernel's unsigned activations, shifted by 128, add to each sum): computed here unless
    given (a shortlist's rows gather theirs from the full weight's)."""
    n, k = weight.shape
    np_, kp = -(-n // 32) * 32, -(-k // 4) * 4
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = weight
    # each 4 inputs as one int32, so the block transpose moves 4-byte words: 10x faster than
    # permuting int8 elements (0.85 ms against 0.08 for a shortlist's 3,300 rows of 256)
    words = padded.view(torch.int32).view(np_ // 16, 16, kp // 4)
    blocks = words.transpose(1, 2).contiguous().view(torch.int8).view(np_ // 16, kp // 4, 16, 4)
    scale = torch.ones(np_)
    scale[:n] = scales
    sums = torch.zeros(np_, dtype=torch.int32)
    sums[:n] = weight.sum(dim=1, dtype=torch.int32).mul_(128) if comp is None else comp
    return blocks, scale, sums, n


def _scaled_product(packed, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic int8 product with a per-tensor weight of scale 1, times ``scales``."""
    with torch._C.DisableTorchFunctionSubclass():
        return _LINEAR_DYNAMIC(x, packed, True).mul_(scales)


class Int8FeedForward(nn.Module):
    """FFN(x) = W2 relu(W1 x + b1) + b2 in int8, the ReLU fused into the first product (for
    decoding; ``ffn`` is an ``mt.model.transformer.FeedForward``)."""

    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        self.w1 = Int8Linear(ffn.w1.weight, ffn.w1.bias)
        self.w2 = Int8Linear(ffn.w2.weight, ffn.w2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        return self.w2(self.w1.relu(x))


def quantize_int8(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """An int8 copy of ``model`` and of its projection, for decoding.

    Args:
        model: an ``mt.model.transformer.Transformer`` (``output_weight``: the projection).

    Returns:
        ``(copy, head)`` in eval mode: the model with every ``nn.Linear`` an
        :class:`Int8Linear` (each feed-forward block an :class:`Int8FeedForward`; the other
        parameters shared with ``model``, not copied) and the
        int8 pre-softmax projection (all ``padded_vocab`` rows); ``model`` is not modified.
    """
    clone = products_copy(model, Int8FeedForward, lambda c: Int8Linear(c.weight, c.bias))
    return clone, Int8Linear(model.output_weight).eval()
