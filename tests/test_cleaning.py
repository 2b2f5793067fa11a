"""WMT cleaning: Moses normalisation, duplicates, piece filters, their counts, the cache key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mt.data.cleaning as cleaning
from mt.config import load_config
from mt.data.build import cache_key, prepare
from mt.data.cleaning import NormSpec, TextNormalizer, drop_encoded, normalize_pairs, piece_filter

WMT_CLEAN = [
    "data.clean.dedup=true",
    "data.clean.moses_punct=true",
    "data.clean.remove_non_printing=true",
    "data.clean.max_pieces=250",
    "data.clean.max_piece_ratio=1.5",
]


def test_moses_punctuation_and_non_printing():
    both = TextNormalizer(NormSpec("de", moses_punct=True, remove_non_printing=True))
    # Moses rules: German low/high quotes -> ", the ellipsis -> ..., the en dash -> -,
    # runs of spaces -> one.
    assert both("„Ja“,  sagte er … – gut") == '"Ja", sagte er ... - gut'
    # Unicode category C (format and control characters) removed, then stripped.
    assert both("Wort\u200bteil\x07 ende\u00ad") == "Wortteil ende"
    only_punct = TextNormalizer(NormSpec("de", moses_punct=True))
    assert only_punct("a\u200bb") == "a\u200bb"
    assert TextNormalizer(NormSpec("en"))(" „x“ ") == "„x“"  # both off: NFC + strip only
    assert TextNormalizer(NormSpec("de", nfc=True))("Cafe\u0301") == "Caf\u00e9"
    text, punct, nonprint = both.steps("plain text")
    assert (text, punct, nonprint) == ("plain text", False, False)


def test_normalize_pairs_counts_and_parallel_equals_serial(monkeypatch):
    pairs = [("„a“", "b"), ("x\x07y", "z"), ("ok", "ok")] * 5
    specs = (NormSpec("de", moses_punct=True, remove_non_printing=True),) * 2
    serial_counts: dict[str, int] = {}
    serial = list(normalize_pairs(iter(pairs), specs, serial_counts, workers=1))
    assert serial[:3] == [('"a"', "b"), ("xy", "z"), ("ok", "ok")]
    assert serial_counts == {"moses_punct": 5, "non_printing": 5}
    monkeypatch.setattr(cleaning, "CHUNK_PAIRS", 4)  # several chunks over two processes
    parallel_counts: dict[str, int] = {}
    parallel = list(normalize_pairs(iter(pairs), specs, parallel_counts, workers=2))
    assert parallel == serial and parallel_counts == serial_counts


def test_piece_filter_follows_clean_corpus_n():
    src = np.array([10, 15, 16, 0, 251, 250, 3, 4])
    tgt = np.array([10, 10, 10, 5, 250, 250, 2, 7])
    keep, counts = piece_filter(src, tgt, max_pieces=250, max_ratio=1.5)
    # 15/10 = 1.5 is kept (the rule is "> ratio"), 16/10 dropped; 0 pieces: empty;
    # 251 > 250: too long; 3/2 = 1.5 kept; 7/4 = 1.75 dropped.
    assert keep.tolist() == [True, True, False, False, False, True, True, False]
    assert counts == {"piece_empty": 1, "piece_max_len": 1, "piece_ratio": 2}
    keep, counts = piece_filter(src, tgt, max_pieces=0, max_ratio=0)
    assert keep.tolist() == [True, True, True, False, True, True, True, True]


def test_drop_encoded_keeps_the_selected_sequences_in_order(tmp_path):
    seqs = [[5, 6], [], [7], [8, 9, 10], [11]]
    prefix = tmp_path / "x"
    np.concatenate([np.array(s, dtype=np.uint16) for s in seqs]).tofile(f"{prefix}.ids")
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    offsets.tofile(f"{prefix}.off")
    keep = np.array([True, True, False, True, False])
    drop_encoded([str(prefix)], keep, "uint16", block=2)  # blocks cut through the sequences
    ids = np.fromfile(f"{prefix}.ids", dtype=np.uint16).tolist()
    off = np.fromfile(f"{prefix}.off", dtype=np.int64).tolist()
    assert off == [0, 2, 2, 5]
    assert [ids[a:b] for a, b in zip(off, off[1:])] == [[5, 6], [], [8, 9, 10]]


def _corpus(d: Path) -> Path:
    d.mkdir()
    de = [f"der satz nummer {i} ist hier" for i in range(150)]
    en = [f"the sentence number {i} is here" for i in range(150)]
    de += ["der satz nummer 1 ist hier"] * 3  # exact duplicates of pair 1
    en += ["the sentence number 1 is here"] * 3
    de += ["„zitat“  hier\u200b"]  # changed by Moses punctuation and non-printing removal
    en += ["quote here"]
    de += ["kurz da"]  # 2 words vs 6: within the word ratio 3, beyond the piece ratio 1.5
    en += ["a much longer english side here"]
    files = {
        "train.de": de,
        "train.en": en,
        "valid.de": ["„ein“ Hund\x07", "zwei"],
        "valid.en": ["„a“ dog", "two"],
        "test.de": ["drei"],
        "test.en": ["three"],
    }
    for name, ls in files.items():
        (d / name).write_text("".join(s + "\n" for s in ls), encoding="utf-8")
    return d


def _cfg(d: Path, tmp_path: Path, *extra: str):
    return load_config(
        ["data=local", f"data.dir={d}", f"cache_dir={tmp_path / 'cache'}",
         "tokenizer.vocab_size=300", "tokenizer.threads=1", *extra]
    )  # fmt: skip


def test_prepare_counts_every_filter_and_normalises_sources(tmp_path):
    d = _corpus(tmp_path / "c")
    p = prepare(_cfg(d, tmp_path, *WMT_CLEAN))
    clean = p.meta["counts"]["train"]["clean"]
    assert clean["read"] == 155 and clean["duplicate"] == 3
    assert clean["moses_punct"] == 1 and clean["non_printing"] == 1
    assert clean["piece_ratio"] >= 1 and clean["piece_max_len"] == 0
    kept = clean["kept"] - clean["piece_ratio"] - clean["piece_empty"]
    assert p.meta["counts"]["train"]["pairs"] == kept == len(p.split("train"))
    meta = json.loads((p.dir / "meta.json").read_text())
    assert meta["tokenizer"]["seed"] == 1 and meta["tokenizer"]["shuffle"] is True
    assert meta["tokenizer_sha256"] == p.tokenizer.sha256()
    # Valid sources are encoded as normalised text; the references stay raw for sacreBLEU.
    src = p.tokenizer.decode([p.split("valid").src[0].tolist()], "src")
    assert src == ['"ein" Hund']
    assert p.references("valid") == ["„a“ dog", "two"]
    train_src = p.tokenizer.decode([a.tolist() for a in p.split("train").src], "src")
    assert "kurz da" not in train_src
    assert not any("„" in s or "\u200b" in s for s in train_src)
    no_piece_filters = prepare(_cfg(d, tmp_path, *WMT_CLEAN[:3]))
    train_src = no_piece_filters.tokenizer.decode(
        [a.tolist() for a in no_piece_filters.split("train").src], "src"
    )
    assert '"zitat" hier' in train_src and "kurz da" in train_src
    assert len(train_src) == 152  # 155 read, 3 duplicates
    # Off (the default): none of this happens.
    plain = prepare(_cfg(d, tmp_path))
    assert plain.meta["counts"]["train"]["clean"]["duplicate"] == 0
    assert len(plain.split("train")) == 155


@pytest.mark.parametrize(
    "override",
    [*WMT_CLEAN, "tokenizer.seed=2", "tokenizer.shuffle=false",
     "tokenizer.character_coverage=0.9995"],  # fmt: skip
)
def test_every_output_setting_is_in_the_cache_key(tmp_path, override):
    d = _corpus(tmp_path / "c")
    assert cache_key(_cfg(d, tmp_path, override)) != cache_key(_cfg(d, tmp_path))


@pytest.mark.parametrize("lang", ["de", "en"])
def test_fast_moses_punct_equals_sacremoses_on_news_text(real_data, lang):
    from sacremoses import MosesPunctNormalizer

    lines = (real_data / "wmt14" / f"newstest2013.{lang}").read_text("utf-8").split("\n")[:-1]
    tricky = ["a  b", "x ( y ) .", "„q“ –  r …", "5 %", 'er sagte."x', "it’s", "a\u00a0»b«\u00a0"]
    lines = lines + tricky + [a + "  " + b for a, b in zip(lines[::2], lines[1::2])]
    reference = MosesPunctNormalizer(lang=lang)
    # a line for each rule: its pattern's text with regex syntax filled in (and mixed in news)
    for pattern, _ in reference.substitutions:
        filled = pattern.replace("\\", "").replace("(\\d)", "7").replace("([a-zA-Z])", "x")
        for probe in (pattern, filled, "3\u00a04 x‘y ..\" z (a) , b", ") ."):
            lines += [probe, f"{lines[0]} {probe} {lines[1]}", f"{probe}  {probe}"]
    fast = cleaning.MosesPunct(lang)
    changed = [s for s in lines if reference.normalize(s) != s.strip()]
    assert len(changed) > 100  # the probes reach the rules
    assert [fast.normalize(s) for s in lines] == [reference.normalize(s) for s in lines]


def test_fast_control_char_removal_equals_sacremoses():
    from sacremoses import MosesPunctNormalizer

    reference = MosesPunctNormalizer(lang="en")
    fast = cleaning.MosesPunct("en")
    lines = ["plain text", "tab\there", "nbsp\u00a0here", "zero\u200bwidth", "bom\ufeffx",
             "bell\x07", "line\u2028sep", "priv\ue000ate", "unassigned\U000e0fff", "ok ü ß"]
    assert [fast.remove_control_chars(s) for s in lines] == [
        reference.remove_control_chars(s) for s in lines
    ]


def test_bad_input_under_the_moses_pass_names_the_file(tmp_path, monkeypatch):
    from mt.data.corpus import DataError

    d = _corpus(tmp_path / "c")
    (d / "train.de").write_bytes((d / "train.de").read_bytes() + b"kaputt \xff\n")
    (d / "train.en").write_bytes((d / "train.en").read_bytes() + b"broken\n")
    monkeypatch.setattr(cleaning, "CHUNK_PAIRS", 16)  # the error surfaces from a worker chunk
    with pytest.raises(DataError, match=r"train\.de, line 156: not valid UTF-8"):
        prepare(_cfg(d, tmp_path, *WMT_CLEAN, "tokenizer.threads=2"))
    assert not list((tmp_path / "cache").glob("local-*"))


def test_a_normaliser_that_cannot_start_stops_this_process_not_a_pool(monkeypatch):
    """A missing dependency (sacremoses without joblib) raises here, with its message: in a
    pool's initializer it failed in worker after new worker, and `mt-prepare` hung."""

    def broken(self, lang):
        raise ModuleNotFoundError("No module named 'joblib'")

    monkeypatch.setattr(cleaning.MosesPunct, "__init__", broken)
    specs = (NormSpec("de", moses_punct=True), NormSpec("en", moses_punct=True))
    with pytest.raises(ModuleNotFoundError, match="joblib"):
        list(cleaning.normalize_pairs(iter([("a", "b")] * 10), specs, {}, workers=2))
