"""Batch shapes from a small set (``train.shape_buckets``): each batch padded to one of K
(sentences, source length, target length) shapes, chosen from the corpus's length histogram.

Why: batches by tokens bring a new (rows, length) shape almost every update, and a GPU pays for
each new shape on the host (a library's per-shape setup of every product, a new compiled graph
or CUDA graph). With K shapes each is met many times; the price is padding, which the choice of
shapes keeps low.

The cost model. A pair's tensors are ``s = src + 1`` and ``t = tgt + 1`` wide (EOS; BOS/EOS)
and ``m = max(s, t)`` decides how many pairs a batch holds (``B x longest <= max_tokens``, as
:class:`mt.data.batches.BatchSampler` bounds it). Bucket k takes the pairs whose ``m`` falls in
``(bounds[k-1], bounds[k]]``; its source is as wide as the widest source among them, its
target as the widest target (each rounded up to ``multiple``), and it holds
``rows = max_tokens // max(S, T)`` sentences. An epoch of the bucket then takes
``ceil(n / rows)`` batches of ``rows x (S + T)`` positions, the last one completed with empty
rows. That count is exact for one pass over the corpus and depends only on the bucket's own
interval, so the K intervals minimising the sum (every position, real or pad, of an epoch) come
from a dynamic programme over the distinct values of ``m``: O(K U^2) for U distinct lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Buckets:
    """K batch shapes, ascending. ``bounds[k]``: the largest ``m = max(src + 1, tgt + 1)`` of
    bucket k; ``src[k]``/``tgt[k]``: its tensors' widths; ``rows[k]``: its sentences per batch;
    ``padding``: the (source, target) share of padded positions in one epoch of the corpus
    they were made for (empty rows included)."""

    bounds: tuple[int, ...]
    src: tuple[int, ...]
    tgt: tuple[int, ...]
    rows: tuple[int, ...]
    padding: tuple[float, float]

    def __len__(self) -> int:
        return len(self.bounds)

    def index(self, src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
        """The bucket of each pair (lengths in ids, without EOS/BOS)."""
        m = np.maximum(np.asarray(src_len) + 1, np.asarray(tgt_len) + 1)
        k = np.searchsorted(np.asarray(self.bounds), m, side="left")
        if len(k) and int(k.max()) >= len(self.bounds):
            raise ValueError(
                f"a pair {int(m.max())} tokens long is longer than the longest shape bucket "
                f"({self.bounds[-1]}): the buckets were made for another corpus"
            )
        return k

    def shape(self, k: int) -> tuple[int, int, int]:
        """(sentences, source width, target width) of bucket ``k``."""
        return self.rows[k], self.src[k], self.tgt[k]

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every bucket's :meth:`shape`."""
        return [self.shape(k) for k in range(len(self))]

    def describe(self) -> str:
        """One line for the log: the shapes and the padding share."""
        shapes = ", ".join(f"{b}x({s},{t})" for b, s, t in self.shapes())
        return (
            f"{len(self)} shape bucket(s) [sentences x (source, target)]: {shapes}; padding "
            f"{100 * self.padding[0]:.1f}% of source, {100 * self.padding[1]:.1f}% of target "
            "positions per epoch"
        )


def _round_up(x: np.ndarray, multiple: int) -> np.ndarray:
    return -(-x // multiple) * multiple


def derive_buckets(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_tokens: int, k: int, multiple: int = 1
) -> Buckets:
    """The ``k`` shapes that minimise an epoch's positions (real + pad) for these pairs (see the
    module docstring). Lengths in ids, without EOS/BOS; every pair must fit ``max_tokens``.

    Example:
        >>> b = derive_buckets(np.array([3] * 20 + [9] * 20), np.array([4] * 20 + [8] * 20), 40, 2)
        >>> b.shapes()
        [(8, 4, 5), (4, 10, 9)]
    """
    if k < 1:
        raise ValueError(f"train.shape_buckets must be >= 1 to make buckets, got {k}")
    if multiple < 1:
        raise ValueError(f"the width multiple must be >= 1, got {multiple}")
    s = _round_up(np.asarray(src_lengths, dtype=np.int64) + 1, multiple)
    t = _round_up(np.asarray(tgt_lengths, dtype=np.int64) + 1, multiple)
    if len(s) == 0:
        raise ValueError("no pairs to make shape buckets from")
    m = np.maximum(s, t)
    if int(m.max()) > max_tokens:
        raise ValueError(f"a pair of {int(m.max())} positions does not fit max_tokens={max_tokens}")
    values, inverse = np.unique(m, return_inverse=True)
    U = len(values)
    count = np.bincount(inverse, minlength=U)
    s_max = np.zeros(U, dtype=np.int64)
    t_max = np.zeros(U, dtype=np.int64)
    np.maximum.at(s_max, inverse, s)
    np.maximum.at(t_max, inverse, t)
    # cost[i, j]: the positions of an epoch of one bucket over distinct values i..j (j >= i)
    cost = np.full((U, U), np.inf)
    for i in range(U):
        n = np.cumsum(count[i:])
        S = np.maximum.accumulate(s_max[i:])
        T = np.maximum.accumulate(t_max[i:])
        rows = max_tokens // np.maximum(S, T)
        cost[i, i:] = -(-n // rows) * rows * (S + T)
    k = min(k, U)
    # best[j]: the least cost of values 0..j in the buckets so far; cut[c, j]: where the last
    # of c + 1 buckets over 0..j starts
    best = cost[0].copy()
    cut = np.zeros((k, U), dtype=np.int64)
    for c in range(1, k):
        # the last bucket over i..j after c buckets over 0..i-1: best[i-1] + cost[i, j]
        cand = best[:-1, None] + cost[1:, :]  # (U-1, U): row i-1 -> start i
        start = np.argmin(cand, axis=0)  # (U,)
        new = cand[start, np.arange(U)]
        better = new < best
        best = np.where(better, new, best)
        cut[c] = np.where(better, start + 1, -1)  # -1: c buckets do no better than fewer
    # walk back from the last value
    ends, j, c = [], U - 1, k - 1
    while j >= 0:
        while c > 0 and cut[c, j] < 0:
            c -= 1
        i = int(cut[c, j]) if c > 0 else 0
        ends.append((i, j))
        j, c = i - 1, c - 1
    buckets = []  # (bound, source width, target width, rows, batches an epoch) of each
    for i, j in reversed(ends):
        S, T = int(s_max[i : j + 1].max()), int(t_max[i : j + 1].max())
        rows = max_tokens // max(S, T)
        buckets.append((int(values[j]), S, T, rows, -(-int(count[i : j + 1].sum()) // rows)))
    bounds, widths_s, widths_t, rows, batches = zip(*buckets)
    total = [sum(n * b * w for n, b, w in zip(batches, rows, ws)) for ws in (widths_s, widths_t)]
    real = np.array([np.sum(np.asarray(src_lengths) + 1), np.sum(np.asarray(tgt_lengths) + 1)])
    padding = tuple(float(x) for x in 1.0 - real / np.maximum(total, 1))
    return Buckets(bounds, widths_s, widths_t, rows, padding)


def chunk_by_bucket(
    order: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, buckets: Buckets
) -> list[np.ndarray]:
    """``order``'s pairs (lengths of ``order``'s pairs, in ids) in batches of their bucket's
    ``rows``, bucket by bucket, each bucket's pairs in ``order``'s order (the last batch of
    a bucket may hold fewer: collate completes it with empty rows)."""
    k = buckets.index(src_len, tgt_len)
    by_bucket = np.argsort(k, kind="stable")
    order, k = order[by_bucket], k[by_bucket]
    starts = np.searchsorted(k, np.arange(len(buckets) + 1))
    out = []
    for b in range(len(buckets)):
        part, rows = order[starts[b] : starts[b + 1]], buckets.rows[b]
        out.extend(part[i : i + rows] for i in range(0, len(part), rows))
    return out
