"""Masks: exact small matrices, True = may attend."""

from __future__ import annotations

import torch

from mt.model.masks import pad_mask, subsequent_mask
from mt.vocab import PAD


def test_pad_mask_exact():
    tokens = torch.tensor([[5, 6, 3, PAD], [7, 3, PAD, PAD]])
    expected = torch.tensor([[True, True, True, False], [True, True, False, False]])
    mask = pad_mask(tokens)
    assert mask.shape == (2, 1, 1, 4)
    assert mask.dtype == torch.bool
    assert torch.equal(mask[:, 0, 0], expected)


def test_subsequent_mask_exact():
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    mask = subsequent_mask(4)
    assert mask.shape == (1, 1, 4, 4)
    assert mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)


def test_masks_combine_by_broadcasting():
    tokens = torch.tensor([[5, 6, PAD]])
    combined = pad_mask(tokens) & subsequent_mask(3)  # (1, 1, 3, 3)
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    assert torch.equal(combined[0, 0], expected)
