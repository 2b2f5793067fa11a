"""Attention masks. One polarity everywhere: boolean, True = "may attend" (the convention of
``torch.nn.functional.scaled_dot_product_attention``).

Shapes broadcast against attention scores of shape (B, H, T_query, T_key).
"""

from __future__ import annotations

import torch

from mt.vocab import PAD


def pad_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Key padding mask: ``mask[b, 0, 0, j] = tokens[b, j] != PAD``.

    Args:
        tokens: (B, S) token ids.

    Returns:
        (B, 1, 1, S) bool, True at real (non-pad) key positions.
    """
    return (tokens != PAD)[:, None, None, :]


def subsequent_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Causal ("subsequent") mask: ``mask[0, 0, i, j] = j <= i`` (position i sees 0..i only).

    Args:
        T: target length.
        device: where to build the mask.

    Returns:
        (1, 1, T, T) bool, lower-triangular including the diagonal.
    """
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
