"""Scores: eval.metrics with signatures, published WMT17 figures, the papers' compound-split
tokenized BLEU on hand-counted sentences, and sacreBLEU test-set names from its cache."""

from __future__ import annotations

import json
import math

import pytest
import sacrebleu
from sacrebleu.dataset import DATASETS

from mt.config import load_config
from mt.evaluation.evaluate import evaluate_main, read_lines, score_files
from mt.evaluation.metrics import (
    COMPOUND_SPLIT_NOTE,
    compound_split_bleu,
    corpus_scores,
    score,
    split_compounds,
)

# sacreBLEU's README (13a BLEU on WMT17 en-de newstest2017), as shared/data/README.md lists.
PUBLISHED = {"online-A.0": 20.8, "online-B.0": 26.7, "online-F.0": 15.5, "online-G.0": 18.2,
             "LIUM-NMT.4900": 26.6}  # fmt: skip


def test_published_wmt17_bleu_and_every_metric_with_its_signature(real_data):
    d = real_data / "wmt17_ende_systems"
    refs = read_lines(d / "newstest2017.de")
    for system, published in PUBLISHED.items():
        hyps = read_lines(d / "systems" / f"newstest2017.{system}.en-de")
        result = score(hyps, refs, metrics=["bleu"])
        assert round(result["bleu"], 1) == published, system
    # All four on a slice (TER and chrF are slow on 3,004 segments): each as sacreBLEU computes
    # it with its own defaults, and each with its signature.
    hyps = read_lines(d / "systems" / "newstest2017.online-B.0.en-de")[:200]
    result = score(hyps, refs[:200], metrics=["bleu", "chrf", "chrf++", "ter"])
    scores = result["scores"]
    assert set(scores) == {"bleu", "chrf", "chrf++", "ter"}
    assert scores["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert "|nw:0|" in scores["chrf"]["signature"] and "|nw:2|" in scores["chrf++"]["signature"]
    assert scores["ter"]["signature"].startswith("nrefs:1|case:lc|tok:tercom")
    direct = {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs[:200]]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs[:200]]).score,
        "chrf++": sacrebleu.corpus_chrf(hyps, [refs[:200]], word_order=2).score,
        "ter": sacrebleu.corpus_ter(hyps, [refs[:200]]).score,
    }
    assert {m: s["score"] for m, s in scores.items()} == pytest.approx(direct)
    assert result["chrf"] == scores["chrf"]["score"] != scores["chrf++"]["score"]


def test_ter_and_bleu_tokenizers_on_hand_made_sentences():
    # One substitution in four reference words: TER = 1/4.
    assert corpus_scores(["a b c d"], [["a b e d"]], ["ter"])["ter"]["score"] == pytest.approx(25)
    # "intl" splits the CJK/Unicode punctuation "。" off, 13a does not: different n-grams.
    hyp, ref = ["Das ist gut。"], ["Das ist gut 。"]
    by_13a = corpus_scores(hyp, [ref], ["bleu"], "13a")["bleu"]
    by_intl = corpus_scores(hyp, [ref], ["bleu"], "intl")["bleu"]
    assert "tok:intl" in by_intl["signature"] and by_intl["score"] == pytest.approx(100)
    assert by_13a["score"] < 100
    with pytest.raises(ValueError, match="eval.metrics.*meteor"):
        corpus_scores(hyp, [ref], ["bleu", "meteor"])
    only_chrf = score(hyp, ref, metrics=["chrf"])
    assert only_chrf["bleu"] is None and set(only_chrf["scores"]) == {"chrf"}


def test_compound_splitting_is_perls_non_overlapping_substitution():
    assert split_compounds("E-Mail-Konto") == "E ##AT##-##AT## Mail ##AT##-##AT## Konto"
    assert split_compounds("A-B-C") == "A ##AT##-##AT## B-C"  # "B" was consumed by "A-B"
    assert split_compounds("- x - y-") == "- x - y-"  # a hyphen needs a non-space on each side


def test_compound_split_bleu_on_hand_counted_sentences():
    hyps = ["Der Dax stieg.", "Das ist gut so."]
    refs = ["Der Dax-Index stieg.", "Das ist gut so."]
    # Moses tokenization (de) then splitting:
    #   hyp 1 "Der Dax stieg ."                     4 tokens
    #   ref 1 "Der Dax ##AT##-##AT## Index stieg ." 6 tokens
    #   segment 2 "Das ist gut so ." in both        5 tokens
    # Matched n-grams / hypothesis n-grams, both segments together:
    #   1-grams: (4 + 5) / (4 + 5); 2-grams: "Der Dax", "stieg ." (2 + 4) / (3 + 4)
    #   3-grams: (0 + 3) / (2 + 3); 4-grams: (0 + 2) / (1 + 2)
    # Brevity penalty: hypothesis 9 tokens, reference 11.
    precisions = [9 / 9, 6 / 7, 3 / 5, 2 / 3]
    expected = 100 * math.exp(1 - 11 / 9) * math.exp(sum(map(math.log, precisions)) / 4)
    result = compound_split_bleu(hyps, refs, "de")
    assert result["score"] == pytest.approx(expected, abs=1e-9)
    assert "NOT comparable with sacreBLEU" in result["note"]
    # Without the splitting "Dax-Index" stays one token and the score differs.
    assert score(hyps, refs)["bleu"] != pytest.approx(expected, abs=0.01)
    # A zero n-gram count gives 0 (multi-bleu.perl does not smooth).
    assert compound_split_bleu(["a b c"], ["a b d"], "en")["score"] == 0.0


def test_compound_split_bleu_in_results(tmp_path):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("Der Dax stieg.\n", encoding="utf-8")
    ref.write_text("Der Dax-Index stieg.\n", encoding="utf-8")
    out = tmp_path / "scores.json"
    cfg = load_config([f"hyp={hyp}", f"ref={ref}", f"output={out}", "data.tgt_lang=de",
                       "eval.compound_split_bleu=true", "eval.metrics=[bleu,ter]"],
                      command="evaluate")  # fmt: skip
    evaluate_main(cfg)
    data = json.loads(out.read_text())
    assert set(data["scores"]) == {"bleu", "ter"}
    assert data["compound_split_bleu"]["note"] == COMPOUND_SPLIT_NOTE
    assert all(data["scores"][m]["signature"] for m in ("bleu", "ter"))


def test_sacrebleu_test_set_names_from_its_cache(tmp_path, monkeypatch):
    dataset = DATASETS["wmt14/full"]
    monkeypatch.setattr(dataset, "_outdir", str(tmp_path / "wmt14" / "full"))
    hyp = tmp_path / "hyp.de"
    hyp.write_text("Ein Test.\nZwei Tests.\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not in sacreBLEU's cache.*sacrebleu -t wmt14/full"):
        score_files(hyp, "wmt14/full", "en-de")
    with pytest.raises(ValueError, match="no pair xx-de"):
        score_files(hyp, "wmt14/full", "xx-de")
    (tmp_path / "wmt14" / "full").mkdir(parents=True)
    cached = tmp_path / "wmt14" / "full" / "wmt14_full.en-de.ref"
    cached.write_text("Ein Test.\nDrei Tests.\n", encoding="utf-8")
    by_name = score_files(hyp, "wmt14/full", "en-de")
    by_file = score_files(hyp, cached, "en-de")
    assert by_name["bleu"] == by_file["bleu"] and by_name["ref"] == [str(cached)]
    # through mt-evaluate, the language pair comes from data.src_lang/tgt_lang
    overrides = [f"hyp={hyp}", "ref=wmt14/full", "data.src_lang=en", "data.tgt_lang=de"]
    cfg = load_config(overrides, command="evaluate")
    assert evaluate_main(cfg)["bleu"] == by_file["bleu"]


def test_report_lists_every_metric_and_labels_the_compound_split_score():
    from mt.evaluation.report import _results_section

    result = score(["Der Dax stieg."], ["Der Dax-Index stieg."], metrics=["chrf++", "ter"],
                   compound_split_lang="de")  # fmt: skip
    text = "\n".join(_results_section(result))
    assert "| chrF++ |" in text and "| TER |" in text and "| BLEU |" not in text
    assert "nw:2" in text and "NOT comparable with sacreBLEU" in text
