"""Stages 1-2 end to end: cached, atomic, memory-mapped encoded splits that decode back."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import mt.data.build as prep
from mt.config import load_config
from mt.data.build import prepare
from mt.data.corpus import DataError
from mt.data.encode import encode_files
from mt.data.store import TokenArray
from mt.data.tokenizer import Tokenizer

FAST = ["tokenizer.vocab_size=1000", "tokenizer.threads=1"]


def lines(path: Path, n: int | None = None) -> list[str]:
    return path.read_bytes().decode("utf-8").split("\n")[:-1][:n]


def norm(s: str) -> str:
    return unicodedata.normalize("NFC", s).strip()


def m30k_cfg(real_data, tmp_path, *extra):
    return load_config(
        [
            f"data.dir={real_data / 'multi30k'}",
            f"cache_dir={tmp_path / 'cache'}",
            "data.max_train_pairs=2000",
            *FAST,
            *extra,
        ]
    )


def small_cfg(d: Path, tmp_path: Path, *extra):
    return load_config(
        [
            "data=local",
            f"data.dir={d}",
            "data.splits.valid=valid",
            "data.splits.test=test",
            f"cache_dir={tmp_path / 'cache'}",
            *FAST,
            *extra,
        ]
    )


def small_corpus(d: Path) -> Path:
    d.mkdir()
    train = [f"satz {i} mit wörtern" for i in range(200)]
    files = {
        "train.de": train,
        "train.en": [f"sentence {i} with words" for i in range(200)],
        "valid.de": ["ein\u2028Hund", "  zwei Katzen "],  # raw, as in the file
        "valid.en": ["a\x85dog", "two cats  "],
        "test.de": ["Cafe\u0301"],
        "test.en": ["coffee"],
    }
    for name, ls in files.items():
        (d / name).write_bytes("".join(s + "\n" for s in ls).encode())
    return d


@pytest.fixture(scope="module")
def m30k(real_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("m30k")
    cfg = m30k_cfg(real_data, tmp)
    return cfg, prepare(cfg)


def test_multi30k_slice_decodes_to_the_cleaned_text(m30k, real_data):
    cfg, p = m30k
    de = lines(real_data / "multi30k" / "train.de", 2000)
    en = lines(real_data / "multi30k" / "train.en", 2000)
    kept = []
    for s, t in zip(map(norm, de), map(norm, en)):
        ns, nt = len(s.split()), len(t.split())
        if s and t and max(ns, nt) <= 250 and max(ns, nt) <= 3.0 * min(ns, nt):
            kept.append((s, t))
    train = p.split("train")
    assert len(train) == len(kept) == p.meta["counts"]["train"]["pairs"]
    assert 1900 < len(kept) <= 2000  # the slice
    src = p.tokenizer.decode([a.tolist() for a in train.src], side="src")
    tgt = p.tokenizer.decode([a.tolist() for a in train.tgt], side="tgt")
    assert list(zip(src, tgt)) == kept
    assert p.vocab_size == p.tokenizer.vocab_size == 1000


@pytest.mark.parametrize("role,prefix", [("valid", "val"), ("test", "test_2016_flickr")])
def test_valid_test_unfiltered_with_raw_references(m30k, real_data, role, prefix):
    _, p = m30k
    raw_de = lines(real_data / "multi30k" / f"{prefix}.de")
    raw_en = lines(real_data / "multi30k" / f"{prefix}.en")
    split = p.split(role)
    assert len(split) == len(raw_en)
    assert p.references(role) == raw_en and p.sources(role) == raw_de
    assert p.tokenizer.decode([a.tolist() for a in split.tgt]) == [norm(s) for s in raw_en]
    with pytest.raises(ValueError, match="valid and test only"):
        p.references("train")


def test_token_array_layout(m30k):
    _, p = m30k
    arr = p.split("valid").src
    assert arr.ids.dtype == np.uint16 and isinstance(arr.ids, np.memmap)
    assert arr.offsets.dtype == np.int64 and arr.offsets[0] == 0
    assert arr.lengths.tolist() == [len(arr[i]) for i in range(len(arr))]
    assert arr[0].dtype == np.int64 and np.array_equal(arr[-1], arr[len(arr) - 1])
    with pytest.raises(IndexError):
        arr[len(arr)]
    text = p.sources("valid")[:3]
    assert [a.tolist() for a in list(arr)[:3]] == p.tokenizer.encode([norm(s) for s in text])


def test_cache_hit_loads_only(m30k, monkeypatch):
    cfg, p = m30k
    before = {f.name: f.stat().st_mtime_ns for f in p.dir.iterdir()}

    def boom(*a, **k):
        raise AssertionError("rebuilt on a cache hit")

    monkeypatch.setattr(prep.Tokenizer, "train", boom)
    monkeypatch.setattr(prep, "open_corpus", boom)
    again = prepare(cfg)
    assert again.dir == p.dir
    assert {f.name: f.stat().st_mtime_ns for f in again.dir.iterdir()} == before
    assert len(again.split("train")) == len(p.split("train"))


def test_any_change_rebuilds(tmp_path):
    d = small_corpus(tmp_path / "c")
    base = prepare(small_cfg(d, tmp_path)).dir
    for extra in ["data.clean.max_ratio=2.0", "tokenizer.type=unigram", "data.max_train_pairs=50"]:
        assert prepare(small_cfg(d, tmp_path, extra)).dir != base
    assert prepare(small_cfg(d, tmp_path, "tokenizer.threads=2")).dir == base  # speed only
    os.utime(d / "test.en", ns=(1, 1))  # the input changed
    changed = prepare(small_cfg(d, tmp_path))
    assert changed.dir != base
    assert len(changed.split("train")) == 200


def test_small_corpus_keeps_separators_and_raw_lines(tmp_path):
    d = small_corpus(tmp_path / "c")
    p = prepare(small_cfg(d, tmp_path))
    assert p.sources("valid") == ["ein\u2028Hund", "  zwei Katzen "]
    assert p.references("valid") == ["a\x85dog", "two cats  "]
    assert p.tokenizer.decode([a.tolist() for a in p.split("valid").src], "src") == [
        "ein\u2028Hund",
        "zwei Katzen",
    ]
    assert p.tokenizer.decode([p.split("test").src[0].tolist()], "src") == ["Caf\u00e9"]
    assert p.meta["counts"]["train"]["clean"]["kept"] == 200


def test_interrupted_prepare_leaves_nothing_trusted(tmp_path, monkeypatch):
    d = small_corpus(tmp_path / "c")
    cfg = small_cfg(d, tmp_path)
    cache = Path(cfg.cache_dir)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "encode_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    assert [p.name for p in cache.iterdir() if p.name != "hf"] == []
    monkeypatch.undo()
    # A killed process leaves a half-written directory (no meta.json) under the final name.
    final = cache / f"local-{prep.cache_key(cfg)[:16]}"
    final.mkdir()
    (final / "train.src.ids").write_bytes(b"\x00")
    p = prepare(cfg)
    assert p.dir == final and json.loads((final / "meta.json").read_text())["key"]
    assert len(p.split("train")) == 200


def test_bad_input_builds_no_cache(tmp_path):
    d = small_corpus(tmp_path / "c")
    (d / "test.en").write_bytes(b"coffee\ntea\n")
    cfg = small_cfg(d, tmp_path)
    with pytest.raises(DataError, match="has 1 lines.*has 2 lines"):
        prepare(cfg)
    assert [p.name for p in Path(cfg.cache_dir).iterdir() if p.name != "hf"] == []


def test_parallel_encoding_equals_serial(m30k, real_data, tmp_path):
    _, p = m30k
    text = real_data / "multi30k" / "val.de"
    jobs_par = [(text, "src", tmp_path / "par"), (text, "tgt", tmp_path / "par2")]
    encode_files(p.tokenizer, jobs_par, "uint16", True, workers=2, chunk_bytes=4096)
    encode_files(p.tokenizer, [(text, "src", tmp_path / "ser")], "uint16", True, workers=1)
    par = TokenArray.open(tmp_path / "par.ids", tmp_path / "par.off", "uint16")
    ser = TokenArray.open(tmp_path / "ser.ids", tmp_path / "ser.off", "uint16")
    assert np.array_equal(par.ids, ser.ids) and np.array_equal(par.offsets, ser.offsets)
    expected = p.tokenizer.encode([norm(s) for s in lines(text)])
    assert [a.tolist() for a in ser] == expected


def test_hf_json_end_to_end(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    files = {}
    for split, n in {"train": 100, "validation": 3, "test": 2}.items():
        rows = [{"translation": {"en": f"{split} {i} words", "de": f"{split} {i} wörter"}}
                for i in range(n)]  # fmt: skip
        (d / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[split] = str(d / f"{split}.json")
    spec = "{" + ",".join(f"{k}:'{v}'" for k, v in files.items()) + "}"
    over = ["data=wmt14", "data.src_lang=en", "data.tgt_lang=de", "data.hf_path=json"]
    over += ["data.hf_name=null", f"data.hf_data_files={spec}", f"cache_dir={tmp_path / 'c'}"]
    cfg = load_config(over + FAST)
    p = prepare(cfg)
    assert len(p.split("train")) == 100 and p.references("test") == [
        "test 0 wörter",
        "test 1 wörter",
    ]
    assert p.sources("valid")[2] == "validation 2 words"
    assert Tokenizer.from_bytes(p.tokenizer.to_bytes()).vocab_size == p.vocab_size


def test_preparing_data_and_scoring_files_do_not_load_torch(tmp_path):
    """mt-prepare (and the stage timings it records for the report) and mt-evaluate's scoring
    of files need no torch: importing it cost 2-3 s of every start of those commands, most of a
    prepare that finds its cache."""
    import subprocess
    import sys

    code = ("import sys, mt.cli, mt.data.build, mt.evaluation.report, mt.evaluation.evaluate; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
