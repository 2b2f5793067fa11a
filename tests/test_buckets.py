"""Shape buckets (train.shape_buckets): the cost model's choice against brute force, batches of
the bucket shapes only, every pair once per epoch over the ranks, the token budget kept, pads
masked (the loss of a bucketed batch is the unpadded batch's)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mt.data.batches import BatchSampler, collate, collate_flat
from mt.data.buckets import derive_buckets
from mt.model.transformer import build_model
from mt.schema import ModelConfig
from mt.train.update import batch_loss
from mt.vocab import BOS, EOS, PAD

V = 40


def _epoch_positions(s, t, max_tokens, bounds):
    """Positions (real + pad, both sides) of one epoch under bucket upper bounds ``bounds`` on
    max(src + 1, tgt + 1), counted pair by pair: the definition the programme minimises."""
    m = np.maximum(s + 1, t + 1)
    total, low = 0, 0
    for high in bounds:
        members = (m > low) & (m <= high)
        low = high
        if not members.any():
            continue
        S, T = int((s[members] + 1).max()), int((t[members] + 1).max())
        rows = max_tokens // max(S, T)
        batches = -(-int(members.sum()) // rows)
        total += batches * rows * (S + T)
    return total


def test_the_buckets_minimise_an_epochs_positions_as_brute_force_does():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 50))
        s, t = rng.integers(0, 14, n), rng.integers(0, 14, n)
        max_tokens, k = int(rng.integers(15, 100)), int(rng.integers(1, 5))
        buckets = derive_buckets(s, t, max_tokens, k)
        values = np.unique(np.maximum(s + 1, t + 1))
        brute = min(
            _epoch_positions(s, t, max_tokens, [*cut, values[-1]])
            for c in range(k)
            for cut in itertools.combinations(values[:-1], c)
        )
        assert len(buckets) <= k
        assert _epoch_positions(s, t, max_tokens, buckets.bounds) == brute
        # the widths are the widest member's and the rows fill the budget
        for (rows, S, T), high in zip(buckets.shapes(), buckets.bounds):
            assert max(S, T) == high and rows == max_tokens // high


def test_bucket_widths_round_up_to_the_multiple_and_bad_settings_say_which():
    b = derive_buckets(np.array([3, 9, 20]), np.array([4, 8, 30]), 256, 3, multiple=8)
    assert all(w % 8 == 0 for w in b.src + b.tgt)
    with pytest.raises(ValueError, match="shape_buckets"):
        derive_buckets(np.array([3]), np.array([3]), 64, 0)
    with pytest.raises(ValueError, match="max_tokens=8"):
        derive_buckets(np.array([30]), np.array([3]), 8, 2)
    with pytest.raises(ValueError, match="longer than the longest shape bucket"):
        b.index(np.array([100]), np.array([1]))


def _pairs(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.integers(4, V, s), rng.integers(4, V, t)) for s, t in lengths]


def test_a_bucket_shaped_batch_has_empty_rows_and_the_same_real_tokens():
    pairs = _pairs([(9, 3), (2, 6), (5, 12)])
    plain = collate(pairs)
    srcs, tgts = zip(*pairs)
    flat = (np.concatenate(srcs), np.array([len(x) for x in srcs]),
            np.concatenate(tgts), np.array([len(x) for x in tgts]))  # fmt: skip
    shaped = collate_flat(*flat, shape=(5, 16, 14))
    assert shaped.src.shape == (5, 16) and shaped.tgt_in.shape == (5, 14)
    assert shaped.ntokens == plain.ntokens
    assert shaped.src[3:, 0].tolist() == [EOS, EOS] and not shaped.src[3:, 1:].any()
    assert shaped.tgt_in[3:, 0].tolist() == [BOS, BOS] and (shaped.tgt_out[3:] == PAD).all()
    for name in ("src", "tgt_in", "tgt_out"):
        a, b = getattr(plain, name), getattr(shaped, name)
        assert torch.equal(b[:3, : a.size(1)], a) and not b[:3, a.size(1) :].any()
    real_targets = shaped.tgt_out.flatten()[shaped.real.tgt]
    assert torch.equal(real_targets, plain.tgt_out.flatten()[plain.real.tgt])
    with pytest.raises(ValueError, match="do not fit a bucket of 2"):
        collate_flat(*flat, shape=(2, 16, 14))
    with pytest.raises(ValueError, match="does not fit 8"):
        collate_flat(*flat, shape=(3, 8, 14))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_loss_of_a_bucketed_batch_is_the_unpadded_batchs(precision):
    """Pads masked: the padded columns and the empty rows change neither the loss nor the
    gradient (dropout off)."""
    pairs = _pairs([(9, 3), (2, 6), (5, 12), (1, 1)])
    plain = collate(pairs)
    srcs, tgts = zip(*pairs)
    flat = (np.concatenate(srcs), np.array([len(x) for x in srcs]),
            np.concatenate(tgts), np.array([len(x) for x in tgts]))  # fmt: skip
    shaped = collate_flat(*flat, shape=(7, 12, 16))
    torch.manual_seed(0)
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), V)
    results = []
    for batch in (plain, shaped):
        model.zero_grad()
        loss, nll = batch_loss(model, batch, 0.1, precision)
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in model.parameters()]))
    tol = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    torch.testing.assert_close(results[1][1], results[0][1], **tol)
    for g, r in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(g, r, **tol)


def _lengths(n, seed=1):
    """Sentence lengths of a news-like shape: mostly 10-40, a long tail."""
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(3.0, 0.5, n).astype(np.int64), 1, 120)
    tgt = np.clip((src * rng.uniform(0.8, 1.25, n)).astype(np.int64), 1, 120)
    return src, tgt


@pytest.mark.parametrize("world", [1, 3])
def test_bucketed_batches_come_in_the_bucket_shapes_and_hold_every_pair_once(world):
    src, tgt = _lengths(3000)
    max_tokens = 1024
    plain = BatchSampler(src, tgt, max_tokens, seed=5, world_size=1)
    ranks = [BatchSampler(src, tgt, max_tokens, seed=5, rank=r, world_size=world, group=world,
                          buckets=16) for r in range(world)]  # fmt: skip
    buckets = ranks[0].buckets
    assert buckets is not None and 8 <= len(buckets) <= 16
    shapes = set(buckets.shapes())
    seen = []
    for sampler in ranks:
        assert sampler.buckets == buckets  # every rank makes the same shapes
        assert len(sampler.batches(2)) == len(ranks[0].batches(2))
        for idx, w in zip(sampler.batches(2), sampler.weights(2)):
            shape = sampler.shape_of(idx)
            assert shape in shapes and len(idx) <= shape[0]
            assert (src[idx] + 1 <= shape[1]).all() and (tgt[idx] + 1 <= shape[2]).all()
            if w:
                seen.extend(idx.tolist())
    assert sorted(seen) == list(range(len(src)))  # each pair once per epoch
    # the same plan from the same seed (exact resume, every rank alike)
    again = BatchSampler(src, tgt, max_tokens, seed=5, world_size=world, group=world, buckets=16)
    assert all(np.array_equal(a, b) for a, b in zip(again.batches(2), ranks[0].batches(2)))
    # the padding share the buckets promise is the epoch's (empty rows included)
    pad = ranks[0].padding_fraction(2)
    assert pad == pytest.approx(buckets.padding, abs=1e-12)
    # the cost model keeps it low: a bucket pads both sides to its widest member's, so the
    # shorter side of a pair pays what sorting by both lengths would not (within 6 points)
    assert max(pad) < max(plain.padding_fraction(2)) + 0.06


def test_the_token_budget_per_batch_stays_within_one_sentence_of_max_tokens():
    """The recipe's budget: a batch's padded size rows x max(S, T) is at most max_tokens and
    more than max_tokens - max(S, T) (less than one sentence short); the real target tokens of
    an epoch's batches stay within 10% of the unbucketed batches' on average."""
    src, tgt = _lengths(3000)
    max_tokens = 1024
    sampler = BatchSampler(src, tgt, max_tokens, seed=5, buckets=16)
    for rows, S, T in sampler.buckets.shapes():
        assert max_tokens - max(S, T) < rows * max(S, T) <= max_tokens
    plain = BatchSampler(src, tgt, max_tokens, seed=5)

    def mean_real(s):
        batches = s.batches(0)
        return sum(int((tgt[b] + 1).sum()) for b in batches) / len(batches)

    assert mean_real(sampler) == pytest.approx(mean_real(plain), rel=0.10)
