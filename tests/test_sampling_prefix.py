"""Sampling (decode=sample) and prefix-constrained search, on stub models with hand-set
probabilities and on a small random-weight Transformer."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from conftest import sharp_random_model
from test_search import A, B, TableModel, random_tables, row, src_of

from mt.config import load_config
from mt.data.batches import make_src
from mt.decode.driver import translate_nbest
from mt.decode.search import Sampling, beam_search, greedy_search, sample
from mt.schema import DecodeConfig
from mt.vocab import EOS, UNK


@pytest.fixture(scope="module")
def real_model():
    return sharp_random_model()


def sources(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]


def test_top_k_never_emits_a_token_outside_the_k_best():
    # After BOS: UNK .4, A .3, B .2, EOS .1. With top_k=2 only UNK and A may come out first.
    table = torch.tensor([row(eos=1.0)] * 6)
    table[2] = torch.tensor(row(unk=0.4, a=0.3, b=0.2, eos=0.1))
    model = TableModel(table)
    seen = collections.Counter()
    for seed in range(200):
        (hyp,) = sample(model, src_of(3), [seed], top_k=2, max_len_a=0, max_len_b=1)
        seen[hyp.tokens[0] if hyp.tokens else EOS] += 1
    assert set(seen) == {UNK, A}  # both of the two best come out; nothing else ever
    # Without top-k every token with probability comes out in 200 draws.
    everything = {sample(model, src_of(3), [s], max_len_a=0, max_len_b=1)[0].tokens[0]
                  if sample(model, src_of(3), [s], max_len_a=0, max_len_b=1)[0].tokens else EOS
                  for s in range(200)}  # fmt: skip
    assert everything == {UNK, A, B, EOS}


def test_sampling_distribution_matches_the_tempered_probabilities():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.12, 0.3, 0.08])  # PAD UNK BOS EOS A B
    lp = probs.clamp(min=1e-30).log()[None]
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7)]:
        s = Sampling([0], temperature, top_k, top_p)
        got = s.distribution(lp)[0]
        expected = probs ** (1 / temperature)
        if top_k:
            expected[expected.argsort(descending=True)[top_k:]] = 0
        if top_p < 1:  # the smallest most-probable set reaching top_p: UNK .5 + A .3
            expected = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.3, 0.0])
        expected = expected / expected.sum()
        assert torch.allclose(got, expected, atol=1e-6), (temperature, top_k, top_p)


def test_sampled_frequencies_follow_the_distribution():
    table = torch.tensor([row(eos=1.0)] * 6)
    table[2] = torch.tensor(row(a=0.7, b=0.3))
    model = TableModel(table)
    n = 600
    draws = sample(model, src_of(*([3] * n)), list(range(n)), max_len_a=0, max_len_b=1)
    share = sum(h.tokens == [A] for h in draws) / n
    assert abs(share - 0.7) < 4 * math.sqrt(0.7 * 0.3 / n)
    assert all(h.logprob == pytest.approx(math.log(0.7 if h.tokens == [A] else 0.3)) for h in draws)


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_temperature_to_zero_is_greedy(temperature):
    model = TableModel(random_tables(11, C=4, P=8))
    src = src_of(3, 5, 2, 7, first=4)
    src[:, 0] = torch.arange(4, 8)  # four different tables
    greedy = greedy_search(model, src, 1.0, 6)
    sampled = sample(model, src, [1, 2, 3, 4], temperature, max_len_a=1.0, max_len_b=6)
    assert [h.tokens for h in sampled] == [h.tokens for h in greedy]
    assert [h.logprob for h in sampled] == pytest.approx([h.logprob for h in greedy], abs=1e-6)


def test_samples_are_reproducible_batched_or_not(real_model):
    ids = sources(0, [5, 9, 3, 12, 7, 4])
    cfg = DecodeConfig(sample=True, seed=3, max_len_a=0.0, max_len_b=8, batch_size=6)
    batched = translate_nbest(real_model, ids, cfg)
    alone = [translate_nbest(real_model, [x], DecodeConfig(**{**cfg.__dict__, "batch_size": 1}),
                             indices=[i])[0] for i, x in enumerate(ids)]  # fmt: skip
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in alone]
    again = translate_nbest(real_model, ids, cfg)
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in again]
    other = translate_nbest(real_model, ids, DecodeConfig(**{**cfg.__dict__, "seed": 4}))
    assert [h[0].tokens for h in other] != [h[0].tokens for h in batched]


def test_decode_sample_group_composes():
    cfg = load_config(["decode=sample", "decode.top_k=5"]).decode
    assert cfg.sample and cfg.beam_size == 1 and cfg.top_k == 5 and cfg.temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        Sampling([0], top_p=0.0)


# ---- prefixes ------------------------------------------------------------------------------


def test_prefix_forces_the_start_and_the_rest_is_searched():
    model = TableModel(random_tables(5, C=2, P=6))
    src = src_of(4, 4, first=4)
    src[1, 0] = 5
    free = beam_search(model, src, 3, 0.0, 0.0, 6, nbest=1)
    prefix = [[B, B], []]  # the second sentence is free
    forced = beam_search(model, src, 3, 0.0, 0.0, 6, nbest=1, prefix=prefix)
    assert forced[0][0].tokens[:2] == [B, B]
    assert forced[1][0].tokens == free[1][0].tokens
    # The forced prefix's own log-probability is part of the score.
    lp = model.logp[0]  # table of sentence 0 (src[0, 0] = 4 -> 4 % 2 = 0)
    start = float(lp[0, 2, B] + lp[1, B, B])
    greedy = greedy_search(model, src[:1], 0.0, 6, prefix=[[B, B]])[0]
    assert greedy.tokens[:2] == [B, B] and greedy.logprob <= start + 1e-6


def test_prefix_of_the_best_output_gives_the_best_output(real_model):
    src = make_src(sources(1, [6, 11, 4]))
    free = beam_search(real_model, src, 4, 0.6, 0.0, 10, nbest=1)
    prefixes = [h[0].tokens[:2] for h in free]
    forced = beam_search(real_model, src, 4, 0.6, 0.0, 10, nbest=1, prefix=prefixes)
    for f, p in zip(forced, prefixes):
        assert f[0].tokens[: len(p)] == p
    # Forcing a different first token changes the output but keeps the forced start.
    other = [[t + 1 if t + 1 < 40 else 4] for t in (p[0] for p in prefixes)]
    changed = beam_search(real_model, src, 4, 0.6, 0.0, 10, nbest=1, prefix=other)
    assert [h[0].tokens[0] for h in changed] == [o[0] for o in other]
