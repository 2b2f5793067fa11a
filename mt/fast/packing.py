"""The FFN on the real positions only, for the CPU training copy.

A batch padded to its longest sentence spends the FFN's two products on padding too. Its real
positions are known on the host when the batch is made (``mt.data.batches.collate``), so the
:class:`~mt.fast.training.TrainingModel` hands them to :class:`PackedFeedForward` (one
:class:`InFlight` shared by the copy's FFNs) before each forward pass: the FFN then runs on
the (n, D) real rows and writes zeros at the padded ones. Nothing reads those: padded keys are
masked, the causal mask keeps real target queries off the right padding, and the loss scores
real positions only, so the values and gradients at real positions are the model's.

Packing costs a gather and a scatter per FFN; it pays where a batch is well padded (random
lengths: ~23% padding), not on length-sorted batches (Multi30k: ~5%), so a batch is packed
only above :data:`MIN_PADDING`, decided on the host from the counts alone.
"""

from __future__ import annotations

import torch
from torch import nn

from mt.model.masks import RealPositions

MIN_PADDING = 0.10  # pack a side when at least this share of its positions is padding


class InFlight:
    """The real rows of the batch in the forward pass now (None: that side is not packed)."""

    __slots__ = ("src", "tgt")

    def __init__(self) -> None:
        self.src: torch.Tensor | None = None
        self.tgt: torch.Tensor | None = None

    def set(self, src: torch.Tensor, tgt_in: torch.Tensor, real: RealPositions | None) -> None:
        """The rows to pack for ``src`` (B, S) and ``tgt_in`` (B, T): ``real``'s, where the
        side's padding share reaches :data:`MIN_PADDING` (sizes only: no read of the device)."""
        self.src = self.tgt = None
        if real is None:
            return
        if real.src is not None and real.src.numel() <= (1 - MIN_PADDING) * src.numel():
            self.src = real.src
        if real.tgt is not None and real.tgt.numel() <= (1 - MIN_PADDING) * tgt_in.numel():
            self.tgt = real.tgt


class PackedFeedForward(nn.Module):
    """An FFN (``mt.model.transformer.FeedForward``) run on the rows ``in_flight`` names for
    its ``side`` (``src`` in the encoder, ``tgt`` in the decoder), zeros elsewhere."""

    def __init__(self, ffn: nn.Module, in_flight: InFlight, side: str) -> None:
        super().__init__()
        self.ffn, self.in_flight, self.side = ffn, in_flight, side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, L, D)."""
        rows = getattr(self.in_flight, self.side)
        if rows is None:
            return self.ffn(x)
        B, L, D = x.shape
        packed = self.ffn(x.reshape(B * L, D).index_select(0, rows))  # (n, D)
        return x.new_zeros(B * L, packed.size(-1)).index_copy(0, rows, packed).view(B, L, -1)


def pack(model: nn.Module) -> InFlight:
    """Give the encoder and decoder FFNs of ``model`` (in place; pass a copy) the packed form;
    returns the :class:`InFlight` its forward passes read."""
    in_flight = InFlight()
    for side, layers in (("src", model.encoder), ("tgt", model.decoder)):
        for layer in layers:
            layer.ffn = PackedFeedForward(layer.ffn, in_flight, side)
    return in_flight
