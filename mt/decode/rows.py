"""The rows of a search: each live hypothesis' tokens and score, and the model state rows
(encoder output, decoder cache) that hold it.

A batch of n live sentences has K hypotheses each, in n*K consecutive rows (sentence i: rows
``i*K .. i*K+K-1``). The decoder state holds ``width`` rows per sentence: 1 at the first step
(the K hypotheses are all ``BOS`` then, so one row each is decoded and its candidates cover
them all), K after. The encoder state holds one row per sentence.
"""

from __future__ import annotations

from typing import Any

import torch

from mt.vocab import BOS


class Rows:
    """The live hypotheses of a batch ``src`` (B, S), K per sentence, and ``model``'s state
    (see the module docstring).

    Attributes:
        sents: the sentence (index into ``src``) of each live group of K rows.
        scores: (n, K) summed log-probabilities (-inf: no hypothesis).
        tokens: (n*K, t+1) ``BOS y_1 .. y_t`` of each hypothesis.
        last: (n*width, 1) the decoder input of the next step.
        enc, cache: the model's encoder state (n rows) and decoder cache (n*width rows).
    """

    def __init__(self, model: Any, src: torch.Tensor, K: int) -> None:
        n, device = src.size(0), src.device
        self.K, self.width = K, 1
        self.enc, self.cache = model.encode(src), model.new_cache()
        self.sents = list(range(n))
        self.scores = torch.full((n, K), float("-inf"), device=device)
        self.scores[:, 0] = 0.0  # one start per sentence, so the first step has no duplicates
        self.tokens = torch.full((n * K, 1), BOS, dtype=torch.long, device=device)
        self.last = self.tokens[:n]

    def hyp(self, i: int, k: int) -> torch.Tensor:
        """The tokens (t+1,) of live sentence i's hypothesis k."""
        return self.tokens[i * self.K + k]

    def drop(self, keep: list[int]) -> None:
        """Keep only the live sentences ``keep`` (indices into ``sents``, ascending). The last
        ones kept take the places of the dropped ones (:func:`fill_from_the_end`), so the
        decoder state moves only their rows, in place, instead of being copied whole."""
        keep = fill_from_the_end(keep)
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        self.sents = [self.sents[i] for i in keep]
        self.scores = self.scores[keep_t]
        self.tokens = self.tokens[_group_rows(keep_t, self.K)]
        if self.sents:
            state_rows = _group_rows(keep_t, self.width)
            self.enc = self.enc.select(keep_t)
            self.cache = compact(self.cache, state_rows, keep_t)
            self.last = self.last[state_rows]

    def advance(self, beam: torch.Tensor, token: torch.Tensor, score: torch.Tensor) -> None:
        """The new hypotheses: (n, K) parent hypothesis, new token and score of each.

        The decoder state follows: at the first step each sentence's one row becomes K rows;
        after, each new hypothesis takes a row of its sentence (see :func:`rows_for`), so only
        the rows whose hypothesis has a new parent are copied.
        """
        n, K = beam.shape
        parent = None  # K == 1 (greedy, sampling): each hypothesis its own parent, in its row
        if K > 1:
            base = torch.arange(n, device=beam.device)[:, None] * K
            if self.width == K:
                order = rows_for(beam).argsort(dim=1)  # (n, K): the hypothesis in row k
                beam, token, score = (t.gather(1, order) for t in (beam, token, score))
                parent = (base + beam).view(-1)
                moved = (beam != torch.arange(K, device=beam.device)).view(-1).nonzero()[:, 0]
                if moved.numel():
                    self.cache.copy_rows(moved, parent[moved])
            else:  # the first step: K rows per sentence from now on
                parent = (base + beam).view(-1)
                one_per_sentence = torch.arange(n, device=beam.device).repeat_interleave(K)
                self.cache = self.cache.select(one_per_sentence)
                self.width = K
        self.last = token.reshape(-1, 1)
        kept = self.tokens if parent is None else self.tokens[parent]
        self.tokens = torch.cat([kept, self.last], dim=1)
        self.scores = score


def rows_for(beam: torch.Tensor) -> torch.Tensor:
    """The row (within its sentence) each new hypothesis takes, copying the fewest caches:
    from ``beam`` (n, K), the parent hypothesis (row) of each, a permutation of 0..K-1 per
    sentence where a parent's first child takes the parent's row and the other children take,
    in order, the rows whose hypotheses have no child."""
    n, K = beam.shape
    rows = torch.arange(K, device=beam.device)
    same = beam[:, :, None] == beam[:, None, :]  # (n, K, K): hypotheses j, j' share a parent
    earlier = torch.ones(K, K, dtype=torch.bool, device=beam.device).tril(-1)  # j' < j
    first = ~(same & earlier).any(dim=2)  # (n, K): no earlier sibling
    childless = ~(beam[:, :, None] == rows).any(dim=1)  # (n, K): row k has no child
    free = torch.argsort((~childless).to(torch.int8), dim=1, stable=True)  # childless first
    rank = ((~first).cumsum(dim=1) - 1).clamp(min=0)  # among the later siblings
    return torch.where(first, beam, free.gather(1, rank))


def fill_from_the_end(keep: list[int]) -> list[int]:
    """An order of the kept indices ``keep`` (ascending) in which each one below ``len(keep)``
    stays in its place and those beyond take, in turn, the places of the dropped ones.

    >>> fill_from_the_end([0, 2, 3, 5, 6])  # 1 and 4 dropped: 5 takes place 1, 6 place 4
    [0, 5, 2, 3, 6]
    """
    n, kept = len(keep), set(keep)
    out = list(range(n))
    holes = (place for place in range(n) if place not in kept)
    for place, i in zip(holes, (i for i in keep if i >= n)):
        out[place] = i
    return out


def compact(cache: Any, rows: torch.Tensor, sents: torch.Tensor) -> Any:
    """``cache.select(rows, sents)``, through ``cache.compact`` where the cache has it (it
    moves only the rows that change place, in place; ``mt.model.kv_cache``)."""
    if hasattr(cache, "compact"):
        return cache.compact(rows, sents)
    return cache.select(rows, sents)


def _group_rows(groups: torch.Tensor, width: int) -> torch.Tensor:
    """Flat row indices of the given sentences, ``width`` consecutive rows each."""
    return (groups[:, None] * width + torch.arange(width, device=groups.device)).view(-1)
