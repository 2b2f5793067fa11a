"""Stage 1: reading every source, bad input with clear errors, and the joint cleaning rules."""

from __future__ import annotations

import json
import logging
import unicodedata
from pathlib import Path

import pytest

from mt.config import load_config
from mt.data import cleaning
from mt.data.cleaning import Cleaner, DigestSet
from mt.data.corpus import DataError, count_lines, open_corpus, read_lines
from mt.schema import CleanConfig


def write(path: Path, lines: list[str] | bytes) -> Path:
    """Write lines ("\\n" terminated) or raw bytes."""
    data = lines if isinstance(lines, bytes) else "".join(s + "\n" for s in lines).encode()
    path.write_bytes(data)
    return path


def local_cfg(d: Path, *extra: str):
    return load_config(
        ["data=local", f"data.dir={d}", "data.splits.valid=valid", "data.splits.test=test", *extra]
    ).data


def corpus_dir(d: Path, pairs: dict[str, list[tuple[str, str]]], src="de", tgt="en") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for split, ps in pairs.items():
        write(d / f"{split}.{src}", [s for s, _ in ps])
        write(d / f"{split}.{tgt}", [t for _, t in ps])
    return d


TRAIN = [("ein Hund", "a dog"), ("zwei Katzen", "two cats"), ("drei Vögel", "three birds")]
VALID = [("hallo", "hello")]
TEST = [("danke", "thanks"), ("bitte", "please")]


@pytest.fixture
def small(tmp_path):
    return corpus_dir(tmp_path / "c", {"train": TRAIN, "valid": VALID, "test": TEST})


# ---- reading lines ------------------------------------------------------------------------------
def test_lines_split_on_newline_only(tmp_path):
    odd = ["a\u2028b", "c\x85d", "e\u2029f\x1cg\x1dh\x1ei\x0bj\x0ck", "\rl"]
    path = write(tmp_path / "x", odd)
    assert list(read_lines(path)) == odd
    assert count_lines(path) == len(odd)
    assert len("".join(s + "\n" for s in odd).splitlines()) > len(odd)  # what we avoid


def test_last_line_without_newline_and_crlf(tmp_path):
    path = write(tmp_path / "x", b"one\r\ntwo\nthree")
    assert list(read_lines(path)) == ["one", "two", "three"]
    assert count_lines(path) == 3


def test_bad_utf8_names_file_and_line(tmp_path, small):
    write(small / "train.en", b"a dog\ntwo cats\nthree \xff birds\n")
    with pytest.raises(DataError, match=r"train\.en, line 3: not valid UTF-8"):
        list(open_corpus(local_cfg(small)).pairs("train"))


def test_replace_mode_warns_with_count(tmp_path, small, caplog):
    write(small / "train.en", b"a \xfe dog\ntwo cats\nthree \xff\xff birds\n")
    with caplog.at_level(logging.WARNING):
        pairs = list(open_corpus(local_cfg(small, "data.errors=replace")).pairs("train"))
    assert [t for _, t in pairs] == ["a \ufffd dog", "two cats", "three \ufffd\ufffd birds"]
    assert "replaced invalid UTF-8 bytes on 2 line(s)" in caplog.text
    assert "train.en" in caplog.text


def test_mismatched_line_counts_name_both_files(small):
    write(small / "test.en", ["thanks"])
    with pytest.raises(DataError) as err:
        open_corpus(local_cfg(small))
    msg = str(err.value)
    assert f"{small / 'test.de'} has 2 lines" in msg and f"{small / 'test.en'} has 1 lines" in msg


def test_missing_split_lists_what_exists(small):
    with pytest.raises(DataError) as err:
        open_corpus(local_cfg(small, "data.splits.valid=dev"))
    msg = str(err.value)
    assert "dev.de" in msg and "['test', 'train', 'valid']" in msg and "['de', 'en']" in msg


def test_missing_language_lists_what_exists(small):
    with pytest.raises(DataError) as err:
        open_corpus(local_cfg(small, "data.tgt_lang=fr"))
    assert "train.fr" in str(err.value) and "['de', 'en']" in str(err.value)


def test_missing_directory_says_what_to_set(tmp_path):
    with pytest.raises(DataError, match="data.dir"):
        open_corpus(local_cfg(tmp_path / "nowhere"))
    cfg = load_config([f"data.dir={tmp_path / 'nowhere'}", "data.hf_path=null"]).data
    assert cfg.source == "auto"
    with pytest.raises(DataError, match="MT_DATA_DIR") as err:
        open_corpus(cfg)
    assert "data.dir" in str(err.value)


def test_list_of_prefixes_concatenates(tmp_path, small):
    corpus_dir(small, {"extra": [("vier", "four"), ("fünf", "five")]})
    corpus = open_corpus(local_cfg(small, "data.splits.train=[train,extra]"))
    assert list(corpus.pairs("train")) == TRAIN + [("vier", "four"), ("fünf", "five")]
    assert list(corpus.pairs("valid")) == VALID and list(corpus.pairs("test")) == TEST


def test_tsv(tmp_path):
    d = tmp_path / "tsv"
    d.mkdir()
    for split, ps in {"train": TRAIN, "valid": VALID, "test": TEST}.items():
        write(d / f"{split}.tsv", [f"{s}\t{t}" for s, t in ps])
    corpus = open_corpus(local_cfg(d, "data.format=tsv"))
    assert list(corpus.pairs("train")) == TRAIN and list(corpus.pairs("test")) == TEST
    write(d / "test.tsv", ["danke\tthanks", "bitte please"])
    with pytest.raises(DataError, match=r"test\.tsv, line 2: expected 2 tab-separated"):
        list(open_corpus(local_cfg(d, "data.format=tsv")).pairs("test"))


def test_real_multi30k_matches_files(real_data):
    cfg = load_config([f"data.dir={real_data / 'multi30k'}"]).data
    pairs = list(open_corpus(cfg).pairs("valid"))
    de = (real_data / "multi30k" / "val.de").read_bytes().decode().split("\n")[:-1]
    en = (real_data / "multi30k" / "val.en").read_bytes().decode().split("\n")[:-1]
    assert pairs == list(zip(de, en))


# ---- the Hugging Face path on local parquet / JSON files ----------------------------------------
def _hf_files(d: Path, fmt: str, schema: str) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir()
    files = {}
    for split, ps in {"train": TRAIN, "validation": VALID, "test": TEST}.items():
        if schema == "translation":
            rows = [{"translation": {"de": s, "en": t}} for s, t in ps]
        else:
            rows = [{"de": s, "en": t} for s, t in ps]
        path = d / f"{split}.{fmt}"
        if fmt == "json":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        else:
            pq.write_table(pa.Table.from_pylist(rows), path)
        files[split] = str(path)
    return files


def hf_cfg(files: dict[str, str], fmt: str, schema: str, *extra: str):
    spec = "{" + ",".join(f"{k}:'{v}'" for k, v in files.items()) + "}"
    return load_config(
        [
            "data=wmt14",
            "data.src_lang=de",
            "data.tgt_lang=en",
            f"data.hf_path={fmt}",
            "data.hf_name=null",
            f"data.hf_schema={schema}",
            f"data.hf_data_files={spec}",
            *extra,
        ]
    ).data


@pytest.mark.parametrize("fmt", ["parquet", "json"])
@pytest.mark.parametrize("schema", ["translation", "columns"])
def test_hf_local_files_both_schemas(tmp_path, fmt, schema):
    files = _hf_files(tmp_path / "hf", fmt, schema)
    corpus = open_corpus(hf_cfg(files, fmt, schema), hf_cache_dir=str(tmp_path / "hfc"))
    assert list(corpus.pairs("train")) == TRAIN
    assert list(corpus.pairs("valid")) == VALID and list(corpus.pairs("test")) == TEST


def test_hf_missing_split_and_language_list_what_exists(tmp_path):
    files = _hf_files(tmp_path / "hf", "parquet", "translation")
    cache = str(tmp_path / "hfc")
    with pytest.raises(DataError, match=r"found \['de', 'en'\]"):
        open_corpus(hf_cfg(files, "parquet", "translation", "data.src_lang=fr"), cache)
    bad = hf_cfg(files, "parquet", "translation", "data.splits.valid=dev")
    with pytest.raises(DataError, match=r"no split 'dev'.*\['test', 'train', 'validation'\]"):
        open_corpus(bad, cache)
    columns = _hf_files(tmp_path / "h2", "parquet", "columns")
    with pytest.raises(DataError, match="no 'translation' column"):
        open_corpus(hf_cfg(columns, "parquet", "translation"), cache)


# ---- cleaning -----------------------------------------------------------------------------------
def test_cleaning_rules_counted_and_joint():
    long = " ".join(["w"] * 11)
    pairs = [
        ("  Caf\u0065\u0301  ", "coffee "),  # kept, NFC + strip
        ("", "empty source"),  # empty
        ("only target empty", "   "),  # empty after strip
        (long, "ten " * 9 + "x"),  # max_len (11 > 10)
        ("eins", "one two three four"),  # max_ratio 4 > 3
        ("ein zwei", "one two three four five six"),  # ratio 3.0: kept
        ("Caf\u00e9", "coffee"),  # duplicate of the first after normalisation
        ("b", "c"),  # kept
    ]
    cleaner = Cleaner(CleanConfig(max_len=10, max_ratio=3.0, dedup=True))
    kept = list(cleaner(iter(pairs)))
    assert kept == [("Caf\u00e9", "coffee"), pairs[5], ("b", "c")]
    assert unicodedata.is_normalized("NFC", kept[0][0])
    assert cleaner.counts == {
        "read": 8, "empty": 2, "min_len": 0, "max_len": 1, "max_ratio": 1, "duplicate": 1,
        "kept": 3,
    }  # fmt: skip


def test_dedup_in_blocks_keeps_the_first_of_each_pair_in_order(monkeypatch):
    """Blocks of 7 pairs (so duplicates cross blocks and the digest runs merge many times)
    keep what a pair-by-pair pass over the exact text keeps, in the same order."""
    import random

    rng = random.Random(3)
    words = "a b c d e f".split()
    pairs = [(" ".join(rng.choices(words, k=rng.randint(1, 3))), rng.choice(words), i % 3)
             for i in range(3000)]  # fmt: skip
    pairs += [("x " * 60, "y", 0)] * 5  # max_ratio drops: never seen, never duplicates
    rng.shuffle(pairs)
    seen, expected = set(), []
    for src, tgt, part in pairs:
        if max(len(src.split()), 1) <= 3 * max(len(tgt.split()), 1) and (src, tgt) not in seen:
            seen.add((src, tgt))
            expected.append((src, tgt, part))
    monkeypatch.setattr(cleaning, "DEDUP_BLOCK", 7)
    cleaner = Cleaner(CleanConfig(max_len=0, max_ratio=3.0, dedup=True))
    assert list(cleaner(iter(pairs))) == expected
    assert 150 < len(expected) < 1000  # duplicates were there to drop
    c = cleaner.counts
    assert c["kept"] == len(expected) and c["max_ratio"] == 5
    assert c["duplicate"] == len(pairs) - 5 - len(expected) and c["read"] == len(pairs)
    assert len(cleaner._seen) == len(expected) and len(cleaner._seen._runs) <= 12


def test_dedup_memory_is_8_bytes_a_kept_pair_not_a_python_object():
    import tracemalloc

    n = 100_000
    cleaner = Cleaner(CleanConfig(max_len=0, max_ratio=0.0, dedup=True))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = sum(1 for _ in cleaner((f"s{i}", f"t{i}", 0) for i in range(n)))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept == n
    assert held < 10 * n + (1 << 16), f"{held / n:.1f} bytes a pair held after cleaning"


def test_digest_set_matches_a_python_set_across_merges():
    import numpy as np

    rng = np.random.default_rng(0)
    digests, reference = DigestSet(), set()
    for size in rng.integers(0, 50, size=200):
        keys = rng.integers(0, 400, size=size).astype(np.uint64)
        want = []
        for k in keys.tolist():
            want.append(k not in reference)
            reference.add(k)
        assert digests.first_seen(keys).tolist() == want
    assert len(digests) == len(reference)
    assert all(np.all(r[:-1] < r[1:]) for r in digests._runs)  # sorted, no repeats


def test_cleaning_min_len_no_dedup_no_ratio():
    pairs = [("a", "b c"), ("a b", "c d"), ("a b", "c d"), ("x " * 50, "y")]
    cleaner = Cleaner(CleanConfig(min_len=2, max_len=0, max_ratio=0.0, dedup=False))
    assert list(cleaner(iter(pairs))) == [("a b", "c d"), ("a b", "c d")]
    assert cleaner.counts["min_len"] == 2 and cleaner.counts["kept"] == 2
    nfc_off = Cleaner(CleanConfig(normalize=False))
    assert list(nfc_off(iter([(" e\u0301 ", "x")]))) == [("e\u0301", "x")]


def test_auto_uses_hf_when_no_local_dir_and_says_what_to_set_when_both_fail(tmp_path):
    files = _hf_files(tmp_path / "hf", "json", "columns")
    no_dir = f"data.dir={tmp_path / 'nowhere'}"
    cfg = hf_cfg(files, "json", "columns", "data.source=auto", no_dir)
    assert list(open_corpus(cfg, str(tmp_path / "hfc")).pairs("test")) == TEST
    files["test"] = str(tmp_path / "missing.json")
    cfg = hf_cfg(files, "json", "columns", "data.source=auto", no_dir)
    with pytest.raises(DataError, match="MT_DATA_DIR") as err:
        open_corpus(cfg, str(tmp_path / "hfc"))
    assert "data.dir=PATH" in str(err.value) and "'json'" in str(err.value)
