"""int8 decoding: every ``nn.Linear`` and the tied pre-softmax projection as dynamically
quantized int8 products (weights int8 per output channel, symmetric; activations quantized per
call from their observed range; int32 accumulation, float32 output), on fbgemm's kernels
(``quantized::linear_dynamic``, VNNI where the CPU has it). Embeddings, LayerNorm, softmax and
attention stay float32.

The products are ATen's own operators, called directly (:class:`Int8Linear`). They were reached
through ``torch.ao.quantization.quantize_dynamic`` before, the first part of torch's quantization
to be deprecated (its notice: "will be removed in 2.10"; still present in 2.13) in favour of the
separate torchao package; :class:`Int8Linear` computes what that path computed, to the bit
(``tests/test_search.py``), without it. Its quantized weight tensor (``quantize_per_channel``)
is deprecated too, "in a future release", with no date. The core operators that are not
deprecated are no substitute on a CPU without VNNI: on a 2-core AMD Zen 3 at 32 rows x 512 ->
2048, fbgemm's product took 285 us, ``torch._weight_int8pack_mm`` (int8 weights, float
activations) 40,434 us, ``torch._int_mm`` 35,290 us and oneDNN's ``qlinear_pointwise`` (with the
activations quantized in torch) 801 us against fbgemm's 447 in a second run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from mt.fast.modules import replace_modules, shared_copy
from mt.model.transformer import FeedForward

_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default
_LINEAR_RELU_DYNAMIC = torch.ops.quantized.linear_relu_dynamic.default


class Int8Linear(nn.Module):
    """``x W^T + b`` for float32 ``x``, with ``W`` held as int8 per output channel.

    The weight's scales are those of torch's per-channel symmetric weight observer (the
    largest magnitude of each row over 127.5, at least float32's eps; zero points 0); each
    call quantizes ``x`` per tensor from its range (fbgemm's reduced range, 7 bits) and
    accumulates in int32. Not trainable; the float32 weight is not kept.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        largest = torch.maximum(-w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0))
        scale = torch.clamp(largest / 127.5, min=torch.finfo(torch.float32).eps)
        zero = torch.zeros(w.size(0), dtype=torch.int64)
        b = None if bias is None else bias.detach().float()
        self.bias = b
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # for subset()
        with warnings.catch_warnings():  # quantized tensors' own deprecation notice (below)
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) float32 -> (..., out) float32."""
        return self._product(_LINEAR_DYNAMIC, x)

    def subset(self, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product over output rows ``ids`` only (a vocabulary shortlist's columns of the
        projection): the same int8 weights and per-row scales, so the full product's columns
        up to float rounding. Packed per call as one per-tensor int8 matrix with the scales
        applied to the output: fbgemm packs a per-channel weight channel by channel (7.8 ms
        for 2,000 rows of 256 on an AMD Zen 4, against 1.1 ms per tensor)."""
        if self.bias is not None:
            raise ValueError("a subset of an Int8Linear with a bias is not supported")
        if self._rows is None:  # the int8 weight and scales, unpacked once
            q, _ = torch.ops.quantized.linear_unpack(self._packed)
            self._rows = (q.int_repr(), q.q_per_channel_scales().float())
        weight, scales = self._rows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch._make_per_tensor_quantized_tensor(weight.index_select(0, ids), 1.0, 0)
            packed = torch.ops.quantized.linear_prepack(q, None)
        return partial(_scaled_product, packed, scales.index_select(0, ids))

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        """``max(0, x W^T + b)``, the ReLU inside fbgemm's product (on its float32 output, so
        the same to the bit as ``relu(self(x))``, one pass over the output fewer)."""
        return self._product(_LINEAR_RELU_DYNAMIC, x)

    def _product(self, op, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's ``op`` (reduced range), called with subclasses' ``__torch_function__`` off:
        torch's Python binding asks every argument for that attribute, and the packed weight
        (a TorchScript object) answers by throwing a C++ exception, caught and turned into
        Python's AttributeError at every call; on an AMD Zen 3 that was 25-55 us of the
        67-120 us of a 32-row, 256-wide product."""
        with torch._C.DisableTorchFunctionSubclass():
            return op(x, self._packed, True)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel"


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
    def rule(child: nn.Module) -> nn.Module | None:
        if isinstance(child, FeedForward):
            return Int8FeedForward(child)
        return Int8Linear(child.weight, child.bias) if type(child) is nn.Linear else None

    clone = shared_copy(model)
    replace_modules(clone, rule)
    return clone.eval(), Int8Linear(model.output_weight).eval()
