"""Batching: exact padded tensors, the max_tokens bound, every pair exactly once per epoch across
ranks (fillers weigh 0), determinism from (seed, epoch), skipping, resume, padding on Multi30k."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from mt.data.batches import Batch, BatchSampler, _pad_flat, collate, iterate_batches, make_src
from mt.data.store import TokenArray
from mt.vocab import BOS, EOS, PAD


class FakeSplit:
    """The two attributes iterate_batches uses, .src and .tgt (TokenArrays), in memory."""

    def __init__(self, src_lengths, tgt_lengths):
        tgt = [np.arange(100, 100 + n) + i for i, n in enumerate(tgt_lengths)]
        self.src = TokenArray.from_sequences([np.arange(10, 10 + n) for n in src_lengths])
        self.tgt = TokenArray.from_sequences(tgt)

    def __len__(self):
        return len(self.src)


def random_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 40, n)
    tgt = np.clip(src + rng.integers(-5, 6, n), 1, None)
    return src, tgt


def test_collate_exact():
    batch = collate([(np.array([7, 8, 9]), np.array([11])), (np.array([5]), np.array([12, 13]))])
    P = PAD
    assert batch.src.tolist() == [[7, 8, 9, EOS], [5, EOS, P, P]]
    assert batch.tgt_in.tolist() == [[BOS, 11, P], [BOS, 12, 13]]
    assert batch.tgt_out.tolist() == [[11, EOS, P], [12, 13, EOS]]
    assert batch.src.dtype == torch.long
    assert batch.ntokens == int((batch.tgt_out != PAD).sum()) == 5
    assert batch.weight == 1.0
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.src, batch.src)
    # the real positions, found on the host: flat indices of the non-pad positions
    assert batch.real.src.tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.real.tgt.tolist() == [0, 1, 3, 4, 5]
    assert torch.equal(batch.real.tgt, (batch.tgt_out != PAD).flatten().nonzero().squeeze(1))
    meta = batch.to("meta")  # every tensor moves, the real positions too
    assert {t.device.type for t in (meta.src, meta.tgt_in, meta.tgt_out, *meta.real)} == {"meta"}
    assert meta.ntokens == 5


def test_one_graph_gives_the_real_positions_of_a_side_without_padding_as_indices():
    """Compiled training's batches (``one_graph``): a side without padding has every position as
    an index instead of None, and the model's loss is the same either way."""
    from mt.model.transformer import build_model
    from mt.schema import ModelConfig
    from mt.train.update import batch_loss

    pairs = [(np.array([7, 8, 9]), np.array([11, 12])), (np.array([5, 6, 4]), np.array([13]))]
    plain, one = collate(pairs), collate(pairs, one_graph=True)
    assert plain.real.src is None and plain.real.tgt.tolist() == [0, 1, 2, 3, 4]
    assert one.real.src.tolist() == list(range(8))  # 2 x (3 + EOS), none padded
    assert torch.equal(one.real.tgt, plain.real.tgt)  # a padded side: the same either way
    for name in ("src", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(one, name), getattr(plain, name))
    both = collate([(np.array([7, 8]), np.array([11, 12]))] * 2, one_graph=True)
    assert both.real.src.tolist() == list(range(6)) and both.real.tgt.tolist() == list(range(6))
    torch.manual_seed(0)
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), 20).eval()
    for group in (pairs, [(np.array([7, 8]), np.array([11, 12]))] * 2):
        want = batch_loss(model, collate(group), 0.1, "fp32")
        got = batch_loss(model, collate(group, one_graph=True), 0.1, "fp32")
        assert got[0].item() == pytest.approx(want[0].item(), rel=1e-6)
        assert got[1].item() == pytest.approx(want[1].item(), rel=1e-6)


def pad_one_at_a_time(seqs, bos: bool, eos: bool, multiple: int) -> np.ndarray:
    """The definition: each sequence written into its row, one after another."""
    width = max(len(s) for s in seqs) + bos + eos
    width = -(-width // multiple) * multiple
    out = np.full((len(seqs), width), PAD, dtype=np.int64)
    for i, seq in enumerate(seqs):
        row = ([BOS] if bos else []) + list(seq) + ([EOS] if eos else [])
        out[i, : len(row)] = row
    return out


@pytest.mark.parametrize("bos,eos", [(False, True), (True, False), (True, True), (False, False)])
@pytest.mark.parametrize("multiple", [1, 8])
def test_padding_in_one_scatter_equals_one_row_at_a_time(bos, eos, multiple):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(4, 100, n) for n in [5, 0, 17, 1, 3, 0, 9]]  # empty ones too
    lengths = np.array([len(s) for s in seqs])
    got = _pad_flat(np.concatenate(seqs), lengths, bos, eos, multiple)
    np.testing.assert_array_equal(got, pad_one_at_a_time(seqs, bos, eos, multiple))


def test_gather_equals_one_sequence_at_a_time():
    """TokenArray.gather (what the loader reads batches with) against indexing one by one:
    any order, repeats, empty sequences, a memory-mapped file."""
    rng = np.random.default_rng(4)
    seqs = [rng.integers(4, 30000, n) for n in rng.integers(0, 12, 200)]
    arrays = TokenArray.from_sequences(seqs)
    for idx in (np.array([5, 3, 3, 199, 0]), rng.permutation(200)[:64], np.array([7])):
        ids, lengths = arrays.gather(idx)
        assert ids.dtype == np.int64 and lengths.tolist() == [len(seqs[i]) for i in idx]
        np.testing.assert_array_equal(ids, np.concatenate([arrays[i] for i in idx]))


def test_the_loader_on_a_prepared_split_equals_collating_pairs(real_data, tmp_path):
    """iterate_batches on a memory-mapped prepared split (Multi30k) gives what collating each
    batch's pairs, read one at a time, gives."""
    from mt.config import load_config
    from mt.data.build import prepare

    cfg = load_config([f"data.dir={real_data / 'multi30k'}", "data.max_train_pairs=3000",
                       f"cache_dir={tmp_path}", "tokenizer.vocab_size=1000"])  # fmt: skip
    split = prepare(cfg).split("train")
    assert isinstance(split.src.ids, np.memmap) and len(split) > 2900
    sampler = BatchSampler(split.src.lengths, split.tgt.lengths, 1024, seed=1)
    assert len(sampler.batches(1)) > 50
    for multiple in (1, 8):
        for n, batch in enumerate(iterate_batches(split, sampler, 1, pad_multiple=multiple)):
            idx = sampler.batches(1)[n]
            ref = collate([(split.src[j], split.tgt[j]) for j in idx], multiple)
            for a, b in zip((batch.src, batch.tgt_in, batch.tgt_out, *batch.real),
                            (ref.src, ref.tgt_in, ref.tgt_out, *ref.real)):  # fmt: skip
                assert (a is None and b is None) or torch.equal(a, b)
            assert batch.ntokens == ref.ntokens


def test_make_src_matches_training_source():
    ids = [[4, 5, 6], [7]]
    assert make_src(ids).tolist() == [[4, 5, 6, EOS], [7, EOS, PAD, PAD]]
    pairs = [(np.array(s), np.array([9])) for s in ids]
    assert torch.equal(make_src(ids), collate(pairs).src)


@pytest.mark.parametrize("max_tokens", [64, 200, 1000])
def test_batches_respect_max_tokens(max_tokens):
    src, tgt = random_lengths(500)
    split = FakeSplit(src, tgt)
    sampler = BatchSampler(src, tgt, max_tokens, seed=3)
    assert sampler.num_skipped == 0  # longest pair is 45 + 1 tokens
    for batch in iterate_batches(split, sampler, epoch=0):
        assert batch.src.numel() <= max_tokens
        assert batch.tgt_in.numel() <= max_tokens and batch.tgt_out.numel() <= max_tokens


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_pair_exactly_once_per_epoch_across_ranks(world_size):
    src, tgt = random_lengths(301, seed=world_size)
    samplers = [
        BatchSampler(src, tgt, 150, seed=7, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    real, fillers, counts = Counter(), 0, set()
    for s in samplers:
        batches, weights = s.batches(epoch=2), s.weights(epoch=2)
        counts.add(len(batches))
        assert len(weights) == len(batches)
        for idx, w in zip(batches, weights):
            assert w in (0.0, 1.0)
            if w == 1.0:
                real.update(idx.tolist())
            else:
                fillers += 1
    assert len(counts) == 1  # every rank runs the same number of batches
    assert real == Counter(range(301))  # each pair once with weight 1
    total = len(samplers[0].global_batches(2))
    assert fillers == -total % world_size
    # the filler weight reaches the Batch objects
    split = FakeSplit(src, tgt)
    weights = [b.weight for s in samplers for b in iterate_batches(split, s, 2)]
    assert weights.count(0.0) == fillers


def test_fillers_exist_when_count_does_not_divide():
    src, tgt = random_lengths(301, seed=5)
    total = len(BatchSampler(src, tgt, 150, seed=7).global_batches(0))
    W = next(w for w in (2, 3, 4, 5) if total % w)
    weights = [w for r in range(W) for w in BatchSampler(src, tgt, 150, 7, r, W).weights(0)]
    assert weights.count(0.0) == W - total % W > 0


def test_deterministic_from_seed_and_epoch():
    src, tgt = random_lengths(400)
    a, b = BatchSampler(src, tgt, 200, seed=1), BatchSampler(src, tgt, 200, seed=1)
    as_lists = lambda s, e: [x.tolist() for x in s.batches(e)]  # noqa: E731
    assert as_lists(a, 0) == as_lists(b, 0)
    assert as_lists(a, 1) == as_lists(b, 1)
    assert as_lists(a, 0) != as_lists(a, 1)  # a new epoch, a new order
    assert as_lists(a, 0) != as_lists(BatchSampler(src, tgt, 200, seed=2), 0)
    assert as_lists(a, 0) == as_lists(b, 0)  # asking for another epoch changed nothing


def test_batches_group_similar_lengths():
    src, tgt = random_lengths(2000)
    sampler = BatchSampler(src, tgt, 400, seed=0)
    for idx in sampler.batches(0):
        assert src[idx].max() - src[idx].min() <= 1
    # Padding measured independently from the collated tensors, vs the sampler's own figure.
    split = FakeSplit(src, tgt)
    pads = total = 0
    for batch in iterate_batches(split, sampler, 0):
        pads += int((batch.tgt_out == PAD).sum())
        total += batch.tgt_out.numel()
    assert sampler.padding_fraction(0)[1] == pytest.approx(pads / total)
    assert pads / total < 0.10


def test_long_pairs_are_skipped_and_counted():
    src = np.array([3, 10, 2, 8, 30, 5])
    tgt = np.array([3, 2, 11, 8, 3, 5])
    sampler = BatchSampler(src, tgt, max_tokens=20, seed=0, max_len=9)
    # Independent rule: a side longer than 9 ids, or a side + EOS/BOS over 20 tokens.
    expected = [i for i in range(6) if src[i] <= 9 and tgt[i] <= 9 and max(src[i], tgt[i]) < 20]
    seen = sorted(int(i) for idx in sampler.batches(0) for i in idx)
    assert seen == expected == [0, 3, 5]
    assert sampler.num_skipped == 3
    only_tokens = BatchSampler(src, tgt, max_tokens=20, seed=0)
    assert only_tokens.num_skipped == 1  # the 30-id source needs 31 tokens


def test_resume_mid_epoch_with_start():
    src, tgt = random_lengths(300)
    split = FakeSplit(src, tgt)
    sampler = BatchSampler(src, tgt, 150, seed=4)
    full = list(iterate_batches(split, sampler, 1))
    tail = list(iterate_batches(split, BatchSampler(src, tgt, 150, seed=4), 1, start=5))
    assert len(tail) == len(full) - 5
    for a, b in zip(full[5:], tail):
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_empty_data_gives_no_batches():
    sampler = BatchSampler([], [], 100, seed=0, rank=1, world_size=2)
    assert sampler.batches(0) == []


@pytest.mark.data
def test_multi30k_padding_under_ten_percent(real_data):
    """Whitespace-word lengths of the real Multi30k train set, at the multi30k preset's
    max_tokens=4096 (subword lengths measured the same way give src 0.8%, tgt 8.5%)."""
    lengths = []
    for lang in ("de", "en"):
        with open(real_data / "multi30k" / f"train.{lang}", encoding="utf-8") as f:
            lengths.append(np.array([len(line.split()) for line in f]))
    sampler = BatchSampler(lengths[0], lengths[1], 4096, seed=1, max_len=1023)
    src_pad, tgt_pad = sampler.padding_fraction(0)
    assert src_pad < 0.10 and tgt_pad < 0.10, (src_pad, tgt_pad)


def test_fast_chunking_is_the_greedy_chunking():
    """The batches are ``order`` cut in sequence; each keeps B x longest <= max_tokens on both
    sides and could not take the next pair too: what extending a batch pair by pair gives."""
    from mt.data.batches import _chunk

    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(1, 400))
        max_tokens = int(rng.integers(60, 600))
        src = rng.integers(2, 60, n)
        tgt = rng.integers(2, 60, n)
        if trial % 2:  # sorted, as the sampler's order is: long runs of one length
            src, tgt = np.sort(rng.integers(2, 12, n)), np.sort(rng.integers(2, 12, n))[::-1]
            max_tokens = int(rng.integers(12, 100))
        order = rng.permutation(n)
        batches = _chunk(order, np.maximum(src, tgt), max_tokens)
        assert np.concatenate(batches).tolist() == order.tolist()
        start = 0
        for batch in batches:
            end = start + len(batch)
            assert len(batch) >= 1
            assert len(batch) * max(src[start:end].max(), tgt[start:end].max()) <= max_tokens
            if end < n:  # one pair more would not fit
                longest = max(src[start : end + 1].max(), tgt[start : end + 1].max())
                assert (len(batch) + 1) * longest > max_tokens
            start = end


def greedy_chunks(order, src_len, tgt_len, max_tokens):
    """The definition, one pair at a time: extend the batch while B x longest <= max_tokens."""
    batches, start, longest = [], 0, 0
    for i, m in enumerate(np.maximum(src_len, tgt_len).tolist()):
        if (i - start + 1) * max(longest, m) > max_tokens:  # close the batch before pair i
            batches.append(order[start:i])
            start, longest = i, 0
        longest = max(longest, m)
    if start < len(order):
        batches.append(order[start:])
    return batches


@pytest.mark.parametrize("world_size,group,skip", [(1, 1, False), (2, 2, True), (3, 3, False)])
def test_the_epoch_plan_equals_its_definition(world_size, group, skip):
    """Each rank's batches of an epoch, as the definition makes them: pairs sorted by
    ``np.lexsort`` (source length, snake target length, a random tie-break), chunked pair by
    pair (:func:`greedy_chunks`), shuffled whole groups of ``group``, fillers of weight 0,
    dealt to the ranks."""

    src, tgt = random_lengths(3000, seed=7)
    max_len, max_tokens, seed = (30 if skip else None), 200, 4
    for epoch in (0, 1):
        rng = np.random.default_rng([seed, epoch])
        idx = np.flatnonzero((src <= max_len) & (tgt <= max_len)) if skip else np.arange(3000)
        tie = rng.permutation(len(idx))
        s, t = src[idx], tgt[idx]
        order = idx[np.lexsort((tie, np.where(s % 2 == 0, t, -t), s))]
        batches = greedy_chunks(order, src[order] + 1, tgt[order] + 1, max_tokens)
        full = len(batches) // group
        batches = [batches[g] for i in rng.permutation(full)
                   for g in range(i * group, (i + 1) * group)] + batches[full * group:]  # fmt: skip
        short = -len(batches) % world_size
        cheapest = min(range(len(batches)), key=lambda i: len(batches[i]))
        weights = [1.0] * len(batches) + [0.0] * short
        batches += [batches[cheapest]] * short
        for rank in range(world_size):
            sampler = BatchSampler(src, tgt, max_tokens, seed=seed, rank=rank,
                                   world_size=world_size, max_len=max_len, group=group)  # fmt: skip
            got = sampler.batches(epoch)
            assert [b.tolist() for b in got] == [b.tolist() for b in batches[rank::world_size]]
            assert sampler.weights(epoch) == weights[rank::world_size]


def test_packed_sort_key_equals_lexsort():
    from mt.data.batches import _sort_keys

    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 2000):
        src = rng.integers(0, 300, n)
        tgt = rng.integers(0, 300, n)
        snake = np.where(src % 2 == 0, tgt, -tgt)
        tie = rng.permutation(n)
        assert _sort_keys(src, snake, tie).tolist() == np.lexsort((tie, snake, src)).tolist()


@pytest.mark.parametrize("world_size,accum", [(2, 1), (3, 1), (2, 2)])
def test_the_batches_of_one_update_have_similar_lengths(world_size, accum):
    """group = ranks x accumulation steps: the batches of one update are neighbours in length
    order (so no rank waits long for the slowest), updates are shuffled, every pair still
    counts exactly once, and one rank with accumulation sees the same updates as several."""
    src, tgt = random_lengths(2000, seed=5)
    G = world_size * accum
    samplers = [BatchSampler(src, tgt, 300, seed=3, rank=r, world_size=world_size, group=G)
                for r in range(world_size)]  # fmt: skip
    every = samplers[0].global_batches(1)
    plain = BatchSampler(src, tgt, 300, seed=3).global_batches(1)
    assert sorted(map(tuple, every)) == sorted(map(tuple, plain))  # the same batches, regrouped
    full = len(every) // G

    def spread(order):  # mean range of the longest source in the batches of one update
        longest = [int(src[b].max()) for b in order]
        return np.mean([np.ptp(longest[k * G : (k + 1) * G]) for k in range(full)])

    assert spread(every) < 0.25 * spread(plain)  # plain: the batches of an update at random
    # rank r's j-th batch of update k is batch k*G + r + W*j of that order
    per_rank = [s.batches(1) for s in samplers]
    for k in range(full):
        for r in range(world_size):
            for j in range(accum):
                assert np.array_equal(per_rank[r][k * accum + j], every[k * G + r + world_size * j])
    one = BatchSampler(src, tgt, 300, seed=3, group=G).global_batches(1)
    assert all(np.array_equal(a, b) for a, b in zip(one, every))  # 1 rank x G accumulation
    assert any(not np.array_equal(a, b) for a, b in zip(every, plain))  # a new order
