"""The hub presets (wmt14, wmt16, iwslt2017, multi30k's bentrevett/multi30k) read offline from a
local copy in each dataset's hub layout: the same folders, file names, dataset card configs,
column names and split names as the hub repository (the preset's settings, only
``data.hf_path`` pointed at the copy), through mt's real loading path (``datasets``' builder)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mt.config import load_config
from mt.data.corpus import DataError, open_corpus

WORDS = "ein der die und mann frau hund katze läuft spielt im park auf dem gras rot".split()
WORDS_EN = "a the and man woman dog cat runs plays in park on grass red blue big".split()


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [
        (" ".join(rng.choices(WORDS, k=rng.randint(3, 9))),
         " ".join(rng.choices(WORDS_EN, k=rng.randint(3, 9))))
        for _ in range(n)
    ]  # fmt: skip


SPLITS = {"train": _pairs(240, 1), "validation": _pairs(12, 2), "test": _pairs(10, 3)}


def _parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _translation(pairs, de_first: bool = True) -> list[dict]:
    return [{"translation": {"de": de, "en": en}} for de, en in pairs]


# wmt/wmt14 and wmt/wmt16 on main (their "Convert dataset to Parquet" commits): a folder per
# language pair, the train split in three shards, and the dataset card's YAML naming configs.
WMT_CARD = """---
dataset_info:
{infos}
configs:
{configs}
---
# Dataset Card for {name}
"""


def wmt_repo(root: Path, name: str, pairs=("cs-en", "de-en")) -> Path:
    repo = root / name
    infos, configs = [], []
    for pair in pairs:
        a, b = pair.split("-")
        infos.append(
            f"- config_name: {pair}\n  features:\n  - name: translation\n    dtype:\n"
            f"      translation:\n        languages:\n        - {a}\n        - {b}"
        )
        configs.append(
            f"- config_name: {pair}\n  data_files:\n"
            + "".join(f"  - split: {s}\n    path: {pair}/{s}-*\n" for s in SPLITS)
        )
        for split, rows in SPLITS.items():
            if pair != "de-en":  # another pair's text: the config must choose the folder
                rows = [(f"{a} {x}", f"{b} {y}") for x, y in rows]
                data = [{"translation": {a: x, b: y}} for x, y in rows]
            else:
                data = _translation(rows)
            shards = 3 if split == "train" else 1
            for k in range(shards):
                part = data[k::shards] if shards == 1 else data[k * 80 : (k + 1) * 80]
                _parquet(repo / pair / f"{split}-{k:05d}-of-{shards:05d}.parquet", part)
    card = WMT_CARD.format(infos="\n".join(infos), configs="".join(configs).rstrip(), name=name)
    (repo / "README.md").write_text(card, encoding="utf-8")
    return repo


def iwslt_parquet_export(root: Path) -> Path:
    """IWSLT/iwslt2017's ``refs/convert/parquet`` branch: ``<config>/iwslt2017-<split>.parquet``
    (no dataset card), a translation column of {de, en}."""
    repo = root / "iwslt2017"
    for config in ("iwslt2017-de-en", "iwslt2017-en-de"):
        for split, rows in SPLITS.items():
            rows = rows if config == "iwslt2017-de-en" else [(y, x) for x, y in rows]
            _parquet(repo / config / f"iwslt2017-{split}.parquet", _translation(rows))
    return repo


def multi30k_repo(root: Path) -> Path:
    """bentrevett/multi30k: train.jsonl, val.jsonl, test.jsonl of {"en": ..., "de": ...}."""
    repo = root / "multi30k"
    repo.mkdir(parents=True)
    for split, name in (("train", "train"), ("validation", "val"), ("test", "test")):
        lines = [json.dumps({"en": en, "de": de}, ensure_ascii=False) for de, en in SPLITS[split]]
        (repo / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (repo / "README.md").write_text(
        "---\ntask_categories:\n- translation\nlanguage:\n- en\n- de\n---\n# Multi30k\n"
    )
    return repo


def _cfg(preset: str, repo: Path, tmp_path: Path, *extra: str):
    return load_config(
        [
            f"data={preset}",
            f"data.hf_path={repo}",
            f"cache_dir={tmp_path / 'cache'}",
            f"data.dir={tmp_path / 'no-local-copy'}",
            *extra,
        ]  # fmt: skip
    )


@pytest.mark.parametrize("preset", ["wmt14", "wmt16"])
def test_wmt_presets_read_the_hub_layout(preset, tmp_path):
    cfg = _cfg(preset, wmt_repo(tmp_path, preset), tmp_path)
    assert cfg.data.hf_name == "de-en" and cfg.data.src_lang == "en"
    corpus = open_corpus(cfg.data, str(tmp_path / "hf"))
    assert list(corpus.pairs("train")) == [(en, de) for de, en in SPLITS["train"]]
    assert list(corpus.pairs("valid")) == [(en, de) for de, en in SPLITS["validation"]]
    assert list(corpus.pairs("test")) == [(en, de) for de, en in SPLITS["test"]]


def test_iwslt2017_preset_reads_the_parquet_export(tmp_path):
    cfg = _cfg("iwslt2017", iwslt_parquet_export(tmp_path), tmp_path)
    assert cfg.data.revision == "refs/convert/parquet"
    corpus = open_corpus(cfg.data, str(tmp_path / "hf"))
    for role, split in (("train", "train"), ("valid", "validation"), ("test", "test")):
        assert list(corpus.pairs(role)) == SPLITS[split]


def test_multi30k_hub_copy_reads_its_columns_and_splits(tmp_path):
    cfg = _cfg("multi30k", multi30k_repo(tmp_path), tmp_path)
    corpus = open_corpus(cfg.data, str(tmp_path / "hf"))  # auto: no local folder, the hub copy
    for role, split in (("train", "train"), ("valid", "validation"), ("test", "test")):
        assert list(corpus.pairs(role)) == SPLITS[split]


def test_a_script_dataset_is_refused_in_one_line_naming_a_parquet_copy(tmp_path):
    repo = tmp_path / "iwslt2017"
    repo.mkdir()
    (repo / "iwslt2017.py").write_text("import datasets\n")  # the hub's main branch: a script
    cfg = _cfg("iwslt2017", repo, tmp_path, "data.revision=null", "data.hf_data_dir=null")
    with pytest.raises(DataError) as err:
        open_corpus(cfg.data, str(tmp_path / "hf"))
    message = str(err.value)
    assert "\n" not in message and "loading-script dataset" in message
    assert "refs/convert/parquet" in message and "data.hf_data_dir" in message


TINY = ["tokenizer.vocab_size=60", "tokenizer.byte_fallback=false", "tokenizer.threads=1",
        "data.clean.max_pieces=0", "data.clean.max_piece_ratio=0"]  # fmt: skip


def _hub_cache(repo: Path, hf_cache: Path, commit: str) -> None:
    """``datasets``' cache of wmt/wmt14 de-en at ``commit``, as a download leaves it."""
    import shutil

    import datasets

    builder = datasets.load_dataset_builder(str(repo), "de-en", cache_dir=str(repo / ".build"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    shutil.copytree(built, hf_cache / "wmt___wmt14" / "de-en" / built.parent.name / commit)
    shutil.rmtree(repo / ".build")


def test_the_hub_revision_is_in_the_cache_key_and_the_meta(tmp_path, monkeypatch):
    """The preset as it is (wmt/wmt14, de-en), offline: datasets reads its latest cached copy
    and reports that copy's commit; a newer commit is other prepared data."""
    import os

    import datasets
    import huggingface_hub.constants

    from mt.data.build import prepare

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = load_config(["data=wmt14", f"cache_dir={tmp_path / 'cache'}", *TINY])
    assert cfg.data.hf_path == "wmt/wmt14" and cfg.data.hf_name == "de-en"
    repo = wmt_repo(tmp_path, "wmt14", pairs=("de-en",))
    _hub_cache(repo, tmp_path / "cache" / "hf", "a" * 40)
    first = prepare(cfg)
    assert first.meta["revision"] == "a" * 40
    assert first.split("train").src.offsets.shape == (241,)
    assert prepare(cfg).dir == first.dir  # the same revision: a cache hit
    _parquet(repo / "de-en" / "train-00000-of-00003.parquet", _translation(SPLITS["train"][:5]))
    _hub_cache(repo, tmp_path / "cache" / "hf", "b" * 40)
    newer = tmp_path / "cache" / "hf" / "wmt___wmt14" / "de-en"
    for p in newer.glob("*/" + "b" * 40):
        os.utime(p, (p.stat().st_atime + 60, p.stat().st_mtime + 60))
    second = prepare(cfg)
    assert second.meta["revision"] == "b" * 40 and second.dir != first.dir
    assert second.split("train").src.offsets.shape == (241 - 75,)


def test_a_changed_local_copy_is_other_prepared_data(tmp_path):
    from mt.data.build import prepare

    repo = wmt_repo(tmp_path, "wmt14", pairs=("de-en",))
    cfg = _cfg("wmt14", repo, tmp_path, *TINY)
    first = prepare(cfg)
    assert first.meta["revision"] is None  # a local folder: its files' identity is in the key
    assert prepare(cfg).dir == first.dir
    _parquet(repo / "de-en" / "train-00000-of-00003.parquet", _translation(SPLITS["train"][:5]))
    assert prepare(cfg).dir != first.dir
