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
    """Key padding mask: ``mask[b, 0, 0, j] = tokens[b, j] != PAD``.

    Args:
        tokens: (B, S) token ids.

    Returns:
        (B, 1, 1, S) bool, True at real (non-pad) key positions.
    """
    return (tokens != PAD)[:, None, None, :]


def subsequent_mask(
    T: int, device: torch.device | str | None = None, past: int = 0
) -> torch.Tensor:
    """Causal ("subsequent") mask: ``mask[0, 0, i, j] = j <= past + i``.

    Query i is the target position ``past + i``: it sees the ``past`` cached positions and the
    new ones up to itself (``past = 0``: the usual lower-triangular mask).

    Args:
        T: new target positions (queries).
        device: where to build the mask.
        past: positions decoded before these (incremental decoding).

    Returns:
        (1, 1, T, past + T) bool.
    """
    return torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)[None, None]
