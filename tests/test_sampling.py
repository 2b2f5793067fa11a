"""Subword regularisation (``tokenizer.sampling_alpha``): sampled encodings of the training
split, made when preparing, each epoch reading its own; the text never changes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mt.config import load_config
from mt.data.batches import iterate_batches
from mt.data.build import cache_key, prepare
from mt.data.encode import Sampling, encode_files
from mt.data.store import TokenArray
from mt.train.recipe import train
from mt.train.state import TrainBatches, data_plan
from mt.vocab import PAD

SAMPLED = ["tokenizer.sampling_alpha=0.1", "tokenizer.sampled_copies=3"]


def m30k_cfg(real_data: Path, cache: Path, *extra: str):
    return load_config([
        "experiment=smoke", f"data.dir={real_data / 'multi30k'}", f"cache_dir={cache}",
        "data.max_train_pairs=600", "tokenizer.vocab_size=600", "tokenizer.threads=1", *extra,
    ])  # fmt: skip


@pytest.fixture(scope="module")
def sampled(real_data, tmp_path_factory):
    cache = tmp_path_factory.mktemp("sampling")
    plain = prepare(m30k_cfg(real_data, cache))
    return plain, prepare(m30k_cfg(real_data, cache, *SAMPLED))


def _texts(p, split) -> list[tuple[str, str]]:
    src = p.tokenizer.decode([a.tolist() for a in split.src], side="src")
    return list(zip(src, p.tokenizer.decode([a.tolist() for a in split.tgt], side="tgt")))


def test_each_sampled_encoding_holds_the_training_text_in_other_pieces(sampled):
    plain, p = sampled
    assert p.sampled_copies == 3 and plain.sampled_copies == 0
    assert p.tokenizer.sha256() == plain.tokenizer.sha256()  # one SentencePiece model
    text = _texts(plain, plain.split("train"))
    assert _texts(p, p.split("train")) == text  # the plain encoding is there too
    copies = [p.train_split(e) for e in range(3)]
    plain_ids = [a.tolist() for a in plain.split("train").tgt]
    for copy in copies:
        assert _texts(p, copy) == text  # pair for pair, the same sentences
        ids = [a.tolist() for a in copy.tgt]
        changed = sum(a != b for a, b in zip(ids, plain_ids)) / len(ids)
        assert 0.2 < changed < 1.0  # BPE-dropout re-splits some words of most sentences
        assert copy.tgt.lengths.sum() > plain.split("train").tgt.lengths.sum()  # fewer merges
    assert [a.tolist() for a in copies[0].src] != [a.tolist() for a in copies[1].src]
    assert p.train_split(4).src is copies[1].src  # epoch e reads copy e mod 3
    assert plain.train_split(4) is plain.split("train")
    # valid and test are never sampled
    for role in ("valid", "test"):
        assert np.array_equal(p.split(role).src.ids, plain.split(role).src.ids)


def test_bpe_dropout_at_alpha_0_is_the_plain_encoding_and_at_1_characters(sampled, real_data):
    _, p = sampled
    tok = p.tokenizer
    text = (real_data / "multi30k" / "val.de").read_text(encoding="utf-8").splitlines()[:200]
    text = [tok.normalize(s) for s in text]
    assert tok.sample(text, "src", 0.0, seed=5) == tok.encode(text, "src")
    # every merge dropped: one piece per character (spaces become "▁" pieces of their own)
    pieces = [tok.model("src").id_to_piece(i) for i in tok.sample(text[:20], "src", 1.0, 5)[0]]
    assert all(len(piece) == 1 for piece in pieces)
    assert "".join(pieces).replace("\u2581", " ").strip() == text[0]


def test_sampled_encodings_on_two_workers_hold_the_text(sampled, real_data, tmp_path):
    _, p = sampled
    text = real_data / "multi30k" / "val.de"

    def encode(name: str, workers: int, seed: int) -> TokenArray:
        job = (text, "src", tmp_path / name, None, Sampling(0.1, seed))
        encode_files(p.tokenizer, [job], "uint16", True, workers=workers, chunk_bytes=4096)
        return TokenArray.open(tmp_path / f"{name}.ids", tmp_path / f"{name}.off", "uint16")

    plain = [p.tokenizer.normalize(s) for s in text.read_text(encoding="utf-8").splitlines()]
    two = encode("two", 2, 7)
    assert p.tokenizer.decode([a.tolist() for a in two], side="src") == plain
    assert [a.tolist() for a in two] != p.tokenizer.encode(plain, "src")
    # one process, one seed: the same draw (SentencePiece's generator, seeded per call)
    assert np.array_equal(encode("a", 1, 7).ids, encode("b", 1, 7).ids)
    assert not np.array_equal(encode("a", 1, 7).offsets, encode("c", 1, 8).offsets)


def test_the_piece_filter_keeps_the_same_pairs_in_every_encoding(real_data, tmp_path):
    cfg = m30k_cfg(real_data, tmp_path, *SAMPLED, "data.clean.max_pieces=20")
    p = prepare(cfg)
    kept = p.meta["counts"]["train"]
    assert kept["clean"]["piece_max_len"] > 0 and len(p.split("train")) == kept["pairs"]
    text = _texts(p, p.split("train"))
    for e in range(3):
        assert _texts(p, p.train_split(e)) == text


def test_settings_are_checked_and_only_sampling_changes_the_cache_key(real_data, tmp_path):
    cfg = m30k_cfg(real_data, tmp_path)
    assert cache_key(m30k_cfg(real_data, tmp_path, "tokenizer.sampled_copies=5")) == cache_key(cfg)
    assert cache_key(m30k_cfg(real_data, tmp_path, *SAMPLED)) != cache_key(cfg)
    spm_model = next(Path(prepare(cfg).dir).glob("spm.model"))  # a reused tokenizer too
    reuse = m30k_cfg(real_data, tmp_path, f"tokenizer.reuse={spm_model}")
    assert cache_key(m30k_cfg(real_data, tmp_path, f"tokenizer.reuse={spm_model}", *SAMPLED)) != (
        cache_key(reuse)
    )
    for bad, name in [
        ("tokenizer.sampling_alpha=1.0", "tokenizer.sampling_alpha=1.0"),  # bpe: every merge
        ("tokenizer.sampling_alpha=-0.1", "tokenizer.sampling_alpha=-0.1"),
        ("tokenizer.sampled_copies=0", "tokenizer.sampled_copies=0"),
    ]:
        with pytest.raises(ValueError, match=name):
            prepare(m30k_cfg(real_data, tmp_path, "tokenizer.sampling_alpha=0.1", bad))
    assert len(list(Path(cfg.cache_dir).glob("multi30k-*"))) == 1  # refused before building


def test_each_epoch_batches_every_pair_once_in_its_own_encoding(sampled):
    plain, p = sampled
    cfg = m30k_cfg(Path("."), Path("."), *SAMPLED, "train.max_tokens=600")
    data = TrainBatches(p, cfg)
    text = Counter(_texts(plain, plain.split("train")))
    seen = []  # per epoch, the multiset of source encodings (pieces + EOS) it trained on
    for epoch in range(4):
        split, sampler = data.at(epoch)
        assert split is p.train_split(epoch)
        pairs, encodings = Counter(), Counter()
        for b in iterate_batches(split, sampler, epoch):
            rows = b.src.tolist()
            src = p.tokenizer.decode(rows, side="src")
            tgt = p.tokenizer.decode(b.tgt_out.tolist(), side="tgt")
            pairs.update(zip(src, tgt))
            encodings.update(tuple(i for i in row if i != PAD) for row in rows)
        assert pairs == text
        seen.append(encodings)
    # other encodings of the same text (their piece totals can tie by chance: compared whole),
    # and the fourth epoch back on the first
    assert seen[0] != seen[1] and seen[1] != seen[2] and seen[0] != seen[2]
    assert seen[3] == seen[0]
    assert data.at(3)[1] is data.at(0)[1]  # one sampler per encoding


def test_a_run_resumed_mid_epoch_trains_on_the_same_encoding(real_data, tmp_path):
    def cfg(run: Path, steps: int, *extra: str):
        return m30k_cfg(
            real_data, tmp_path / "cache", *SAMPLED, f"run_dir={run}", f"train.max_steps={steps}",
            "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "train.max_tokens=600",
            "train.threads=1", "train.log_every=1", "train.eval_every=0", "train.save_every=0",
            "train.warmup=10", "train.lr=3e-3", "data.max_train_pairs=300", *extra,
        )  # fmt: skip

    def losses(run: Path) -> dict[int, float]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    whole, split = tmp_path / "whole", tmp_path / "split"
    c = cfg(whole, 0)
    data = TrainBatches(prepare(c), c)
    first, second = (len(data.at(e)[1].batches(e)) for e in (0, 1))
    stop = first + second // 2  # in the middle of the second epoch, on the second encoding
    end = first + second + 5
    train(cfg(whole, end))
    train(cfg(split, stop))
    train(cfg(split, end))
    assert sorted(losses(split)) == list(range(1, end + 1))
    assert losses(split) == pytest.approx(losses(whole), rel=1e-6)
    assert data_plan(c, 1)["sampling"] == [0.1, 3]  # a mid-epoch resume needs the same


def test_a_unigram_model_samples_segmentations_of_the_same_text(real_data, tmp_path):
    p = prepare(m30k_cfg(real_data, tmp_path, "tokenizer.type=unigram", *SAMPLED))
    plain, copy = p.split("train"), p.train_split(0)
    assert _texts(p, copy) == _texts(p, plain)
    ids = [a.tolist() for a in copy.src]
    assert sum(a != b.tolist() for a, b in zip(ids, plain.src)) > len(ids) // 5
