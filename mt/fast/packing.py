"""The position-wise products on the real positions only, for the CPU training copy.

A batch padded to its longest sentence spends every position-wise product (the FFN's two, the
attention's projections) on padding too. Its real positions are known on the host when the
batch is made (``mt.data.batches.collate``), so the ``TrainingModel`` hands them to the copy's
:class:`Packed` modules (one :class:`InFlight` shared by all) before each forward pass: each
product then runs on the (n, D) real rows and writes zeros at the padded ones. Nothing reads
those (padded keys are masked, the causal mask keeps real queries off the right padding, the loss
scores real positions only), so the values and gradients at real positions are the model's.

Packing costs a gather and a scatter per product; it pays on well-padded batches (random
lengths), not on length-sorted ones, so a side is packed only above :data:`MIN_PADDING`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mt.model.masks import RealPositions

MIN_PADDING = 0.10  # pack a side when at least this share of its positions is padding


class InFlight:
    """The rows of the batch in the forward pass now that the packed products run on, and
    its other rows, per side (None: that side is not packed).

    ``bucket``: the row counts the products pad their input to (``mt.fast.onednn.bucket_rows``),
    or None. Given, the real rows are joined by as many padded ones as reach such a count, so
    that the products run without a pad (a copy) of their own; a padded row's value is read by
    nothing and its gradient is zero, so the real rows' values and gradients are the same.
    """

    __slots__ = ("src", "tgt", "src_pad", "tgt_pad", "bucket")

    def __init__(self, bucket: Callable[[int], int] | None = None) -> None:
        self.src: torch.Tensor | None = None
        self.tgt: torch.Tensor | None = None
        self.src_pad: torch.Tensor | None = None
        self.tgt_pad: torch.Tensor | None = None
        self.bucket = bucket

    def set(self, src: torch.Tensor, tgt_in: torch.Tensor, real: RealPositions | None) -> None:
        """The rows to pack for ``src`` (B, S) and ``tgt_in`` (B, T): ``real``'s, where the
        side's padding share reaches :data:`MIN_PADDING` (sizes only: no read of the device),
        and the other rows of that side (the padding, which the packed products fill with
        zeros)."""
        self.src = self.tgt = self.src_pad = self.tgt_pad = None
        if real is None:
            return
        if real.src is not None and real.src.numel() <= (1 - MIN_PADDING) * src.numel():
            self.src, self.src_pad = self._split(real.src, src.numel())
        if real.tgt is not None and real.tgt.numel() <= (1 - MIN_PADDING) * tgt_in.numel():
            self.tgt, self.tgt_pad = self._split(real.tgt, tgt_in.numel())

    def _split(self, real: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows the products run on, the others) of a side of ``n`` positions."""
        others = _others(real, n)
        if self.bucket is None:
            return real, others
        extra = min(self.bucket(real.numel()) - real.numel(), others.numel())
        if extra <= 0:
            return real, others
        return torch.cat((real, others[:extra])), others[extra:]


def _others(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The indices below ``n`` that ``rows`` does not hold, increasing."""
    keep = torch.ones(n, dtype=torch.bool, device=rows.device)
    keep[rows] = False
    return keep.nonzero().squeeze(1)


class Packed(nn.Module):
    """A position-wise module (an FFN, an attention projection: ``(..., in) -> (..., out)``)
    run on the rows ``in_flight`` names for its ``side`` (``src`` or ``tgt``), zeros
    elsewhere."""

    def __init__(self, module: nn.Module, in_flight: InFlight, side: str) -> None:
        super().__init__()
        self.module, self.in_flight, self.side = module, in_flight, side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, in) -> (B, L, out)."""
        rows = getattr(self.in_flight, self.side)
        if rows is None:
            return self.module(x)
        B, L, D = x.shape
        packed = self.module(x.reshape(B * L, D).index_select(0, rows))  # (n, out)
        # the product's dtype, as unpacked; zeros written at the padded rows only, the real
        # ones copied in place (a zero-filled tensor and an out-of-place copy wrote all rows
        # twice more)
        out = packed.new_empty(B * L, packed.size(-1))
        out.index_fill_(0, getattr(self.in_flight, f"{self.side}_pad"), 0.0)
        return out.index_copy_(0, rows, packed).view(B, L, -1)


def pack(model: nn.Module, bucket: Callable[[int], int] | None = None) -> InFlight:
    """Give the FFNs and attention projections of ``model`` (in place; pass a copy) the packed
    form; returns the :class:`InFlight` its passes read. The cross-attention's queries and
    output are on the target side, its keys and values on the source side."""
    in_flight = InFlight(bucket)
    for side, layers in (("src", model.encoder), ("tgt", model.decoder)):
        for layer in layers:
            layer.ffn = Packed(layer.ffn, in_flight, side)
            attn = layer.self_attn
            attn.qkv = Packed(attn.qkv, in_flight, side)
            attn.out = Packed(attn.out, in_flight, side)
            cross = getattr(layer, "cross_attn", None)
            if cross is not None:
                cross.q = Packed(cross.q, in_flight, "tgt")
                cross.kv = Packed(cross.kv, in_flight, "src")
                cross.out = Packed(cross.out, in_flight, "tgt")
    return in_flight
