"""oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile``
picks on a CPU) for float32 and bfloat16 products on a CPU.

``nn.Linear`` runs on MKL's sgemm, which leaves much of an AMD CPU's float32 peak unused;
oneDNN reaches far more of it there (docs/performance.md). Every product here accumulates in
float32; only the order of the sums differs from ``F.linear``.

- :func:`linear` / :class:`Linear`: ``F.linear`` for training, with the forward product and the
  input gradient ``dx = dy W`` on oneDNN (the weight gradient ``dW = dy^T x`` stays on
  ``torch.mm``, as fast there).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


def _own_generator() -> torch.Generator:
    """A generator for the checks' inputs: they run once per process at whatever moment first
    needs them (before training, or at the first validation), and drawing from torch's global
    generator there shifted every dropout mask after it: the same run then trained differently
    with and without a warm probe cache."""
    return torch.Generator().manual_seed(0)


@cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear kernel and it agrees with ``F.linear`` here."""
    if not torch.backends.mkldnn.is_available():
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return False
    try:
        g = _own_generator()
        x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 16), (8, 16), (8,)))
        y = op(x, w, b, "relu", [], "")
        return bool(torch.allclose(y, torch.relu(F.linear(x, w, b)), atol=1e-5))
    except RuntimeError:  # a build whose oneDNN lacks the op's kernels
        return False


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to one of few sizes: a multiple of 8, or of 1/16 of the row count's
    power of two (at most 6.25% added rows, 16 sizes per doubling).

    oneDNN builds (and keeps) a kernel per input shape. Batches of varying length give the
    products a new row count at almost every call, and the process then grows with every new
    shape, without end. Padded to these sizes the kernels are reused and memory stays flat.
    """
    step = max(8, 1 << max(0, rows.bit_length() - 5))
    return -(-rows // step) * step


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


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias, attr: str) -> torch.Tensor:
    """oneDNN's ``act(x W^T + b)`` over the rows of ``x`` (..., in), bucketed."""
    return _on_bucketed_rows(
        x, lambda x2: torch.ops.mkldnn._linear_pointwise(x2, weight, bias, attr, [], "")
    )


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _pointwise(x, weight, bias, "none")


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
