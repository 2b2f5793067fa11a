"""Greedy and beam search against stub models with hand-set probabilities, and a real model.

Every expected value here is computed independently of mt.decode.search: by hand (the worked
example),
or by enumerating the whole output space with the length penalty written out again.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import pytest
import torch
from conftest import assert_same_nbest, sharp_random_model
from torch import nn

from mt.decode.driver import fit_to_model as clip_to_length
from mt.decode.driver import make_batches, translate_ids, translate_nbest
from mt.decode.search import Beam, beam_search, generate, greedy_search
from mt.schema import DecodeConfig
from mt.vocab import BOS, EOS, PAD, UNK

A, B = 4, 5  # two ordinary tokens of the stub vocabulary
V = 6  # PAD UNK BOS EOS A B


class StubEnc(NamedTuple):
    memory: torch.Tensor  # (B, S, 1)
    src_mask: torch.Tensor  # (B, 1, 1, S)
    cond: torch.Tensor  # (B,) which table each sentence uses

    def select(self, sents: torch.Tensor) -> StubEnc:
        return StubEnc(*(x.index_select(0, sents) for x in self))


class StubCache(dict):
    """The stub's incremental state: the length decoded and a per-row record of the inputs
    (checks that the search keeps rows aligned), with the row operations of the contract."""

    def select(self, rows: torch.Tensor, sents: torch.Tensor | None = None) -> StubCache:
        return StubCache({k: v.index_select(0, rows) if torch.is_tensor(v) else v
                          for k, v in self.items()})  # fmt: skip

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self["inputs"][dst] = self["inputs"][src]


class TableModel(nn.Module):
    """p(y_t | y_{t-1}, t, sentence) from a table of probabilities (C, P, V, V).

    The table is chosen per sentence by ``src[:, 0] % C`` (so batching mistakes show), indexed by
    the decoder position (clamped to P - 1) and the previous token. Counts decoder calls and
    the rows they decode.
    """

    max_positions = None

    def __init__(self, probs: torch.Tensor):
        super().__init__()
        if probs.dim() == 2:
            probs = probs[None, None]
        elif probs.dim() == 3:
            probs = probs[None]
        self.register_buffer("logp", probs.double().log())
        self.calls = self.rows = 0

    def encode(self, src: torch.Tensor) -> StubEnc:
        cond = src[:, 0] % self.logp.size(0)
        return StubEnc(src.float()[..., None], (src != PAD)[:, None, None, :], cond)

    def new_cache(self) -> StubCache:
        return StubCache()

    def decode(self, tgt_in, enc: StubEnc, cache=None):
        self.calls += 1
        self.rows += tgt_in.size(0)
        start = cache.get("len", 0) if cache is not None else 0
        T = tgt_in.size(1)
        pos = (start + torch.arange(T)).clamp(max=self.logp.size(1) - 1)  # (T,)
        cond = enc.cond.repeat_interleave(tgt_in.size(0) // enc.cond.size(0))  # G rows a sentence
        logits = self.logp[cond[:, None], pos[None, :], tgt_in]  # (B, T, V)
        if cache is not None:
            cache["len"] = start + T
            # A per-row record of the inputs so far: checks that reorder keeps rows aligned.
            prev = cache.get("inputs", torch.zeros(tgt_in.size(0), 0, dtype=torch.long))
            cache["inputs"] = torch.cat([prev, tgt_in], dim=1)
        return logits.float()


def row(**p: float) -> list[float]:
    """A probability row over the stub vocabulary from keyword probabilities."""
    names = {"unk": UNK, "eos": EOS, "a": A, "b": B}
    out = [0.0] * V
    for name, value in p.items():
        out[names[name]] = value
    return out


def src_of(*lengths: int, first: int = 4) -> torch.Tensor:
    """Sources of the given lengths (ids + EOS, PAD-padded); first token = ``first``."""
    S = max(lengths) + 1
    src = torch.full((len(lengths), S), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = 7 if n else PAD
        if n:
            src[i, 0] = first
        src[i, n] = EOS
    return src


def lp(n: int, alpha: float) -> float:
    """The length penalty |Y| ** alpha, written again (independent of mt.decode.search)."""
    return n**alpha


# ---- the worked example ---------------------------------------------------------------------
# From BOS: A .6, B .4.  After A: A .35, B .34, EOS .31.  After B: EOS .9, A .05, B .05.
# Greedy follows A forever. Beam 2, step 1: B-EOS .36 (rank 0: finished), AA .21, AB .204,
# A-EOS .186 (rank 3 >= K: NOT finished). Step 2: AB-EOS .1836 (rank 0: finished) -> 2 finished.
WORKED = torch.tensor(
    [
        row(eos=1.0),  # PAD (never the previous token of a live hypothesis)
        row(eos=1.0),  # UNK
        row(a=0.6, b=0.4),  # BOS
        row(eos=1.0),  # EOS
        row(a=0.35, b=0.34, eos=0.31),  # A
        row(eos=0.9, a=0.05, b=0.05),  # B
    ]
)


def test_beam_worked_example_exact_result_and_scores():
    model = TableModel(WORKED)
    (hyps,) = beam_search(model, src_of(3), beam_size=2, alpha=0.6, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[B], [A, B]]
    assert hyps[0].score == pytest.approx(math.log(0.4 * 0.9) / 2**0.6, abs=1e-6)
    assert hyps[1].score == pytest.approx(math.log(0.6 * 0.34 * 0.9) / 3**0.6, abs=1e-6)
    # A-EOS (score log(.186)/lp(2) = -1.11) ranked 4th at its step, so it never finished.
    assert [A] not in [h.tokens for h in hyps]


def test_greedy_worked_example_follows_the_local_best():
    model = TableModel(WORKED)
    (hyp,) = greedy_search(model, src_of(3), max_len_a=0, max_len_b=4)
    assert hyp.tokens == [A, A, A, A]  # never EOS: finalised at the maximum length
    assert hyp.score == pytest.approx(math.log(0.6) + 3 * math.log(0.35), abs=1e-6)


def random_tables(seed: int, C: int = 1, P: int = 4, allowed=(UNK, EOS, A, B)) -> torch.Tensor:
    """Random probability tables (C, P, V, V) with zero mass on PAD and BOS."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(C, P, V, V, generator=g) ** 3 + 0.01
    mask = torch.zeros(V)
    mask[list(allowed)] = 1
    probs = probs * mask
    return probs / probs.sum(-1, keepdim=True)


def exhaustive(probs: torch.Tensor, max_len: int, alpha: float) -> list[tuple[float, list[int]]]:
    """Every output with |Y| <= max_len (EOS counted), scored sum log p / lp; best first."""
    p = probs[0].double()  # (P, V, V)
    P = p.size(0)
    words = [UNK, A, B]
    results = []
    for n in range(max_len + 1):
        for ys in itertools.product(words, repeat=n):
            logprob, prev = 0.0, BOS
            for t, y in enumerate(ys):
                logprob += math.log(p[min(t, P - 1), prev, y])
                prev = y
            if n < max_len:  # ends with EOS: |Y| = n + 1
                total = logprob + math.log(p[min(n, P - 1), prev, EOS])
                results.append((total / lp(n + 1, alpha), list(ys)))
            else:  # reached the limit without EOS: |Y| = n
                results.append((logprob / lp(n, alpha), list(ys)))
    return sorted(results, key=lambda r: -r[0])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_width_beam_equals_exhaustive_search(alpha, seed):
    probs = random_tables(seed)
    max_len = 3
    expected = exhaustive(probs, max_len, alpha)  # 1 + 3 + 9 ending in EOS, 27 at the limit
    K = len(expected)
    model = TableModel(probs)
    (hyps,) = beam_search(model, src_of(2), K, alpha, max_len_a=0, max_len_b=max_len, nbest=K)
    assert hyps[0].tokens == expected[0][1]
    assert hyps[0].score == pytest.approx(expected[0][0], abs=1e-5)
    # The whole n-best list is the whole space, sorted.
    assert [h.score for h in hyps] == pytest.approx([e[0] for e in expected], abs=1e-5)
    assert sorted(map(tuple, (h.tokens for h in hyps))) == sorted(tuple(e[1]) for e in expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_one_equals_greedy_on_stub(alpha):
    probs = random_tables(7, C=3, P=6)
    model = TableModel(probs)
    src = torch.nn.utils.rnn.pad_sequence(
        [s for n, f in [(3, 0), (9, 1), (1, 2), (6, 4)] for s in src_of(n, first=f)],
        batch_first=True,
        padding_value=PAD,
    )
    greedy = greedy_search(model, src, 0.5, 3, alpha=alpha)
    beam = beam_search(model, src, 1, alpha, 0.5, 3)
    for g, (b,) in zip(greedy, beam):
        assert g.tokens == b.tokens
        assert g.score == pytest.approx(b.score, abs=1e-6)


def test_eos_ends_the_hypothesis_and_the_search():
    table = torch.tensor(
        [
            row(eos=1.0),
            row(eos=1.0),
            row(a=0.9, b=0.1),
            row(eos=1.0),
            row(eos=0.99, a=0.01),
            row(eos=1.0),
        ]
    )
    model = TableModel(table)
    (hyp,) = greedy_search(model, src_of(5), max_len_b=50)
    assert hyp.tokens == [A]
    assert model.calls == 2  # BOS -> A, A -> EOS; nothing after
    model.calls = 0
    (hyps,) = beam_search(model, src_of(5), beam_size=2, alpha=0.6, max_len_b=50, nbest=2)
    assert [h.tokens for h in hyps] == [[A], [B]]
    assert EOS not in hyps[0].tokens and BOS not in hyps[0].tokens
    assert model.calls == 2


def test_length_limit_is_respected_per_sentence():
    table = torch.tensor([row(a=0.5, b=0.5)] * V)  # EOS impossible
    model = TableModel(table)
    lengths = [2, 5, 0]
    src = src_of(*lengths)
    expected = [int(1.5 * n + 2) for n in lengths]  # |Y| <= a * src_len + b, src_len w/o EOS
    assert [len(h.tokens) for h in greedy_search(model, src, 1.5, 2)] == expected
    for hyps, n in zip(beam_search(model, src, 3, 0.6, 1.5, 2, nbest=3), expected):
        assert [len(h.tokens) for h in hyps] == [n] * 3


def test_min_len_suppresses_eos():
    table = torch.tensor([row(eos=0.8, a=0.1, b=0.1)] * V)
    model = TableModel(table)
    (hyp,) = greedy_search(model, src_of(4), max_len_b=20, min_len=3)
    assert len(hyp.tokens) == 3
    for (h,) in beam_search(model, src_of(4, 2), 4, 0.6, max_len_b=20, min_len=5):
        assert len(h.tokens) == 5


def test_nbest_sorted_and_bounded():
    model = TableModel(random_tables(3, P=6))
    for hyps in beam_search(model, src_of(4, 7, 1), 5, 0.6, 1.0, 4, nbest=5):
        scores = [h.score for h in hyps]
        assert 1 <= len(hyps) <= 5
        assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError):
        beam_search(model, src_of(4), 2, 0.6, nbest=3)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("K,nbest", [(2, 1), (4, 1), (5, 2)])
def test_settled_sentences_end_sooner_with_the_same_nbest(alpha, K, nbest):
    """A sentence stops once no live hypothesis can enter its n-best list: against the search
    that runs on to K finished hypotheses, the same n-best lists, scores bit for bit, in fewer
    decoder rows where a length penalty does not keep the bound open."""
    model = TableModel(random_tables(5, C=6, P=8, allowed=(EOS, A, B)))
    src = torch.nn.utils.rnn.pad_sequence(
        [src_of(n, first=f)[0] for n, f in [(9, 0), (3, 1), (14, 2), (6, 3), (11, 4), (1, 5)]],
        batch_first=True, padding_value=PAD,
    )  # fmt: skip
    runs = {}
    for settle in (False, True):
        model.rows = 0
        hyps = generate(model, src, Beam(K), 1.0, 8, nbest, alpha=alpha, settle=settle)
        runs[settle] = (model.rows, hyps)
    (full_rows, full), (settled_rows, settled) = runs[False], runs[True]
    assert [[(h.tokens, h.score) for h in x] for x in settled] == [
        [(h.tokens, h.score) for h in x] for x in full
    ]
    assert settled_rows <= full_rows
    if alpha == 0.0:
        assert settled_rows < full_rows


def test_stub_batched_equals_one_by_one():
    model = TableModel(random_tables(11, C=4, P=8))
    specs = [(12, 0), (1, 1), (5, 2), (30, 3), (0, 1), (8, 0)]
    src = torch.nn.utils.rnn.pad_sequence(
        [src_of(n, first=f)[0] for n, f in specs], batch_first=True, padding_value=PAD
    )
    batched = beam_search(model, src, 3, 0.6, 0.3, 3, nbest=3)
    for i, (n, f) in enumerate(specs):
        alone = beam_search(model, src_of(n, first=f), 3, 0.6, 0.3, 3, nbest=3)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[i]], abs=1e-6)


def test_make_batches_covers_every_sentence_within_limits():
    lengths = [5, 1, 30, 7, 7, 0, 12, 3, 3, 3]
    batches = make_batches(lengths, batch_size=3, max_tokens=40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * (max(lengths[i] for i in b) + 1) <= 40


def test_clip_to_length_names_the_line_or_truncates():
    ids = [[5] * 3, [5] * 10, [5] * 2]
    with pytest.raises(ValueError, match="line 12 "):
        clip_to_length(ids, limit=8, policy="error", first_line=11)
    assert [len(x) for x in clip_to_length(ids, limit=8, policy="truncate")] == [3, 7, 2]


# ---- a real (random-weight) Transformer ----------------------------------------------------


@pytest.fixture(scope="module")
def real_model():
    return sharp_random_model(vocab_size=40)


def random_sources(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]


def test_real_model_beam_one_equals_greedy(real_model):
    pytest.importorskip("mt.data.batches")
    from mt.data.batches import make_src

    src = make_src(random_sources(0, [3, 17, 8, 1]))
    greedy = greedy_search(real_model, src, 1.0, 6, alpha=0.6)
    beam = beam_search(real_model, src, 1, 0.6, 1.0, 6)
    for g, (b,) in zip(greedy, beam):
        assert g.tokens == b.tokens
        assert g.score == pytest.approx(b.score, abs=1e-4)


def test_real_model_batched_equals_one_by_one(real_model):
    pytest.importorskip("mt.data.batches")
    ids = random_sources(1, [2, 40, 7, 25, 1, 13, 3, 9])
    cfg = DecodeConfig(beam_size=4, alpha=0.6, max_len_a=0.5, max_len_b=6, nbest=4, batch_size=64)
    batched = translate_nbest(real_model, ids, cfg)
    lengths = [len(h[0].tokens) for h in batched]
    assert min(lengths) < 3 and max(lengths) > 12  # early EOS and long outputs in one batch
    alone_cfg = DecodeConfig(**{**cfg.__dict__, "batch_size": 1})
    alone = translate_nbest(real_model, ids, alone_cfg)
    for a, b in zip(alone, batched):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
        gap = a[0].score - a[1].score if len(a) > 1 else 1.0
        if gap > 1e-3:  # same output except at near-ties
            assert a[0].tokens == b[0].tokens
    # translate_ids restores input order whatever the batching
    small = DecodeConfig(**{**cfg.__dict__, "batch_size": 2, "max_tokens": 30})
    assert translate_ids(real_model, ids, small) == [h[0].tokens for h in alone]


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_real_model_settled_search_equals_the_full_one(real_model, alpha):
    pytest.importorskip("mt.data.batches")
    from mt.data.batches import make_src

    src = make_src(random_sources(2, [2, 40, 7, 25, 1, 13, 3, 9, 18, 5]))
    full = generate(real_model, src, Beam(5), 0.5, 6, 2, alpha=alpha, settle=False)
    settled = generate(real_model, src, Beam(5), 0.5, 6, 2, alpha=alpha)
    assert_same_nbest(full, settled)  # (other batch sizes: float sums in another order)


def test_real_model_bf16_autocast_runs(real_model):
    pytest.importorskip("mt.data.batches")
    ids = random_sources(2, [5, 9])
    cfg = DecodeConfig(beam_size=2, max_len_a=0, max_len_b=4, precision="bf16")
    out = translate_ids(real_model, ids, cfg, min_len=4)
    assert [len(o) for o in out] == [4, 4]


def test_translate_ids_truncates_sources_beyond_max_positions(real_model, caplog):
    pytest.importorskip("mt.data.batches")
    ids = random_sources(4, [200, 3])  # the model covers 128 positions
    cfg = DecodeConfig(beam_size=2, max_len_a=0, max_len_b=3)
    out = translate_ids(real_model, ids, cfg)
    assert len(out) == 2 and "truncated" in caplog.text
    assert out[0] == translate_ids(real_model, [ids[0][:127]], cfg)[0]


class PlainCache:
    """The real model's cache handled the plainest way: encoder-decoder keys/values recomputed
    from expanded encoder rows at every step, every row move a full reorder."""

    def __init__(self, inner):
        self.inner = inner

    def select(self, rows, sents=None):
        return PlainCache(self.inner.select(rows))

    def copy_rows(self, dst, src):
        index = torch.arange(self.inner.layers[0].self_attn.k.size(0))
        index[dst] = src
        self.inner = self.inner.select(index)


class ContractOnly(nn.Module):
    """The real model seen through the contract only, without its shared encoder rows: the
    encoder output is expanded to one row per decoder row at every step (as before the K beams
    of a sentence shared its encoder row)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.max_positions = model.max_positions

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self):
        return PlainCache(self.model.new_cache())

    def decode(self, tgt_in, enc, cache):
        from mt.model.kv_cache import CrossAttentionCache

        G = tgt_in.size(0) // enc.memory.size(0)
        expanded = enc.select(torch.arange(enc.memory.size(0)).repeat_interleave(G))
        for layer in cache.inner.layers:
            layer.cross_attn = CrossAttentionCache()
        return self.model.decode(tgt_in, expanded, cache.inner)


def test_real_model_shared_encoder_rows_equal_contract_path(real_model):
    pytest.importorskip("mt.data.batches")
    from mt.data.batches import make_src

    src = make_src(random_sources(5, [2, 30, 7, 18, 1, 11]))
    fast = beam_search(real_model, src, 3, 0.6, 0.5, 6, nbest=3)
    plain = beam_search(ContractOnly(real_model), src, 3, 0.6, 0.5, 6, nbest=3)
    assert_same_nbest(fast, plain)


@pytest.mark.parametrize("setting", [{"precision": "bf16"}])
def test_real_model_fast_settings_mostly_agree_with_fp32(real_model, setting):
    pytest.importorskip("mt.data.batches")
    ids = random_sources(6, [4, 9, 13, 6, 20, 3, 11, 8, 15, 7, 5, 12])
    cfg = DecodeConfig(beam_size=4, max_len_a=0.5, max_len_b=5, batch_size=6)
    ref = translate_ids(real_model, ids, cfg)
    out = translate_ids(real_model, ids, DecodeConfig(**{**cfg.__dict__, **setting}))
    same = sum(a == b for a, b in zip(ref, out))
    assert same > len(ids) // 2, (same, setting)  # a tiny random model: near-ties abound


def test_rows_for_moves_only_the_beams_whose_parent_changed():
    from mt.decode.rows import rows_for as _rows_for

    g = torch.Generator().manual_seed(0)
    for K in (1, 2, 4, 5):
        beam = torch.randint(0, K, (200, K), generator=g)  # parents of the K new hypotheses
        rows = _rows_for(beam)
        for parents, taken in zip(beam.tolist(), rows.tolist()):
            assert sorted(taken) == list(range(K))  # each row taken once
            seen = set()
            for parent, row in zip(parents, taken):
                if parent not in seen:  # a parent's first child stays in its row
                    assert row == parent
                seen.add(parent)
            moved = sum(p != r for p, r in zip(parents, taken))
            assert moved == K - len(set(parents))  # the fewest copies
    assert _rows_for(torch.tensor([[0, 0, 2, 0]])).tolist() == [[0, 1, 2, 3]]
    assert _rows_for(torch.tensor([[3, 1, 3, 3]])).tolist() == [[3, 1, 0, 2]]


def test_copy_rows_equals_reorder(real_model):
    pytest.importorskip("mt.data.batches")
    from mt.data.batches import make_src

    src = make_src(random_sources(6, [5, 3]))
    enc, cache = real_model.encode(src), real_model.new_cache()
    for _ in range(4):  # fill 4 positions of the self-attention caches, 3 rows per sentence
        real_model.decode(torch.randint(4, 40, (6, 1)), enc, cache)
    dst, src_rows = torch.tensor([1, 2, 5]), torch.tensor([0, 0, 3])
    index = torch.arange(6)
    index[dst] = src_rows
    expected = cache.select(index)
    cache.copy_rows(dst, src_rows)
    for got, want in zip(cache.layers, expected.layers):
        for a, b in zip(got.self_attn.filled(), want.self_attn.filled()):
            assert a.size(2) == 4 and torch.equal(a, b)


def test_dropped_sentences_places_are_filled_from_the_end():
    from mt.decode.rows import fill_from_the_end

    assert fill_from_the_end([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]
    assert fill_from_the_end([0, 1, 2]) == [0, 1, 2]  # nothing dropped below the end
    assert fill_from_the_end([3, 4]) == [3, 4] and fill_from_the_end([]) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        keep = sorted(torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,)))].tolist())
        order = fill_from_the_end(keep)
        assert sorted(order) == keep  # the same sentences
        for place, i in enumerate(order):  # each stays, or comes from beyond the new end
            assert i == place or i >= len(keep)


def test_compacting_a_cache_gives_what_select_gives_moving_only_the_filled_places(real_model):
    pytest.importorskip("mt.data.batches")
    from mt.data.batches import make_src
    from mt.decode.rows import _group_rows, fill_from_the_end

    with torch.no_grad():  # as search runs: buffers without autograd
        src = make_src(random_sources(7, [5, 3, 6, 2, 4]))  # 5 sentences, 2 rows each
        enc = real_model.encode(src)
        index = torch.arange(5).repeat_interleave(2)
        cache = real_model.new_cache()
        real_model.decode(torch.randint(4, 40, (5, 1)), enc, cache)
        cache = cache.select(index)  # 2 rows per sentence from the second step
        for _ in range(3):
            real_model.decode(torch.randint(4, 40, (10, 1)), enc, cache)  # 2 rows a sentence
        sents = torch.tensor(fill_from_the_end([0, 2, 3, 4]))  # sentence 1 dropped: 4 takes place 1
        assert sents.tolist() == [0, 4, 2, 3]
        rows = _group_rows(sents, 2)
        expected = cache.select(rows, sents)
        buffers = [layer.self_attn.k.data_ptr() for layer in cache.layers]
        got = cache.compact(rows, sents)
        for layer, want, ptr in zip(got.layers, expected.layers, buffers):
            assert layer.self_attn.k.data_ptr() == ptr  # the same buffers, cut to 8 rows
            for a, b in zip(layer.self_attn.filled(), want.self_attn.filled()):
                assert a.shape == b.shape and a.shape[::2] == (8, 4) and torch.equal(a, b)
            got_cross, want_cross = layer.cross_attn, want.cross_attn
            for a, b in zip((got_cross.k, got_cross.v), (want_cross.k, want_cross.v)):
                assert a.size(0) == 4 and torch.equal(a, b)
        # any other order is a plain select: nothing is overwritten before it is read
        other = torch.tensor([1, 0, 2])
        kept = got.layers[0].self_attn.filled()[0].clone()
        moved = got.compact(_group_rows(other, 2), other)
        assert torch.equal(moved.layers[0].self_attn.filled()[0], kept[_group_rows(other, 2)])


def test_row_max_is_torchs_max_first_occurrence_and_nan_included():
    """Greedy's per-row maximum (NumPy's argmax on a CPU) gives what ``torch.max`` gives: the
    value and the index of its first occurrence, a row of -inf and a NaN included, and on a
    non-contiguous view."""
    from mt.decode.strategies import row_max

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (9, 40), generator=g).float()  # many ties
    x[1] = float("-inf")
    x[2, 7] = float("nan")
    x[3, [4, 30]] = 9.0
    for block in (x, x[:, ::2], x.t().contiguous().t()):
        values, index = row_max(block)
        ref_values, ref_index = block.max(dim=-1)
        assert torch.equal(index, ref_index) and index.dtype == torch.long
        assert torch.allclose(values, ref_values, equal_nan=True)
    assert row_max(x)[1][3] == 4


def test_row_topk_is_torchs_topk():
    """Beam search's per-row top-k (through block maxima on a CPU) gives torch's values exactly
    and indices holding them: rows of -inf, a row all -inf but for a few, many ties, a tail of
    columns after the last whole block, non-contiguous input, and short rows (torch's own)."""
    from mt.decode.strategies import BLOCK, row_topk

    g = torch.Generator().manual_seed(0)
    for n, m, k in ((6, 40 * BLOCK, 10), (5, 40 * BLOCK + 37, 10), (3, 20 * BLOCK, 2), (4, 50, 3)):
        x = torch.randn(n, m, generator=g)
        x[0] = float("-inf")
        x[1] = float("-inf")
        x[1, [3, m - 1, m // 2]] = torch.tensor([1.0, 2.0, 0.5])  # the last column in the tail
        x[2] = torch.randint(0, 4, (m,), generator=g).float()  # ties everywhere
        for block in (x, x.t().contiguous().t()):
            values, index = row_topk(block, k)
            ref_values, _ = block.topk(k, dim=1)
            assert torch.equal(values, ref_values)
            assert torch.equal(block.gather(1, index), values) and index.dtype == torch.long
            finite = torch.isfinite(values)
            for row in range(n):  # distinct columns for the real candidates
                assert len(set(index[row][finite[row]].tolist())) == int(finite[row].sum())
    x = torch.randn(2, 40 * BLOCK, generator=g)
    assert torch.equal(row_topk(x, 10)[1], x.topk(10, dim=1).indices)  # no ties: the same
