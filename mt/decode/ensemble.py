"""An ensemble of models that share a vocabulary, searched as one model.

At each step the ensemble's score of a token is the average of its members' log-probabilities,
``s(v) = (1/M) * sum_m log p_m(v | y_<t, x)``; search normalises it again (``log_softmax``),
so an ensemble of one model, or of M copies of one model, gives that model's distribution.
Each member keeps its own encoder output and decoder cache; the row operations of search apply
to all of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt.decode.rows import compact


class EnsembleEncoded(tuple):
    """The members' encoder outputs, one per member."""

    def select(self, sents: torch.Tensor) -> EnsembleEncoded:
        return EnsembleEncoded(enc.select(sents) for enc in self)


class EnsembleCache:
    """The members' decoder caches, moved together."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def select(self, rows: torch.Tensor, sents: torch.Tensor | None = None) -> EnsembleCache:
        return EnsembleCache([c.select(rows, sents) for c in self.caches])

    def compact(self, rows: torch.Tensor, sents: torch.Tensor) -> EnsembleCache:
        return EnsembleCache([compact(c, rows, sents) for c in self.caches])

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for c in self.caches:
            c.copy_rows(dst, src)


class Ensemble(nn.Module):
    """Several models over one vocabulary (ValueError otherwise) behind the search contract
    (``mt.decode.search.IncrementalDecoder``)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        sizes = {int(m.vocab_size) for m in members}
        if len(sizes) > 1:
            raise ValueError(f"ensemble members have different vocabulary sizes: {sorted(sizes)}")
        self.members = nn.ModuleList(members)
        self.vocab_size: int = sizes.pop()
        limits = [m.max_positions for m in members if m.max_positions is not None]
        self.max_positions: int | None = min(limits) if limits else None

    def encode(self, src: torch.Tensor) -> EnsembleEncoded:
        """(B, S) source ids -> every member's encoder output."""
        return EnsembleEncoded(m.encode(src) for m in self.members)

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([m.new_cache() for m in self.members])

    def decode(
        self,
        tgt_in: torch.Tensor,
        enc: EnsembleEncoded,
        cache: EnsembleCache | None = None,
        vocab: Any = None,
    ) -> torch.Tensor:
        """(B, T) target ids -> (B, T, V) averaged log-probabilities (used as logits); with
        ``vocab`` (a shortlist), over its C columns."""
        states = [None] * len(self.members) if cache is None else cache.caches
        shortlist = {} if vocab is None else {"vocab": vocab}  # stub members take no vocab
        lprobs = [F.log_softmax(m.decode(tgt_in, e, c, **shortlist).float(), dim=-1)
                  for m, e, c in zip(self.members, enc, states)]  # fmt: skip
        return sum(lprobs) / len(self.members)
