"""Many directions in one model (``data.directions``): the parsing of the directions, the tagged
and recorded prepared data, the sampling of directions by weight, validation and test scores
per direction against sacreBLEU on each direction's lines, and ``translate.target_lang``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from mt.config import load_config
from mt.data.build import cache_key, prepare
from mt.data.mixing import directions, train_mix, train_specs
from mt.decode.translate import target_tag
from mt.train.state import data_plan

DE = "ein mann hund fährt rennt im schnee auf dem fahrrad eine frau".split()
EN = "a man dog rides runs in the snow on bike woman".split()


def _corpus(d: Path) -> Path:
    rng = random.Random(0)
    d.mkdir()
    for split, n in [("train", 200), ("valid", 6), ("test", 7)]:
        for lang, words in [("de", DE), ("en", EN)]:
            lines = [" ".join(rng.choices(words, k=rng.randint(2, 6))) for _ in range(n)]
            (d / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def _cfg(d: Path, tmp_path: Path, *extra: str):
    return load_config([
        "data=local", f"data.dir={d}", "tokenizer.vocab_size=80", "tokenizer.byte_fallback=false",
        "tokenizer.threads=1", f"cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}",
        "train.device=cpu", "decode.beam_size=2", "decode.max_len_a=0", "decode.max_len_b=4",
        "eval.report=true", *extra,
    ])  # fmt: skip


def test_directions_parse_with_weights_and_bad_ones_are_one_line():
    cfg = load_config(["data.directions=[de-en,{name:en-de,weight:2}]", "data.splits.train=[a,b]"])
    assert [(d.name, d.weight) for d in directions(cfg.data)] == [("de-en", 1.0), ("en-de", 2.0)]
    specs = [(s.name, s.weight) for s in train_specs(cfg.data)]
    assert specs == [("de-en:a", 1.0), ("de-en:b", 1.0), ("en-de:a", 2.0), ("en-de:b", 2.0)]
    assert data_plan(cfg, 1)["mix"] == [list(s) for s in specs]  # a new mix is a new plan
    assert [s.name for s in train_specs(load_config([]).data)] == ["train"]
    for bad, said in [("[de]", "'de' is not a direction"), ("[de-de]", "'de-de' is not"),
                      ("[de-en,de-en]", "given twice"),
                      ("[{name:de-en,weight:0}]", "data.directions[0]: weight=0")]:  # fmt: skip
        with pytest.raises(ValueError) as err:
            directions(load_config([f"data.directions={bad}"]).data)
        assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("setting,said", [("tokenizer.joint=false", "tokenizer.joint=true"),
                                          ("data.clean.moses_punct=true", "moses_punct=false")])
def test_settings_that_cannot_serve_many_languages_are_refused(tmp_path, setting, said):
    cfg = _cfg(_corpus(tmp_path / "d"), tmp_path, "data.directions=[de-en,en-de]", setting)
    with pytest.raises(ValueError, match=said):
        prepare(cfg)


def test_prepare_tags_each_direction_and_records_its_lines(tmp_path):
    d = _corpus(tmp_path / "d")
    cfg = _cfg(d, tmp_path, "data.directions=[de-en,en-de]")
    weighted = _cfg(d, tmp_path, "data.directions=[de-en,{name:en-de,weight:3}]")
    assert cache_key(cfg) == cache_key(weighted) != cache_key(_cfg(d, tmp_path))
    prepared = prepare(cfg)
    meta = json.loads((prepared.dir / "meta.json").read_text())
    corpora = meta["counts"]["train"]["corpora"]
    assert [c["name"] for c in corpora] == ["de-en:train", "en-de:train"]
    assert sum(prepared.corpus_sizes()) == len(prepared.split("train"))
    assert [(n, list(r)) for n, r in prepared.directions("test")] == [
        ("de-en", list(range(0, 7))), ("en-de", list(range(7, 14)))]  # fmt: skip
    de, en = ((d / f"test.{lang}").read_text().splitlines() for lang in ("de", "en"))
    assert prepared.sources("test") == [f"<2en> {s}" for s in de] + [f"<2de> {s}" for s in en]
    assert prepared.references("test") == en + de
    tok = prepared.tokenizer
    assert tok.target_langs() == ["de", "en"]
    assert "<2de>" in tok.pieces("<2de> ein mann")[:2]  # one piece, never split
    train = prepared.split("train")
    first, last = tok.decode([train.src[0], train.src[len(train) - 1]], "src")
    assert first.startswith("<2en> ") and last.startswith("<2de> ")
    assert prepared.directions("train") == []
    assert prepare(_cfg(d, tmp_path)).directions("test") == []  # one direction: none
    mix = train_mix(weighted.data, prepared.corpus_sizes())
    assert mix.names == ("de-en:train", "en-de:train") and mix.weights == (1.0, 3.0)


def _checkpoint(cfg):
    from mt.checkpoint import model_state, save_checkpoint
    from mt.model.transformer import build_model
    from mt.schema import ModelConfig

    prepared = prepare(cfg)
    torch.manual_seed(0)
    mcfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, max_positions=64)
    model = build_model(mcfg, prepared.vocab_size)
    state = model_state(model, mcfg, prepared.tokenizer, prepared.vocab_size)
    path = Path(cfg.run_dir) / "checkpoints" / "best.pt"
    save_checkpoint(path, {**state, "step": 3, "epoch": 1})
    return prepared, model, path


def test_validation_scores_each_direction_and_chooses_by_their_mean(tmp_path, monkeypatch):
    import sacrebleu

    from mt.train import validation

    cfg = _cfg(_corpus(tmp_path / "d"), tmp_path, "data.directions=[de-en,en-de]",
               "train.eval_max_sentences=4", "train.best_metric=chrf")  # fmt: skip
    prepared, model, _ = _checkpoint(cfg)
    assert [list(r) for _, r in validation.valid_ranges(prepared, cfg)] == [[0, 1, 2, 3],
                                                                            [6, 7, 8, 9]]
    refs = prepared.references("valid")
    # de-en translated perfectly, en-de with its words in reverse order
    hyps = refs[:4] + [" ".join(reversed(r.split())) for r in refs[6:10]]
    monkeypatch.setattr(validation, "valid_hypotheses", lambda *a, **k: hyps)
    got = validation.valid_scores(model, prepared, cfg, torch.device("cpu"))
    expected = {"de-en": (hyps[:4], refs[:4]), "en-de": (hyps[4:], refs[6:10])}
    for name, (h, r) in expected.items():
        assert got[f"valid_bleu_{name}"] == pytest.approx(sacrebleu.corpus_bleu(h, [r]).score)
        assert got[f"valid_chrf_{name}"] == pytest.approx(sacrebleu.corpus_chrf(h, [r]).score)
    assert got["valid_bleu_de-en"] == pytest.approx(100.0) and got["valid_bleu_en-de"] < 100
    for metric in ("bleu", "chrf"):
        mean = (got[f"valid_{metric}_de-en"] + got[f"valid_{metric}_en-de"]) / 2
        assert got[f"valid_{metric}"] == pytest.approx(mean)
    # the sources decoded are the capped ranges of each direction, in order
    monkeypatch.undo()
    decoded = []
    monkeypatch.setattr("mt.decode.driver.translate_ids",
                        lambda m, src, *a: decoded.extend(src) or [[4]] * len(src))  # fmt: skip
    validation.valid_hypotheses(model, prepared, cfg, torch.device("cpu"))
    split = prepared.split("valid")
    assert decoded == [split.src[i].tolist() for i in [0, 1, 2, 3, 6, 7, 8, 9]]


def test_evaluate_writes_each_directions_scores(tmp_path, capsys):
    import sacrebleu

    from mt.evaluation.evaluate import evaluate_main

    cfg = _cfg(_corpus(tmp_path / "d"), tmp_path, "data.directions=[de-en,en-de]")
    prepared, _, _ = _checkpoint(cfg)
    result = evaluate_main(cfg)
    out = capsys.readouterr().out
    run = Path(cfg.run_dir)
    hyps = (run / "translations" / "test.txt").read_text().split("\n")[:-1]
    refs = prepared.references("test")
    saved = json.loads((run / "results.json").read_text())
    assert saved["directions"] == result["directions"]
    for name, r in prepared.directions("test"):
        part = saved["directions"][name]
        assert part["n_sentences"] == len(r) == 7
        h, ref = [hyps[i] for i in r], [refs[i] for i in r]
        assert part["scores"]["bleu"]["score"] == pytest.approx(
            sacrebleu.corpus_bleu(h, [ref]).score)  # fmt: skip
        assert part["scores"]["chrf"]["score"] == pytest.approx(
            sacrebleu.corpus_chrf(h, [ref]).score)  # fmt: skip
        assert f"{name}: bleu " in out
        assert f"| {name}: BLEU |" in (run / "report.md").read_text()


def test_target_lang_tags_each_line_and_a_missing_language_is_refused(tmp_path, monkeypatch):
    from mt.decode import translate

    assert target_tag([], None) is None and target_tag(["de", "en"], "de") == "<2de>"
    for langs, lang, said in [(["de", "en"], None, "the model writes de, en: choose one"),
                              (["de", "en"], "fr", "target_lang=fr: the model has no such"),
                              ([], "de", "trained without data.directions")]:  # fmt: skip
        with pytest.raises(SystemExit) as err:
            target_tag(langs, lang)
        assert said in str(err.value) and "\n" not in str(err.value)

    d = _corpus(tmp_path / "d")
    src = tmp_path / "in.txt"
    src.write_text("ein mann\n\nfrau\n", encoding="utf-8")
    cfg = _cfg(d, tmp_path, "data.directions=[de-en,en-de]", f"translate.input={src}",
               f"translate.output={tmp_path / 'out.txt'}", "translate.target_lang=en")  # fmt: skip
    _checkpoint(cfg)
    seen = []

    def stream(translator, lines, dst, *args):
        seen.extend(lines)
        return len(seen)

    monkeypatch.setattr(translate, "translate_stream", stream)
    translate.translate_main(cfg)
    assert seen == ["<2en> ein mann", "", "<2en> frau"]  # a blank line stays blank
    with pytest.raises(SystemExit, match="translate.target_lang=fr: the model has no such"):
        translate.translate_main(_cfg(d, tmp_path, "data.directions=[de-en,en-de]",
                                      f"translate.input={src}", "translate.target_lang=fr"))
