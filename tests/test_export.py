"""mt-export: the Hugging Face and CTranslate2 exports compute mt's function.

On random weights (logits on a padded batch, CTranslate2's token scores, shared and separate
embeddings, N_dec != N;
greedy and beam-4 ids on a model whose sentences end at many different steps, some at their
maximum length) and on a small model trained on Multi30k (tokenizer ids, logits, greedy and
beam-4 ids on test sentences). Unexportable settings are refused, naming the setting.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

import export_check as ec  # noqa: E402
from conftest import sharp_random_model  # noqa: E402

from mt.export import export, export_main  # noqa: E402
from mt.export.ct2 import ct2_spec  # noqa: E402
from mt.export.hf import (  # noqa: E402
    ExportError,
    build_marian,
    check_exportable,
    hidden_permutation,
)
from mt.model.transformer import build_model, sinusoidal_positions  # noqa: E402
from mt.schema import Config, DecodeConfig, ExportConfig, ModelConfig  # noqa: E402
from mt.vocab import BOS, EOS, PAD  # noqa: E402


def _batch(V: int, seed: int = 0):
    """A padded source/target batch: (B, S), (B, T) with rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = [9, 4, 6], [7, 3, 5]
    src = torch.full((3, 10), PAD, dtype=torch.long)
    tgt = torch.full((3, 8), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src_len, tgt_len)):
        src[i, :s] = torch.randint(4, V, (s,), generator=g)
        src[i, s] = EOS
        tgt[i, 0] = BOS
        tgt[i, 1:t] = torch.randint(4, V, (t - 1,), generator=g)
    return src, tgt


def _random_model(cfg: ModelConfig, V: int):
    torch.manual_seed(1)
    model = build_model(cfg, V).eval()
    with torch.no_grad():  # LayerNorm gains/biases away from 1/0 so a wrong permutation shows
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _assert_same_logits(model, hf, src, tgt) -> None:
    with torch.no_grad():
        expected = model(src, tgt)
        got = hf(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
    real = tgt.ne(PAD)  # padded target positions are never read
    assert got.shape == expected.shape
    assert torch.allclose(got[real], expected[real], atol=1e-4, rtol=0)


def test_the_hidden_permutation_puts_even_columns_first():
    perm = hidden_permutation(16)
    assert perm.tolist() == [*range(0, 16, 2), *range(1, 16, 2)]


@pytest.mark.parametrize(
    "shape",
    [
        dict(N=2, d_model=32, d_ff=64, h=4),
        dict(N=2, N_dec=3, d_model=24, d_ff=40, h=3, share_embeddings=False, vocab_multiple=16),
    ],
)
def test_hf_logits_and_ct2_scores_equal_mt_on_a_padded_batch(shape, tmp_path):
    cfg = ModelConfig(dropout=0.0, max_positions=64, **shape)
    V = 45  # not a multiple of vocab_multiple: mt's padded rows are dropped
    model = _random_model(cfg, V)
    hf = build_marian(model.state_dict(), cfg, V)
    # Marian recomputes its positional table at load: it is the permuted mt table.
    table, ours = hf.model.encoder.embed_positions.weight, sinusoidal_positions(64, cfg.d_model)
    assert torch.allclose(table, ours[:, hidden_permutation(cfg.d_model)], atol=1e-6)
    assert not torch.allclose(table, ours)  # the layouts really differ
    src, tgt = _batch(V)
    _assert_same_logits(model, hf, src, tgt)
    # CTranslate2 scores each target token (and the EOS after it) given the source.
    rows = [(s[s.ne(PAD)][:-1].tolist(), t[t.ne(PAD)][1:].tolist()) for s, t in zip(src, tgt)]
    results = _ct2(model, cfg, V, tmp_path).score_batch(
        [[f"p{i}" for i in s] for s, _ in rows], [[f"p{i}" for i in t] for _, t in rows]
    )
    with torch.no_grad():
        lprobs = torch.log_softmax(model(src, tgt), dim=-1)  # (B, T, V)
    for b, ((_, t), res) in enumerate(zip(rows, results)):
        expected = [lprobs[b, i, tok].item() for i, tok in enumerate([*t, EOS])]
        assert res.log_probs == pytest.approx(expected, abs=1e-4)


def _fake_pieces(V: int) -> list[str]:
    return ["<pad>", "<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(4, V)]


def _ct2(model, cfg: ModelConfig, V: int, tmp_path):
    spec = ct2_spec(model.state_dict(), cfg, _fake_pieces(V))

    class Converter(ctranslate2.converters.Converter):
        def _load(self):
            return spec

    Converter().convert(str(tmp_path / "ct2"), force=True)
    return ec.load_ct2(tmp_path / "ct2")


@pytest.mark.parametrize("beam", [1, 4])
def test_random_weights_generate_equals_mt(beam, tmp_path):
    """Greedy and beam 4 without length penalty: HF generate and CTranslate2 give mt's ids on a
    model whose sentences end at many steps (some at their maximum length, without EOS)."""
    V = 40
    model = sharp_random_model(V)
    g = torch.Generator().manual_seed(3)
    src_ids = [torch.randint(4, V, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 12, (24,), generator=g)]  # fmt: skip
    cfg = DecodeConfig(beam_size=beam, alpha=0.0, max_len_a=0.5, max_len_b=6)
    expected = ec.mt_ids(model, src_ids, cfg)
    lims = ec.limits(model, src_ids, cfg)
    assert any(len(e) == n for e, n in zip(expected, lims)), "some reach their maximum length"
    assert len({len(e) for e in expected}) > 3
    hf = build_marian(model.state_dict(), model.cfg, V)
    assert str(ec.agreement(expected, ec.hf_ids(hf, src_ids, lims, beam, 0.0))) == "24/24"
    translator = _ct2(model, model.cfg, V, tmp_path)
    vocab = {p: i for i, p in enumerate(_fake_pieces(V))}
    pieces = [[f"p{i}" for i in s] for s in src_ids]
    got = ec.ct2_ids(translator, pieces, lims, beam, 0.0, vocab)
    if beam == 1:
        assert str(ec.agreement(expected, got)) == "24/24"
        return
    # CTranslate2's beam search keeps going after beam_size hypotheses have finished while its
    # best live beam still scores higher (mt stops there): where the outputs differ, CTranslate2's
    # is a longer hypothesis that scores higher than mt's best.
    best = ec.mt_nbest(model, src_ids, cfg)
    for i in range(len(src_ids)):
        if got[i] != expected[i]:
            (res,) = translator.translate_batch(
                [pieces[i]], beam_size=4, length_penalty=0.0, max_decoding_length=lims[i],
                min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]],
                return_scores=True,
            )  # fmt: skip
            assert len(got[i]) > len(expected[i]) and res.scores[0] > best[i][0].score
    assert ec.agreement(expected, got).same >= 20


def test_generation_config_caps_new_tokens_only(capfd):
    """One output cap, as mt states it (new tokens): generate() with or without max_new_tokens
    runs without transformers' warning that both max_length and max_new_tokens were set."""
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, max_positions=64), 20)
    hf = build_marian(model.state_dict(), model.cfg, 20)
    gen = hf.generation_config.to_diff_dict()
    assert gen["max_new_tokens"] == 63 and "max_length" not in gen
    src = torch.tensor([[5, 6, 7, 3]])
    assert hf.generate(src, max_new_tokens=3).shape[1] <= 4  # start token + 3
    hf.generate(src)
    assert "max_length" not in capfd.readouterr().err


def test_unexportable_settings_are_refused_naming_the_setting():
    with pytest.raises(ExportError, match="model.norm=pre"):
        check_exportable(ModelConfig(norm="pre"), True, "hf")
    with pytest.raises(ExportError, match="model.norm=pre"):
        check_exportable(ModelConfig(norm="pre"), True, "ctranslate2")
    with pytest.raises(ExportError, match="tokenizer.joint=false"):
        check_exportable(ModelConfig(), False, "hf")
    with pytest.raises(ExportError, match="model.d_model=15"):
        check_exportable(ModelConfig(d_model=15, h=3), True, "hf")
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, norm="pre"), 20)
    with pytest.raises(ExportError, match="model.norm=pre"):
        build_marian(model.state_dict(), model.cfg, 20)


def test_export_command_errors_are_one_line(tmp_path):
    missing, out = str(tmp_path / "missing.pt"), str(tmp_path / "o")
    args = ExportConfig(checkpoint=missing, format="hf", output=out)
    cfg = Config(export=args)
    with pytest.raises(SystemExit, match="mt-export: no checkpoint at"):
        export_main(cfg)
    with pytest.raises(SystemExit, match="format=onnx"):
        export_main(dataclasses.replace(cfg, export=dataclasses.replace(args, format="onnx")))
    with pytest.raises(SystemExit, match="format=hf\\|ctranslate2"):
        export_main(dataclasses.replace(cfg, export=dataclasses.replace(args, format=None)))


# ---- a small model trained on Multi30k --------------------------------------------------------


@pytest.fixture(scope="module")
def trained(real_data, tmp_path_factory):
    """(checkpoint, HF directory, CTranslate2 directory, test sentences) of a small model
    trained for a few seconds on Multi30k (the smoke experiment, shortened)."""
    from mt.config import load_config
    from mt.data.build import prepare
    from mt.train.recipe import train

    tmp = tmp_path_factory.mktemp("export")
    cfg = load_config([
        "experiment=smoke", f"run_dir={tmp / 'run'}", f"data.dir={real_data / 'multi30k'}",
        f"cache_dir={tmp / 'cache'}", "train.max_steps=30", "train.threads=2",
        "train.max_tokens=1024",
        "data.max_train_pairs=3000", "train.eval_every=0", "train.save_every=0",
        "train.log_every=20", "train.eval_bleu=false",
    ])  # fmt: skip
    prepare(cfg)
    train(cfg)
    ckpt = tmp / "run" / "checkpoints" / "last.pt"
    hf_dir = export(ckpt, "hf", tmp / "hf")
    ct2_dir = export(ckpt, "ctranslate2", tmp / "ct2")
    lines = (real_data / "multi30k" / "test_2016_flickr.de").read_text().splitlines()
    return ckpt, hf_dir, ct2_dir, lines[:32]


@pytest.mark.slow
def test_trained_model_hf_and_ct2_agree_with_mt(trained):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from mt.checkpoint import load_model

    ckpt, hf_dir, ct2_dir, lines = trained
    model, tok, _ = load_model(ckpt)
    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    src_ids = tok.encode([tok.normalize(s) for s in lines], side="src")
    assert hf_tok(lines)["input_ids"] == [ids + [EOS] for ids in src_ids]
    assert hf.config.decoder_start_token_id == BOS and hf.config.pad_token_id == PAD

    enc = hf_tok(lines[:5], padding=True, return_tensors="pt")
    tgt = torch.tensor([[BOS, 10, 11, 12], [BOS, 13, 14, PAD]] + [[BOS, 15, PAD, PAD]] * 3)
    _assert_same_logits(model, hf, enc["input_ids"], tgt)

    sp = tok.model("src")
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    pieces = [[sp.id_to_piece(i) for i in ids] for ids in src_ids]
    translator = ec.load_ct2(ct2_dir)
    for beam in (1, 4):
        # One short output limit for all: one batch per library, quick (a barely trained
        # model often runs to it, so the limit is exercised too).
        cfg = DecodeConfig(beam_size=beam, alpha=0.0, max_len_a=0.0, max_len_b=8)
        expected = ec.mt_ids(model, src_ids, cfg)
        lims = ec.limits(model, src_ids, cfg)
        assert ec.agreement(expected, ec.hf_ids(hf, src_ids, lims, beam, 0.0)).same == len(lines)
        got = ec.ct2_ids(translator, pieces, lims, beam, 0.0, vocab)
        assert ec.agreement(expected, got).same == len(lines)
    # The tokenizer turns the ids back into mt's text.
    out = ec.mt_ids(model, src_ids[:5], DecodeConfig(beam_size=1))
    assert hf_tok.batch_decode(out, skip_special_tokens=True) == tok.decode(out)


@pytest.mark.slow
def test_the_hf_export_carries_a_model_card(trained):
    """README.md beside the weights: the hub's header (languages, pipeline), parameters, data,
    the command that trained it, scores with signatures once evaluated, limits."""
    import json

    ckpt, hf_dir, _, _ = trained
    card = (hf_dir / "README.md").read_text()
    assert card.startswith("---\nlanguage:\n- de\n- en\nlicense: unknown\nlibrary_name: "
                           "transformers\npipeline_tag: translation\n")  # fmt: skip
    assert "Multi30k is image captions" in card  # the data is Multi30k
    from mt.checkpoint import load_checkpoint

    params = sum(v.numel() for v in load_checkpoint(ckpt)["model"].values())
    assert f"| parameters | {params:,} |" in card
    assert "mt-train experiment=smoke" in card and "train.max_steps=30" in card
    assert "not evaluated" in card and "## Limits" in card
    # evaluated: the scores and their signatures come along
    run_dir = ckpt.parent.parent
    (run_dir / "results.json").write_text(json.dumps({
        "split": "test", "beam_size": 5, "alpha": 1.5, "step": 30,
        "scores": {"bleu": {"score": 12.3456, "signature": "nrefs:1|tok:13a"}}}))  # fmt: skip
    try:
        again = export(ckpt, "hf", hf_dir.parent / "hf-again")
        card = (again / "README.md").read_text()
        assert "| bleu | 12.35 | `nrefs:1|tok:13a` |" in card
        assert "    - type: bleu\n      value: 12.35\n      name: BLEU\n" in card
    finally:
        (run_dir / "results.json").unlink()


def test_ct2_vocabulary_map_holds_the_shortlist(trained, tmp_path):
    """export.shortlist: CTranslate2's vmap.txt with mt's lists (a line per source piece, its
    best translations after itself; the frequent pieces on the empty source's line), and
    CTranslate2 with use_vmap=True translates each sentence within its list."""
    import numpy as np

    from mt.checkpoint import load_model
    from mt.data.store import TokenArray
    from mt.decode.shortlist import build_lexicon

    ckpt, _, _, lines = trained
    model, tok, _ = load_model(ckpt)
    V = model.vocab_size
    g = np.random.default_rng(0)
    src = [g.integers(4, V, 6).tolist() for _ in range(300)]
    tgt = [[4 + (s * 7) % (V - 4) for s in row] for row in src]
    lexicon = build_lexicon(TokenArray.from_sequences(src), TokenArray.from_sequences(tgt), V)
    lexicon.save(tmp_path / "lexicon.pt")
    with pytest.raises(ExportError, match="export.shortlist=.*only format=ctranslate2"):
        export(ckpt, "hf", tmp_path / "hf", tmp_path / "lexicon.pt")
    with pytest.raises(ExportError, match="export.shortlist=.*no such file"):
        export(ckpt, "ctranslate2", tmp_path / "x", tmp_path / "missing.pt")
    out = export(ckpt, "ctranslate2", tmp_path / "ct2", tmp_path / "lexicon.pt", 2, 5)
    sp = tok.model("src")
    rows = (out / "vmap.txt").read_text(encoding="utf-8").split("\n")
    assert rows[-1] == "" and len(rows) == 1 + (V - 4) + 1
    frequent = [sp.id_to_piece(t) for t in lexicon.frequent[:5].tolist() if t >= 4]
    assert rows[0] == "\t" + " ".join(frequent)
    s = 4 + 17
    key, values = rows[1 + 17].split("\t")
    best = lexicon.targets[lexicon.offsets[s] : lexicon.offsets[s] + 2].tolist()
    assert key == sp.id_to_piece(s) and values.split() == [sp.id_to_piece(t) for t in [s, *best]]
    lists = {r.split("\t")[0]: set(r.split("\t")[1].split()) for r in rows[1:-1]}
    translator = ctranslate2.Translator(str(out), device="cpu")
    for line in lines[:6]:
        pieces = [sp.id_to_piece(i) for i in tok.encode([tok.normalize(line)], side="src")[0]]
        (res,) = translator.translate_batch([pieces], beam_size=2, max_decoding_length=8,
                                            use_vmap=True)  # fmt: skip
        allowed = set(frequent).union(*(lists[p] for p in pieces)) | {"<unk>", "</s>"}
        assert set(res.hypotheses[0]) <= allowed
