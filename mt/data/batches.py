"""Token-based batches of (source, target) pairs, grouped by length, sharded over ranks.

- ``collate`` turns id arrays into padded tensors: ``src`` = ids + EOS, ``tgt_in`` = BOS + ids,
  ``tgt_out`` = ids + EOS, right-padded with PAD. ``make_src`` builds source tensors the same
  way for search and translation.
- ``BatchSampler`` bounds the padded size of every batch (sentences x longest sequence, source
  and target each) by ``max_tokens``, as the paper's ~25k-token batches. Pairs are sorted by
  source length then target length (alternating direction) with a random tie-break, chunked
  greedily, and the batch order is shuffled; all of it is deterministic from (seed, epoch) and
  identical on every rank. Rank r then takes batches r, r+W, r+2W, ...; when the count does not
  divide W, zero-weight copies of a real batch fill the shortfall (as fairseq does), so every
  rank runs the same number of batches (a rank that runs out first would hang DDP) and every
  pair counts exactly once.
- Corpus weights (:mod:`mt.data.mixing`), shape buckets (:mod:`mt.data.buckets`) and the
  pairs skipped as too long (``num_skipped``, logged): see ``BatchSampler``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mt.data.buckets import Buckets, chunk_by_bucket, derive_buckets
from mt.data.mixing import Mix
from mt.model.masks import RealPositions
from mt.vocab import BOS, EOS, PAD

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Batch:
    """One padded batch. Shape letters: B sentences, S source length, T target length."""

    src: torch.Tensor  # (B, S) ids + EOS, PAD-padded
    tgt_in: torch.Tensor  # (B, T) BOS + ids, PAD-padded
    tgt_out: torch.Tensor  # (B, T) ids + EOS, PAD-padded
    real: RealPositions  # flat indices of the non-pad positions, known on the host
    ntokens: int  # non-pad tokens in tgt_out (what the loss is normalised by)
    weight: float = 1.0  # 0.0 for a filler batch (loss and token count must be multiplied)

    def _map(self, fn) -> Batch:
        """A copy with ``fn`` applied to every tensor (the real positions' too)."""
        real = RealPositions(*(None if t is None else fn(t) for t in self.real))
        return dataclasses.replace(
            self, src=fn(self.src), tgt_in=fn(self.tgt_in), tgt_out=fn(self.tgt_out), real=real
        )

    def to(self, device: torch.device | str) -> Batch:
        """A copy with the tensors on ``device`` (asynchronous from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """A copy with the tensors in page-locked memory, so :meth:`to` a GPU is asynchronous."""
        return self._map(lambda t: t.pin_memory())


def _flatten(seqs: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences one after another, (sum of lengths,) int64, and their (k,) lengths."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]), lengths


def _pad_flat(
    ids: np.ndarray, lengths: np.ndarray, bos: bool, eos: bool, multiple: int = 1,
    width: int | None = None,
) -> np.ndarray:  # fmt: skip
    """(B, L) int64: each sequence (one after another in ``ids``, with their ``lengths``) with
    optional BOS before and EOS after, right-padded to the longest rounded up to a multiple of
    ``multiple``, or to exactly ``width`` (a shape bucket's). One scatter, no loop."""
    needed = -(-(int(lengths.max()) + bos + eos) // multiple) * multiple
    if width is not None and width < int(lengths.max()) + bos + eos:
        raise ValueError(f"a sequence of {int(lengths.max()) + bos + eos} does not fit {width}")
    width = needed if width is None else width
    out = np.full((len(lengths), width), PAD, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths  # where each sequence begins in ids
    cols = np.arange(len(ids)) - np.repeat(starts, lengths) + bos
    out[rows, cols] = ids
    if bos:
        out[:, 0] = BOS
    if eos:
        out[np.arange(len(lengths)), bos + lengths] = EOS
    return out


def _real_rows(lengths: np.ndarray, width: int, one_graph: bool = False) -> torch.Tensor | None:
    """Flat indices of the first ``lengths[b]`` positions of each row of a (B, width) batch;
    None when every position is real, unless ``one_graph`` (then all B*width indices)."""
    real = np.arange(width)[None, :] < lengths[:, None]  # (B, width)
    return None if real.all() and not one_graph else torch.from_numpy(np.flatnonzero(real))


def collate(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_multiple: int = 1, one_graph: bool = False
) -> Batch:
    """Pad a list of (source ids, target ids) pairs (no BOS/EOS in the inputs) into a Batch.

    ``pad_multiple`` rounds both padded lengths up to a multiple (fewer distinct shapes for
    ``torch.compile``, aligned GPU kernels). The real positions are found here, on the host.
    ``one_graph`` (compiled training) gives them as indices also for a side without padding,
    where None would let the model skip its key mask or the selection of the real rows: every
    batch then runs the same code, so ``torch.compile`` makes one graph for all of them, not
    one for each combination of padded sides (each a full compile in the middle of training).

    Example:
        >>> b = collate([(np.array([7, 8]), np.array([9]))])
        >>> b.src.tolist(), b.tgt_in.tolist(), b.tgt_out.tolist()
        ([[7, 8, 3]], [[2, 9]], [[9, 3]])
    """
    if not pairs:
        raise ValueError("collate needs at least one pair")
    srcs, tgts = zip(*pairs)
    return collate_flat(*_flatten(srcs), *_flatten(tgts), pad_multiple, one_graph)


def collate_flat(
    src_ids: np.ndarray, src_lengths: np.ndarray, tgt_ids: np.ndarray, tgt_lengths: np.ndarray,
    pad_multiple: int = 1, one_graph: bool = False, shape: tuple[int, int, int] | None = None,
) -> Batch:  # fmt: skip
    """:func:`collate` of pairs given flat (``TokenArray.gather``): each side's ids one
    sentence after another and its (B,) lengths (no BOS/EOS).

    ``shape`` = (sentences, source width, target width), a shape bucket's
    (``mt.data.buckets``): the tensors are exactly that shape, the rows beyond the pairs empty:
    source ``EOS PAD ...`` (one real key, so attention over it is defined), ``tgt_in``
    ``BOS PAD ...``, ``tgt_out`` all PAD. An empty row has no real target position, so it adds
    nothing to the loss, its gradient or ``ntokens``."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    rows, src_w, tgt_w = (None, None, None) if shape is None else shape
    if rows is not None and rows < len(src_lengths):
        raise ValueError(f"{len(src_lengths)} pairs do not fit a bucket of {rows} sentences")
    src = _pad_flat(src_ids, src_lengths, bos=False, eos=True, multiple=pad_multiple, width=src_w)
    tgt_in = _pad_flat(tgt_ids, tgt_lengths, bos=True, eos=False, multiple=pad_multiple,
                       width=tgt_w)  # fmt: skip
    tgt_out = np.full_like(tgt_in, PAD)  # tgt_in one position left, EOS after each sentence
    tgt_out[:, :-1] = tgt_in[:, 1:]
    tgt_out[np.arange(len(tgt_lengths)), tgt_lengths] = EOS
    src_len, tgt_len = src_lengths + 1, tgt_lengths + 1  # + EOS; + BOS / EOS
    if rows is not None and rows > len(src_lengths):  # the empty rows
        extra = ((0, rows - len(src_lengths)), (0, 0))
        src, tgt_in, tgt_out = (
            np.pad(a, extra, constant_values=PAD) for a in (src, tgt_in, tgt_out)
        )
        src[len(src_lengths) :, 0], tgt_in[len(src_lengths) :, 0] = EOS, BOS
        src_len = np.pad(src_len, extra[0], constant_values=1)
        tgt_len = np.pad(tgt_len, extra[0])
    return Batch(
        src=torch.from_numpy(src),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        real=RealPositions(
            _real_rows(src_len, src.shape[1], one_graph),
            _real_rows(tgt_len, tgt_in.shape[1], one_graph),
        ),
        ntokens=int(tgt_len.sum()),
    )


def make_src(ids_list: Sequence[Sequence[int]]) -> torch.Tensor:
    """Source tensor for search/translation, as in training: (B, S) = ids + EOS, PAD-padded."""
    if not ids_list:
        raise ValueError("make_src needs at least one sentence")
    return torch.from_numpy(_pad_flat(*_flatten(ids_list), bos=False, eos=True))


def _chunk(order: np.ndarray, longest: np.ndarray, max_tokens: int) -> list:
    """Greedy batches of ``order``'s pairs: each batch takes the next pairs while B x longest
    stays <= max_tokens on both sides, found run by run rather than pair by pair.

    ``longest``: max(source, target) padded length of each of ``order``'s pairs. B x longest
    on both sides is B x the running maximum of ``longest``, so only its runs of equal values
    matter: a run of value v in a batch whose maximum becomes M fills it up to max_tokens // M
    pairs; the rest of the run makes batches of max_tokens // v, the last one left open. Every
    pair fits alone (the sampler skips the others)."""
    if len(longest) == 0:
        return []
    starts = np.flatnonzero(np.diff(longest, prepend=-1))
    counts = np.diff(starts, append=len(longest))
    ends, open_n, open_max, pos = [], 0, 0, 0  # batch ends; the open batch's size and maximum
    for v, r in zip(longest[starts].tolist(), counts.tolist()):
        m = max(open_max, v)
        if open_n >= max_tokens // m:  # not one more pair: close the open batch
            ends.append(pos)
            open_n, m = 0, v
        k = min(r, max_tokens // m - open_n)
        pos, r, open_n, open_max = pos + k, r - k, open_n + k, m
        if r:  # the open batch is full; the rest of the run at max_tokens // v a batch
            cap = max_tokens // v
            full = (r - 1) // cap
            ends += range(pos, pos + full * cap + 1, cap)
            pos, open_n, open_max = pos + r, r - full * cap, v
    bounds = [0, *ends, pos]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _sort_keys(src: np.ndarray, snake: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """``np.lexsort((tie, snake, src))`` (src first, then snake, then the unique tie-break) as
    one argsort of a packed int64 key, much faster than lexsort's three passes on millions of
    pairs; lexsort if it would overflow."""
    if len(src) == 0:
        return np.zeros(0, dtype=np.int64)
    s0, t_max, n = int(src.min()), int(np.abs(snake).max()), len(tie)
    if (int(src.max()) - s0 + 1) * (2 * t_max + 1) * n >= 1 << 62:
        return np.lexsort((tie, snake, src))
    key = ((src - s0) * (2 * t_max + 1) + (snake + t_max)) * n + tie
    return np.argsort(key)


class BatchSampler:
    """Deterministic token-based batches for one rank. See the module docstring.

    Args:
        src_lengths: (n,) source lengths in ids, without EOS.
        tgt_lengths: (n,) target lengths in ids, without BOS/EOS.
        max_tokens: bound on B x longest (with EOS/BOS), for source and target each.
        seed: with the epoch, fixes the tie-break and the batch order.
        rank, world_size: this process's shard of the batch list.
        max_len: skip pairs with a side longer than this (ids, without EOS/BOS); pass
            ``model.max_positions - 1``. None: no length limit.
        group: batches per update (ranks x accumulation steps): that many batches adjacent
            in length order stay together when the order is shuffled, so the ranks of one
            update get batches of similar lengths and none waits long for the slowest.
        mix: several corpora at their weights (:class:`mt.data.mixing.Mix`): each epoch
            draws its pairs of each corpus from (seed, epoch) before batching; None: every
            pair once per epoch.
        buckets: K > 0: every batch one of K shapes (:func:`mt.data.buckets.derive_buckets`
            of the kept pairs, widths rounded up to ``multiple``); 0: batches as long as
            their longest pair.
    """

    def __init__(
        self,
        src_lengths: Sequence[int] | np.ndarray,
        tgt_lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        max_len: int | None = None,
        group: int = 1,
        mix: Mix | None = None,
        buckets: int = 0,
        multiple: int = 1,
    ) -> None:
        self.src_len = np.asarray(src_lengths, dtype=np.int64)
        self.tgt_len = np.asarray(tgt_lengths, dtype=np.int64)
        if self.src_len.shape != self.tgt_len.shape:
            raise ValueError(f"{len(self.src_len)} source vs {len(self.tgt_len)} target lengths")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.max_tokens, self.seed = max_tokens, seed
        self.rank, self.world_size, self.max_len = rank, world_size, max_len
        if group < 1:
            raise ValueError(f"group must be positive, got {group}")
        self.group = group
        # A pair's tensors are one longer than its ids (EOS on src/tgt_out, BOS on tgt_in).
        keep = (self.src_len + 1 <= max_tokens) & (self.tgt_len + 1 <= max_tokens)
        if max_len is not None:
            keep &= (self.src_len <= max_len) & (self.tgt_len <= max_len)
        self.indices = np.flatnonzero(keep)
        self.num_skipped = int(len(keep) - len(self.indices))
        if self.num_skipped:
            log.warning(
                "skipping %d of %d pairs: a side longer than max_len=%s or not fitting "
                "max_tokens=%d",
                self.num_skipped,
                len(keep),
                max_len,
                max_tokens,
            )
        if mix is not None and sum(mix.sizes) != len(self.src_len):
            raise ValueError(f"the corpora hold {sum(mix.sizes)} pairs, the lengths {len(keep)}")
        self.mix = None if mix is None or mix.trivial else mix
        self.buckets: Buckets | None = None
        if buckets < 0:
            raise ValueError(f"train.shape_buckets must be >= 0, got {buckets}")
        if buckets and len(self.indices):
            self.buckets = derive_buckets(
                self.src_len[self.indices], self.tgt_len[self.indices], max_tokens, buckets,
                multiple,
            )  # fmt: skip
            log.info("%s", self.buckets.describe())
        self._plan_epoch: int | None = None
        self._plan: tuple[list[np.ndarray], list[float]] = ([], [])

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """All ranks' real batches for ``epoch`` in training order (no fillers, no sharding)."""
        rng = np.random.default_rng([self.seed, epoch])
        idx = self.epoch_pairs(epoch)
        tie = rng.permutation(len(idx))
        every = idx is self.indices and not self.num_skipped  # idx = 0..n-1: no gathers
        src, tgt = (self.src_len, self.tgt_len) if every else (self.src_len[idx], self.tgt_len[idx])
        # Sort by source length, then target length in a "snake": ascending for even source
        # lengths, descending for odd ones, so a batch that straddles two source lengths joins
        # similar target lengths (less target padding than an ascending sort of both).
        snake = np.where(src % 2 == 0, tgt, -tgt)
        sort = _sort_keys(src, snake, tie)
        order = sort if every else idx[sort]
        if self.buckets is not None:
            batches = chunk_by_bucket(order, self.src_len[order], self.tgt_len[order], self.buckets)
        else:
            batches = _chunk(order, np.maximum(src, tgt)[sort] + 1, self.max_tokens)
        if self.group == 1:
            return [batches[i] for i in rng.permutation(len(batches))]
        # Groups of `group` batches adjacent in length, shuffled whole; a short last group goes
        # last, so that every full update is one group (the fillers complete the last).
        G = self.group
        full = len(batches) // G
        order = [g for i in rng.permutation(full) for g in range(i * G, i * G + G)]
        return [batches[i] for i in order] + batches[full * G :]

    def epoch_pairs(self, epoch: int) -> np.ndarray:
        """The pair indices of ``epoch`` (ascending; with a mix, a pair may appear more than
        once or not at all): what its batches hold."""
        if self.mix is None:
            return self.indices
        return self.mix.sample(self.indices, np.random.default_rng([self.seed, epoch, 1]))

    def corpus_counts(self, epoch: int) -> list[int] | None:
        """Pairs of each corpus in ``epoch`` (None without a mix)."""
        if self.mix is None:
            return None
        corpus = self.mix.corpus_of(self.epoch_pairs(epoch))
        return np.bincount(corpus, minlength=len(self.mix.sizes)).tolist()

    def _plan_for(self, epoch: int) -> tuple[list[np.ndarray], list[float]]:
        """This rank's (batches, weights) for ``epoch``, cached for the latest epoch."""
        if self._plan_epoch != epoch:
            batches = self.global_batches(epoch)
            weights = [1.0] * len(batches)
            short = -len(batches) % self.world_size
            if short and batches:
                # Fillers: the cheapest real batch again, weight 0 (the loss ignores it).
                cheapest = min(range(len(batches)), key=lambda i: len(batches[i]))
                batches += [batches[cheapest]] * short
                weights += [0.0] * short
            shard = slice(self.rank, None, self.world_size)
            self._plan = (batches[shard], weights[shard])
            self._plan_epoch = epoch
        return self._plan

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Pair indices of this rank's batches for ``epoch`` (the same count on every rank)."""
        return self._plan_for(epoch)[0]

    def weights(self, epoch: int) -> list[float]:
        """Weights of :meth:`batches` (1.0 real, 0.0 filler)."""
        return self._plan_for(epoch)[1]

    def padding_fraction(self, epoch: int = 0) -> tuple[float, float]:
        """Fraction of padded positions in all real batches of ``epoch``: (source, target)
        (with shape buckets, their widths and empty rows counted)."""
        pads = np.zeros(2)
        total = np.zeros(2)
        for b in self.global_batches(epoch):
            shape = self.shape_of(b)
            for side, lengths in enumerate((self.src_len[b] + 1, self.tgt_len[b] + 1)):
                size = len(b) * lengths.max() if shape is None else shape[0] * shape[1 + side]
                total[side] += size
                pads[side] += size - lengths.sum()
        return tuple(float(x) for x in pads / np.maximum(total, 1))

    def shape_of(self, batch: np.ndarray) -> tuple[int, int, int] | None:
        """The shape bucket's (sentences, source, target) of a batch of pair indices; None
        without buckets."""
        if self.buckets is None:
            return None
        k = int(self.buckets.index(self.src_len[batch], self.tgt_len[batch]).max())
        return self.buckets.shape(k)


def iterate_batches(
    split, sampler: BatchSampler, epoch: int, start: int = 0, pad_multiple: int = 1,
    one_graph: bool = False,
) -> Iterator[Batch]:  # fmt: skip
    """Yield this rank's Batches of ``epoch`` from ``split`` (an EncodedSplit: ``.src``/``.tgt``
    TokenArrays), beginning at batch index ``start`` (exact resume mid-epoch); ``pad_multiple``
    and ``one_graph`` as :func:`collate`'s."""
    batches, weights = sampler.batches(epoch), sampler.weights(epoch)
    for i in range(start, len(batches)):
        idx = np.asarray(batches[i])
        gathered = (*split.src.gather(idx), *split.tgt.gather(idx))
        batch = collate_flat(*gathered, pad_multiple, one_graph, sampler.shape_of(idx))
        batch.weight = weights[i]
        yield batch


def batch_plan(
    batch_tokens: int, max_tokens: int, world_size: int, accum_steps: int = 1
) -> tuple[int, int]:
    """Each rank's ``(max_tokens, accum_steps)`` for a global batch of ``batch_tokens``.

    ``batch_tokens`` (``train.batch_tokens``) is the paper's batch size, "approximately 25000
    source tokens and 25000 target tokens", counted as ``max_tokens`` counts: padded positions
    of the longer side, so an update of ``world_size x accum_steps`` batches holds at most
    ``world_size x accum_steps x max_tokens`` of them (the real target tokens per update are
    fewer by the padding; logged as ``ntokens`` at each update). ``max_tokens`` is then a
    ceiling (what one GPU's memory holds) and the rule is::

        accum_steps = ceil(batch_tokens / (max_tokens x world_size))
        max_tokens  = batch_tokens // (accum_steps x world_size)      (<= the ceiling)

    so 1 GPU and 8 GPUs train with the same global batch (within ``accum_steps x world_size``
    tokens of rounding): ``round()`` of the first ratio alone would give 8 GPUs x 25k = 200k
    where one GPU has 25k. ``batch_tokens`` 0 leaves ``max_tokens`` and ``accum_steps`` as
    given; with ``batch_tokens``, ``accum_steps`` must be left at 1 (a ValueError names the
    settings then, and for a value out of range).

    Example:
        >>> batch_plan(25000, 16384, 1), batch_plan(25000, 16384, 8)
        ((12500, 2), (3125, 1))
    """
    if batch_tokens < 0 or max_tokens < 1 or world_size < 1 or accum_steps < 1:
        raise ValueError(
            f"train.batch_tokens={batch_tokens} must be >= 0, train.max_tokens={max_tokens} and "
            f"train.accum_steps={accum_steps} >= 1 ({world_size} ranks)"
        )
    if batch_tokens == 0:
        return max_tokens, accum_steps
    if accum_steps != 1:
        raise ValueError(
            f"train.batch_tokens={batch_tokens} decides train.accum_steps for any number of "
            f"ranks, but train.accum_steps={accum_steps} was also given: set one of them "
            "(train.batch_tokens=0 to give accum_steps yourself)"
        )
    if batch_tokens < world_size:
        raise ValueError(f"train.batch_tokens={batch_tokens} is fewer than {world_size} ranks")
    accum = -(-batch_tokens // (max_tokens * world_size))  # ceil
    return batch_tokens // (accum * world_size), accum
