"""Attention masks. One polarity everywhere: boolean, True = "may attend" (the convention of
``torch.nn.functional.scaled_dot_product_attention``).

Shapes broadcast against attention scores of shape (B, H, T_query, T_key).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mt.vocab import PAD


class RealPositions(NamedTuple):
    """The real (non-pad) positions of a padded (source, target) batch as flat row-major
    indices, computed on the host when the batch is made (``mt.data.batches.collate``): selecting
    them on a GPU then needs no read of the device (a boolean mask or ``nonzero`` would wait).

    ``src`` (n_src,) indexes the B*S source positions, ``tgt`` (n_tgt,) the B*T target positions
    (``tgt_in`` and ``tgt_out`` have the same real positions). None: that side has no padding.
    """

    src: torch.Tensor | None
    tgt: torch.Tensor | None


def pad_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Key padding mask of tokens (B, S): (B, 1, 1, S) bool, ``mask[b, 0, 0, j] = tokens[b, j]
    != PAD``."""
    return (tokens != PAD)[:, None, None, :]


def subsequent_mask(
    T: int, device: torch.device | str | None = None, past: int = 0
) -> torch.Tensor:
    """Causal ("subsequent") mask of T new queries after ``past`` decoded positions: (1, 1, T,
    past + T) bool, ``mask[0, 0, i, j] = j <= past + i`` (``past = 0``: lower-triangular)."""
    return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]
