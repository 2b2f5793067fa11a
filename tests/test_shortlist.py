"""The vocabulary shortlist: IBM model 1 against a plain loop-by-loop EM, the batch's candidate
pieces, and search over them against the full model with every other logit at -inf."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import sharp_random_model
from torch import nn

from mt.data.batches import make_src
from mt.data.store import TokenArray
from mt.decode.driver import translate_ids, translate_nbest
from mt.decode.ensemble import Ensemble
from mt.decode.search import beam_search, greedy_search
from mt.decode.shortlist import Lexicon, Shortlist, build_lexicon, load_lexicon
from mt.schema import DecodeConfig
from mt.vocab import BOS, EOS, PAD, UNK

V = 40


def ibm1_by_loops(pairs, vocab_size, iterations):
    """IBM model 1 as the textbook writes it: t(f | e) from uniform, a NULL source per pair,
    expected counts summed pair by pair, token by token."""
    null = vocab_size
    t = defaultdict(lambda: 1.0 / vocab_size)
    for _ in range(iterations):
        count, total = defaultdict(float), defaultdict(float)
        for src, tgt in pairs:
            sources = [*src, null]
            for f in tgt:
                z = sum(t[(e, f)] for e in sources)
                for e in sources:
                    c = t[(e, f)] / z
                    count[(e, f)] += c
                    total[e] += c
        t = defaultdict(float, {(e, f): c / total[e] for (e, f), c in count.items()})
    return {k: v for k, v in t.items() if k[0] != null}


def random_pairs(seed, n=60, vocab=V):
    g = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        src = g.integers(4, vocab, g.integers(1, 8)).tolist()
        # a noisy "translation": each source piece maps to (s * 7) % vocab, plus noise
        tgt = [4 + (s * 7) % (vocab - 4) for s in src if g.random() < 0.8]
        tgt += g.integers(4, vocab, g.integers(0, 3)).tolist()
        pairs.append((src, tgt or [4]))
    return pairs


def lexicon_of_pairs(pairs, **kw) -> Lexicon:
    src = TokenArray.from_sequences([s for s, _ in pairs])
    tgt = TokenArray.from_sequences([t for _, t in pairs])
    return build_lexicon(src, tgt, V, **kw)


def test_ibm1_table_equals_the_loop_by_loop_em():
    pairs = random_pairs(0)
    lex = lexicon_of_pairs(pairs, iterations=4)
    ref = ibm1_by_loops(pairs, V, 4)
    got = {}
    for s in range(V):
        a, b = int(lex.offsets[s]), int(lex.offsets[s + 1])
        probs = lex.probs[a:b].tolist()
        assert probs == sorted(probs, reverse=True)  # most probable first
        for t, p in zip(lex.targets[a:b].tolist(), probs):
            got[(s, t)] = p
    assert got.keys() == ref.keys()
    for key, p in ref.items():
        assert got[key] == pytest.approx(p, rel=1e-5, abs=1e-7)
    # the learned table finds the planted translation of most pieces
    best = {s: int(lex.targets[lex.offsets[s]])
            for s in range(4, V) if lex.offsets[s + 1] > lex.offsets[s]}  # fmt: skip
    planted = sum(best[s] == 4 + (s * 7) % (V - 4) for s in best)
    assert planted >= 0.8 * len(best)


def test_lexicon_keeps_the_k_best_the_frequent_pieces_and_a_sample_within_bounds(tmp_path):
    pairs = random_pairs(1)
    full = lexicon_of_pairs(pairs)
    few = lexicon_of_pairs(pairs, keep=2)
    for s in range(V):
        a, b = int(full.offsets[s]), int(full.offsets[s + 1])
        c, d = int(few.offsets[s]), int(few.offsets[s + 1])
        assert d - c == min(2, b - a)
        assert few.probs[c:d].tolist() == pytest.approx(full.probs[a : a + d - c].tolist())
    counts = np.bincount([t for _, tgt in pairs for t in tgt], minlength=V)
    freq = full.frequent.tolist()
    assert sorted(freq) == [t for t in range(V) if counts[t] > 0]
    assert [counts[t] for t in freq] == sorted(counts[counts > 0], reverse=True)
    # beyond max_products a fixed sample of the pairs is used
    cost = sum((len(s) + 1) * len(t) for s, t in pairs)
    half = lexicon_of_pairs(pairs, max_products=cost // 2)
    assert 0 < half.meta["pairs"] < len(pairs) and half.meta["of_pairs"] == len(pairs)
    again = lexicon_of_pairs(pairs, max_products=cost // 2)
    assert torch.equal(half.targets, again.targets)
    # a file round trip, read with weights_only
    path = tmp_path / "lexicon.pt"
    full.save(path)
    back = load_lexicon(path, V)
    for name in ("offsets", "targets", "probs", "frequent"):
        assert torch.equal(getattr(back, name), getattr(full, name))
    assert torch.load(path, weights_only=True)["format"] == 1


def test_batch_shortlist_is_the_union_and_maps_columns_back():
    lex = lexicon_of_pairs(random_pairs(2))
    src = make_src([[5, 9, 9], [12]])
    sl = lex.shortlist(src, k=3, frequent=4, prefix=torch.tensor([[30, -1], [-1, -1]]))
    ids = sl.ids.tolist()
    assert ids[:4] == [PAD, UNK, BOS, EOS] and ids[4:] == sorted(set(ids[4:]))
    want = {30, 5, 9, 12, *lex.frequent[:4].tolist()}
    for s in (5, 9, 12):
        a = int(lex.offsets[s])
        want |= set(lex.targets[a : min(a + 3, int(lex.offsets[s + 1]))].tolist())
    assert set(ids[4:]) == {t for t in want if t >= 4}
    tokens = torch.tensor([[30, -1], [EOS, ids[7]]])
    cols = sl.columns(tokens)
    assert cols.tolist() == [[ids.index(30), -1], [EOS, 7]]


class Masked(nn.Module):
    """The full model with every logit outside a fixed set of ids at -inf."""

    def __init__(self, model, ids):
        super().__init__()
        self.model, self.max_positions = model, model.max_positions
        self.mask = torch.full((model.vocab_size,), float("-inf"))
        self.mask[ids] = 0.0

    def encode(self, src):
        return self.model.encode(src)

    def new_cache(self):
        return self.model.new_cache()

    def decode(self, tgt_in, enc, cache=None):
        return self.model.decode(tgt_in, enc, cache) + self.mask


@pytest.fixture(scope="module")
def model():
    return sharp_random_model(vocab_size=V)


def sources(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("beam", [1, 4])
def test_search_over_a_shortlist_is_the_masked_full_search(model, beam):
    src = make_src(sources(0, [3, 12, 7, 1, 9]))
    sl = Shortlist(torch.tensor([0, 1, 2, 3, 5, 8, 11, 17, 20, 23, 29, 31, 37]))
    masked = Masked(model, sl.ids)
    if beam == 1:
        got = [[h] for h in greedy_search(model, src, 1.0, 8, alpha=0.6, shortlist=sl)]
        ref = [[h] for h in greedy_search(masked, src, 1.0, 8, alpha=0.6)]
    else:
        got = beam_search(model, src, beam, 0.6, 1.0, 8, nbest=beam, shortlist=sl)
        ref = beam_search(masked, src, beam, 0.6, 1.0, 8, nbest=beam)
    lengths = set()
    for g, r in zip(got, ref):
        assert [h.tokens for h in g] == [h.tokens for h in r]
        assert [h.score for h in g] == pytest.approx([h.score for h in r], abs=1e-4)
        lengths |= {len(h.tokens) for h in g}
        assert {t for h in g for t in h.tokens} <= set(sl.ids.tolist())
    assert len(lengths) > 1  # some end with EOS, some at the length limit


def test_a_prefix_is_forced_through_the_shortlist(model):
    src = make_src(sources(1, [4, 6]))
    sl = Shortlist(torch.tensor([0, 1, 2, 3, 7, 13, 21]))
    got = beam_search(model, src, 3, 0.6, 1.0, 6, prefix=[[21, 13], []], shortlist=sl)
    ref = beam_search(Masked(model, sl.ids), src, 3, 0.6, 1.0, 6, prefix=[[21, 13], []])
    assert got[0][0].tokens[:2] == [21, 13]
    assert [h[0].tokens for h in got] == [h[0].tokens for h in ref]


def lexicon_file(tmp_path, k_pairs=200):
    pairs = random_pairs(3, n=k_pairs)
    path = tmp_path / "lexicon.pt"
    lexicon_of_pairs(pairs).save(path)
    return path


@pytest.mark.parametrize("setting", [{}, {"precision": "bf16"}])
def test_a_shortlist_of_every_piece_decodes_as_the_whole_vocabulary(model, tmp_path, setting):
    """A shortlist of all pieces gives the search over the whole vocabulary, in float32 and
    under bf16 autocast (the shortlist's rows of the output weight in their own product)."""
    every = Lexicon(torch.zeros(V + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0), torch.arange(V))  # fmt: skip
    path = tmp_path / "every.pt"
    every.save(path)
    ids = sources(4, [4, 9, 13, 6, 20, 3, 11, 8])
    cfg = DecodeConfig(beam_size=4, max_len_a=0.5, max_len_b=5, batch_size=4, **setting)
    ref = translate_nbest(model, ids, cfg)
    out = translate_nbest(model, ids, DecodeConfig(**{**cfg.__dict__, "shortlist": str(path),
                                                      "shortlist_frequent": V}))  # fmt: skip
    assert [h[0].tokens for h in out] == [h[0].tokens for h in ref]
    for a, b in zip(ref, out):
        assert a[0].score == pytest.approx(b[0].score, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 5])
def test_each_sentence_searches_its_own_list_in_any_batch(model, tmp_path, beam):
    """Batched == one by one, and one sentence's search is the masked full search over its own
    list (its pieces' translations, its pieces, the frequent ones), whatever shares its batch."""
    path = lexicon_file(tmp_path)
    lex = load_lexicon(path)
    ids = sources(5, [4, 9, 13, 6, 2, 11, 7])
    cfg = DecodeConfig(beam_size=beam, alpha=0.6, max_len_a=1.0, max_len_b=4, batch_size=4,
                       shortlist=str(path), shortlist_k=2,
                       shortlist_frequent=3)  # fmt: skip
    batched = translate_nbest(model, ids, cfg)
    single = [translate_nbest(model, [s], cfg)[0] for s in ids]
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in single]
    assert [h[0].score for h in batched] == pytest.approx([h[0].score for h in single], abs=1e-4)
    union = lex.shortlist(make_src(ids), 2, 3)
    assert union.bias is not None  # the batch's union is wider than some sentence's list
    for sentence, (hyp,) in zip(ids, single):
        src = make_src([sentence])
        own = lex.shortlist(src, 2, 3).ids
        assert len(own) < len(union)
        masked = Masked(model, own)
        if beam == 1:
            ref = greedy_search(masked, src, 1.0, 4, alpha=0.6)[0]
        else:
            ref = beam_search(masked, src, beam, 0.6, 1.0, 4)[0][0]
        assert hyp.tokens == ref.tokens
        assert hyp.score == pytest.approx(ref.score, abs=1e-4)
    full = translate_ids(model, ids, DecodeConfig(**{**cfg.__dict__, "shortlist": None}))
    assert full != [h[0].tokens for h in batched]  # the lists are narrow enough to matter


def test_an_ensemble_searches_the_shortlist_of_its_members(model, tmp_path):
    path = lexicon_file(tmp_path)
    ids = sources(6, [5, 8, 3])
    cfg = DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=4, batch_size=3,
                       shortlist=str(path), shortlist_k=3, shortlist_frequent=2)  # fmt: skip
    assert translate_ids(Ensemble([model, model]), ids, cfg) == translate_ids(model, ids, cfg)


def test_shortlist_errors_name_the_setting(model, tmp_path):
    ids = sources(7, [3])
    base = DecodeConfig(beam_size=1, max_len_b=3)
    missing = str(tmp_path / "x")
    with pytest.raises(ValueError, match="decode.shortlist=.*no such file"):
        translate_ids(model, ids, DecodeConfig(**{**base.__dict__, "shortlist": missing}))
    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(ValueError, match="not a lexicon file"):
        translate_ids(model, ids, DecodeConfig(**{**base.__dict__, "shortlist": str(bad)}))
    other = tmp_path / "other.pt"
    Lexicon(torch.zeros(9, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0),
            torch.arange(8)).save(other)  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary of 8 pieces, the model has 40"):
        translate_ids(model, ids, DecodeConfig(**{**base.__dict__, "shortlist": str(other)}))
    path = lexicon_file(tmp_path)
    with pytest.raises(ValueError, match="decode.shortlist_k"):
        translate_ids(model, ids, DecodeConfig(**{**base.__dict__, "shortlist": str(path),
                                                  "shortlist_k": 0}))  # fmt: skip
    with pytest.raises(ValueError, match="decode.shortlist=train"):
        translate_ids(model, ids, DecodeConfig(**{**base.__dict__, "shortlist": "train"}))


def test_train_shortlist_is_built_from_the_prepared_pairs_and_used_by_mt_translate(
    real_data, tmp_path
):
    """decode.shortlist=train: the lexicon of a Multi30k slice, built once beside the prepared
    data; IBM model 1 finds the obvious translations; mt-translate decodes with it."""
    from mt.checkpoint import model_state, save_checkpoint
    from mt.config import load_config
    from mt.data.build import prepare
    from mt.decode.shortlist import resolve_shortlist
    from mt.decode.translate import translate_main
    from mt.model.transformer import build_model
    from mt.schema import ModelConfig

    cfg = load_config([f"data.dir={real_data / 'multi30k'}", f"cache_dir={tmp_path / 'cache'}",
                       "data.max_train_pairs=2000", "tokenizer.vocab_size=1000",
                       "tokenizer.threads=1", "decode.shortlist=train", "train.device=cpu",
                       "decode.beam_size=2", "decode.max_len_b=5"])  # fmt: skip
    prepared = prepare(cfg)
    resolved = resolve_shortlist(cfg, prepared.tokenizer)
    path = prepared.dir / "lexicon.pt"
    assert resolved.decode.shortlist == str(path) and path.is_file()
    lex = load_lexicon(path, prepared.vocab_size)
    assert lex.meta["direction"] == ["de", "en"]
    assert lex.meta["pairs"] == len(prepared.split("train"))
    sp = prepared.tokenizer.model("src")
    right = 0
    for de, en in [("▁Mann", "▁man"), ("▁Frau", "▁woman"), ("▁Hund", "▁dog"), ("▁Kind", "▁child")]:
        s, t = sp.piece_to_id(de), sp.piece_to_id(en)
        assert s != UNK and t != UNK, (de, en)
        right += int(lex.targets[lex.offsets[s]]) == t
    assert right >= 3
    mtime = path.stat().st_mtime_ns
    assert resolve_shortlist(cfg, prepared.tokenizer).decode.shortlist == str(path)
    assert path.stat().st_mtime_ns == mtime  # built once, reused
    # mt-translate with a checkpoint of the prepared tokenizer
    torch.manual_seed(0)
    mcfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=64)
    state = model_state(build_model(mcfg, prepared.vocab_size), mcfg, prepared.tokenizer,
                        prepared.vocab_size)  # fmt: skip
    state.update(step=1, epoch=1)
    save_checkpoint(tmp_path / "best.pt", state)
    (tmp_path / "in.de").write_text("Ein Mann mit einem Hund.\nZwei Frauen.\n", encoding="utf-8")
    cfg.translate.checkpoint = str(tmp_path / "best.pt")
    cfg.translate.input, cfg.translate.output = str(tmp_path / "in.de"), str(tmp_path / "out")
    translate_main(cfg)
    assert len((tmp_path / "out").read_text(encoding="utf-8").split("\n")) == 3
    other = build_tokenizer_like(tmp_path)
    with pytest.raises(ValueError, match="decode.shortlist=train: the checkpoint's tokenizer"):
        resolve_shortlist(cfg, other)


def build_tokenizer_like(tmp_path):
    from mt.data.tokenizer import Tokenizer
    from mt.schema import TokenizerConfig

    src, tgt = tmp_path / "t.de", tmp_path / "t.en"
    src.write_text("ein hund läuft\n" * 50 + "eine katze\n" * 50, encoding="utf-8")
    tgt.write_text("a dog runs\n" * 50 + "a cat\n" * 50, encoding="utf-8")
    cfg = TokenizerConfig(vocab_size=40, threads=1, byte_fallback=False)
    return Tokenizer.train(src, tgt, tmp_path / "spm", cfg)


def test_bias_rows_follow_the_live_sentences():
    """bias_rows gives each live sentence's own row of the restriction, in the order asked;
    the rows are kept between steps and gathered again when the live sentences change."""
    allowed = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    sl = Shortlist(torch.arange(4), allowed)
    expect = torch.zeros(3, 4).masked_fill_(~allowed, float("-inf"))
    assert torch.equal(sl.bias_rows([0, 1, 2]), expect)
    assert sl.bias_rows([0, 1, 2]) is sl.bias_rows([0, 1, 2])  # kept, not gathered again
    assert torch.equal(sl.bias_rows([2, 0]), expect[[2, 0]])
    assert torch.equal(sl.bias_rows([1]), expect[[1]])
    assert torch.equal(sl.bias_rows([0, 1, 2]), expect)
    assert Shortlist(torch.arange(4)).bias_rows([0, 1]) is None
