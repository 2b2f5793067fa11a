"""oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile``
picks on a CPU) for float32 and bfloat16 products on a CPU.

``nn.Linear`` runs on MKL's sgemm, which leaves much of an AMD CPU's float32 peak unused;
oneDNN reaches far more of it there (docs/performance.md). :func:`linear` / :class:`Linear` is
``F.linear`` for training with the forward product and the input gradient ``dx = dy W`` on
oneDNN (the weight gradient ``dW = dy^T x`` stays on ``torch.mm``, as fast there); every product
accumulates in float32, only the order of the sums differs from ``F.linear``.
"""

from __future__ import annotations

import logging
import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear kernel and it agrees with ``F.linear`` here."""
    if not torch.backends.mkldnn.is_available():
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return False
    try:
        # Not torch's global generator: this check runs at whatever moment first needs it (before
        # training, or at the first validation), and drawing from that one there shifted every
        # dropout mask after it, so a run trained differently with and without a warm probe cache
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 16), (8, 16), (8,)))
        y = op(x, w, b, "relu", [], "")
        return bool(torch.allclose(y, torch.relu(F.linear(x, w, b)), atol=1e-5))
    except RuntimeError:  # a build whose oneDNN lacks the op's kernels
        return False


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 8, or of 1/16 of its power of two (at most 6.25%
    added rows, 16 sizes per doubling): oneDNN builds and keeps a kernel per input shape, and
    batches of varying length would give the products a new row count at almost every call."""
    step = max(8, 1 << max(0, rows.bit_length() - 5))
    return -(-rows // step) * step


def bucket_count(low: int, high: int) -> int:
    """How many row counts :func:`bucket_rows` pads ``low..high`` rows to (both included)."""
    count, rows = 0, bucket_rows(max(1, low))
    while rows <= high:
        count += 1
        rows = bucket_rows(rows + 1)
    return count


PASSES = 3  # kernels per product shape and row count: forward, input gradient, weight gradient
KERNEL_MARGIN = 1.25  # batches shorter than half of max_tokens (an epoch's last ones), decoding
# A built bfloat16 kernel holds ~0.66 MB on a Zen 4, 1-2 MB on an AMX Xeon (the records
# kernel-cache-cpu-zen4-2026-12.md, train-cpu-xeon-amx-2026-12.md): 768 of them bound the
# caches to 0.5-1.5 GB whatever the model.
MAX_TRAINING_KERNELS = 768


def layer_product_shapes(d_model: int, d_ff: int) -> int:
    """How many distinct weight shapes a Transformer layer's products have."""
    return len({(3 * d_model, d_model), (2 * d_model, d_model), (d_model, d_model),
                (d_ff, d_model), (d_model, d_ff)})  # fmt: skip


def training_kernels(layer_shapes: int, max_rows: int, block_rows: int) -> int:
    """The kernel cache a training step on oneDNN needs so that no batch rebuilds a kernel,
    clamped to ``[16, MAX_TRAINING_KERNELS]``. A batch of up to ``max_rows`` tokens fills more
    than half of them (token batching), so its rows land in one doubling's 16 buckets; the
    loss's projection runs in blocks of ``block_rows`` and a last block of any bucketed count
    below. The margin covers shorter batches and validation's products, evicted first (LRU).
    """
    layer_buckets = bucket_count(max_rows // 2 + 1, max_rows)
    projection_buckets = bucket_count(1, min(block_rows, max_rows))
    needed = PASSES * (layer_shapes * layer_buckets + projection_buckets)
    return max(16, min(MAX_TRAINING_KERNELS, math.ceil(needed * KERNEL_MARGIN)))


def size_kernel_cache(
    max_rows: int, d_model: int, d_ff: int, vocab: int, device: torch.device | str = "cpu"
) -> int | None:
    """Size this process's oneDNN kernel caches for training (:func:`training_kernels`; a user's
    own setting stands) before its first product, so the precision probe times the kernels
    under the cache the run has. Returns the capacity in effect (None off a CPU)."""
    if torch.device(device).type != "cpu":
        return None
    from mt.allocator import size_onednn_kernels
    from mt.fast.loss import projected_block_rows

    block = projected_block_rows(vocab, "cpu", bucket_rows)
    wanted = training_kernels(layer_product_shapes(d_model, d_ff), max_rows, block)
    capacity = size_onednn_kernels(wanted)
    if capacity not in _SIZED:
        _SIZED.add(capacity)
        log.info("oneDNN kernel cache: %d kernels%s (%d needed at %d rows, d_model %d, "
                 "d_ff %d, V %d)", capacity, "" if capacity == wanted else " (the user's)",
                 wanted, max_rows, d_model, d_ff, vocab)  # fmt: skip
    return capacity


_SIZED: set[int] = set()  # capacities logged already


def _on_bucketed_rows(x: torch.Tensor, product) -> torch.Tensor:
    """``product`` (a (rows, in) -> (rows, out) map) over the rows of ``x`` (..., in), padded
    with zero rows to :func:`bucket_rows` (sliced off after)."""
    lead, k = x.shape[:-1], x.size(-1)
    x2 = x.reshape(-1, k)
    rows = x2.size(0)
    padded = bucket_rows(rows)
    if padded != rows:
        x2 = F.pad(x2, (0, 0, 0, padded - rows))
    y = product(x2)
    return y[:rows].reshape(*lead, y.size(-1))


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's ``x W^T + b`` over the rows of ``x`` (..., in), bucketed."""
    return _on_bucketed_rows(
        x, lambda x2: torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    )


class _OneDNNLinearFunction(torch.autograd.Function):
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
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return _product(x, weight, bias)


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` over the rows of ``x`` padded with zeros to :func:`bucket_rows` (sliced off
    after): for products that torch itself hands to oneDNN (bfloat16 under CPU autocast), so
    that they, their input gradient and their weight gradient meet few row counts."""
    return _on_bucketed_rows(x, lambda x2: F.linear(x2, weight, bias))


class Linear(nn.Module):
    """An ``nn.Linear``'s own parameters (shared, not copied) through :func:`linear`."""

    product = staticmethod(linear)
    kind = "oneDNN"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, bias={self.bias is not None}, {self.kind}"


class BucketedLinear(Linear):
    """An ``nn.Linear``'s own parameters (shared, not copied) through :func:`bucketed_linear`."""

    product = staticmethod(bucketed_linear)
    kind = "rows bucketed"
