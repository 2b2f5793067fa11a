"""Corpus weights and temperature sampling: the parsing of ``data.splits.train``, the counts of
an epoch against an independent computation, the realised proportions of the sampler's
batches (one rank and several), the prepared counts per corpus, and training with a mix."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mt.config import load_config
from mt.data.batches import BatchSampler
from mt.data.build import cache_key, prepare
from mt.data.mixing import Mix, corpus_specs, epoch_counts, train_mix
from mt.train.state import data_plan

ROOT = Path(__file__).resolve().parents[1]


def test_split_entries_parse_with_weights_and_bad_ones_name_the_entry():
    specs = corpus_specs(["a", {"name": "b", "weight": 0.5}, {"name": "c"}])
    assert [(s.name, s.weight) for s in specs] == [("a", 1.0), ("b", 0.5), ("c", 1.0)]
    assert [s.name for s in corpus_specs("train")] == ["train"]
    for bad, said in [
        ({"name": "b", "weight": 0}, "data.splits.train[1]: weight=0 must be > 0"),
        ({"name": "b", "weight": -2.0}, "weight=-2.0 must be > 0"),
        ({"name": "b", "weight": float("nan")}, "must be > 0"),
        ({"name": "b", "weight": "x"}, "weight='x' is not a number"),
        ({"name": "b", "wieght": 2}, "unknown key(s) ['wieght']"),
        ({"weight": 2}, "the name is missing"),
    ]:
        with pytest.raises(ValueError) as err:
            corpus_specs(["a", bad])
        assert said in str(err.value) and "\n" not in str(err.value)


def _counts_by_hand(sizes, weights, t):
    """The definition, term by term in plain Python floats."""
    mass = [n * w for n, w in zip(sizes, weights)]
    if t == 1:
        return [round(m) for m in mass]
    powered = [m ** (1 / t) for m in mass]
    return [round(sum(mass) * p / sum(powered)) for p in powered]


@pytest.mark.parametrize(
    "sizes,weights,t",
    [([1000, 100], [1, 1], 1.0), ([1000, 100], [1, 3], 1.0), ([1000, 100, 10], [1, 1, 1], 2.0),
     ([5000, 300], [0.5, 2], 5.0), ([7, 900], [1, 1], 100.0)],
)  # fmt: skip
def test_epoch_counts_match_the_definition(sizes, weights, t):
    got = epoch_counts(sizes, weights, t).tolist()
    assert got == _counts_by_hand(sizes, weights, t)
    mass = np.multiply(sizes, weights)
    if t > 1:  # flatter: the largest corpus's share falls; the epoch's size is kept (rounding)
        big = int(mass.argmax())
        assert got[big] / sum(got) < mass[big] / mass.sum()
        assert abs(sum(got) - mass.sum()) <= len(sizes)


def _lengths(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 30, n), rng.integers(1, 30, n)


def _realised(sampler, epoch, bounds):
    pairs = np.concatenate(sampler.global_batches(epoch))
    return np.bincount(np.searchsorted(bounds, pairs, side="right"), minlength=len(bounds))


@pytest.mark.parametrize("weights,t", [([1.0, 0.25, 3.0], 1.0), ([1.0, 1.0, 1.0], 3.0),
                                       ([2.0, 0.5, 1.0], 2.0)])  # fmt: skip
def test_the_sampler_realises_the_counts_every_epoch(weights, t):
    sizes = [600, 200, 50]
    src, tgt = _lengths(sum(sizes), 0)
    mix = Mix(("a", "b", "c"), tuple(sizes), tuple(weights), t)
    sampler = BatchSampler(src, tgt, 200, seed=3, mix=mix)
    expected = epoch_counts(sizes, weights, t).tolist()
    bounds = np.cumsum(sizes)
    draws = []
    for epoch in range(3):
        assert _realised(sampler, epoch, bounds).tolist() == expected
        assert sampler.corpus_counts(epoch) == expected
        pairs = sampler.epoch_pairs(epoch)
        for corpus, (start, end) in enumerate(zip([0, *bounds[:-1]], bounds)):
            times = Counter(pairs[(pairs >= start) & (pairs < end)].tolist())
            n = end - start
            # every pair floor(c/n) or ceil(c/n) times: whole passes, then a subset of the rest
            assert set(times.values()) <= {expected[corpus] // n, -(-expected[corpus] // n)}
            assert len(times) == min(n, expected[corpus])
        draws.append(tuple(sorted(pairs.tolist())))
    assert len(set(draws)) > 1  # the subsets are drawn afresh each epoch
    again = BatchSampler(src, tgt, 200, seed=3, mix=mix)
    assert [b.tolist() for b in again.global_batches(1)] == [
        b.tolist() for b in sampler.global_batches(1)]  # fmt: skip


def test_ranks_share_the_mixed_epoch_and_weight_one_changes_nothing():
    sizes = (300, 100)
    src, tgt = _lengths(sum(sizes), 1)
    mix = Mix(("a", "b"), sizes, (0.5, 2.0))
    one = BatchSampler(src, tgt, 150, seed=5, mix=mix)
    ranks = [BatchSampler(src, tgt, 150, seed=5, rank=r, world_size=3, mix=mix) for r in range(3)]
    real = Counter()
    for s in ranks:
        for batch, w in zip(s.batches(2), s.weights(2)):
            if w:
                real.update(batch.tolist())
    assert len({len(s.batches(2)) for s in ranks}) == 1
    assert real == Counter(np.concatenate(one.global_batches(2)).tolist())
    plain = BatchSampler(src, tgt, 150, seed=5)
    unit = BatchSampler(src, tgt, 150, seed=5, mix=Mix(("a", "b"), sizes, (1.0, 1.0)))
    assert unit.mix is None and unit.corpus_counts(0) is None
    assert [b.tolist() for b in unit.global_batches(4)] == [
        b.tolist() for b in plain.global_batches(4)]  # fmt: skip


def test_a_skipped_long_pair_is_not_drawn_and_the_shares_use_kept_pairs():
    src = np.array([5] * 10 + [50] + [5] * 9)
    tgt = np.full(20, 5)
    mix = Mix(("a", "b"), (10, 10), (1.0, 2.0))
    sampler = BatchSampler(src, tgt, 100, seed=0, max_len=20, mix=mix)
    pairs = np.concatenate(sampler.global_batches(0))
    assert 10 not in pairs.tolist()
    assert sampler.corpus_counts(0) == [10, 18]


def _two_corpora(d: Path) -> Path:
    d.mkdir()
    files = {
        "a.de": [f"satz {i} mit wörtern" for i in range(120)],
        "a.en": [f"sentence {i} with words" for i in range(120)],
        # two pairs the piece filter drops (too long), one the cleaner drops (empty)
        "b.de": [f"nachricht {i}" for i in range(40)] + ["wort " * 60, "x " * 70, ""],
        "b.en": [f"message {i}" for i in range(40)] + ["word", "y", "leer"],
        "valid.de": ["ein Hund"], "valid.en": ["a dog"],
        "test.de": ["zwei Katzen"], "test.en": ["two cats"],
    }  # fmt: skip
    for name, ls in files.items():
        (d / name).write_text("".join(s + "\n" for s in ls), encoding="utf-8")
    return d


def _cfg(d, tmp_path, *extra):
    return load_config([
        "data=local", f"data.dir={d}", f"cache_dir={tmp_path / 'cache'}",
        "tokenizer.vocab_size=400", "tokenizer.threads=1", "data.clean.max_pieces=40", *extra,
    ])  # fmt: skip


def test_prepare_records_each_corpus_and_weights_share_the_cache(tmp_path):
    d = _two_corpora(tmp_path / "c")
    plain = _cfg(d, tmp_path, "data.splits.train=[a,b]")
    weighted = _cfg(d, tmp_path, "data.splits.train=[a,{name:b,weight:3}]",
                    "data.corpus_temperature=2")  # fmt: skip
    assert cache_key(plain) == cache_key(weighted)
    prepared = prepare(weighted)
    assert prepared.corpus_sizes() == [120, 40]
    assert len(prepared.split("train")) == 160
    meta = json.loads((prepared.dir / "meta.json").read_text())
    assert meta["counts"]["train"]["corpora"] == [{"name": "a", "pairs": 120},
                                                  {"name": "b", "pairs": 40}]  # fmt: skip
    # the pairs of corpus b are the last 40 of the split
    src = prepared.split("train").src
    tail = prepared.tokenizer.decode([src[i] for i in range(120, 160)], "src")
    assert tail == [f"nachricht {i}" for i in range(40)]
    mix = train_mix(weighted.data, prepared.corpus_sizes())
    assert mix.names == ("a", "b") and mix.weights == (1.0, 3.0) and mix.temperature == 2.0
    assert train_mix(plain.data, prepared.corpus_sizes()) is None
    with pytest.raises(ValueError, match="does not record"):
        train_mix(weighted.data, None)


def test_the_data_plan_holds_the_mix_only_when_there_is_one():
    plain = load_config(["data.splits.train=[a,b]"])
    assert "mix" not in data_plan(plain, 1)
    weighted = load_config(["data.splits.train=[a,{name:b,weight:0.5}]"])
    assert data_plan(weighted, 1)["mix"] == [["a", 1.0], ["b", 0.5]]


@pytest.mark.slow
def test_training_on_a_mix_logs_each_epoch_and_refuses_a_new_mix_mid_epoch(real_data, tmp_path):
    news = "wmt_newstest_de-en"
    common = [
        "experiment=smoke", "data=local", f"data.dir={real_data}",
        "data.splits.valid=multi30k/val", "data.splits.test=multi30k/test_2016_flickr",
        "tokenizer.vocab_size=400", "model.N=1", "model.d_model=32", "model.d_ff=64",
        "model.h=2", "train.max_tokens=1200", "train.threads=1", "train.eval_every=0",
        "train.eval_bleu=false", "train.save_every=4", f"run_dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    mix = f"data.splits.train=[{news}/newstest2015,{{name:{news}/newstest2016,weight:0.5}}]"
    code = "from mt.cli import train_main; train_main()"

    def run(*extra):
        return subprocess.run([sys.executable, "-c", code, *common, *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    first = run(mix, "train.max_steps=4")
    assert first.returncode == 0, first.stderr[-2000:]
    (meta,) = (tmp_path / "cache").glob("*/meta.json")
    sizes = [c["pairs"] for c in json.loads(meta.read_text())["counts"]["train"]["corpora"]]
    assert 2000 < sizes[0] <= 2169 and 2800 < sizes[1] <= 2999  # as cleaned
    line = [x for x in first.stderr.splitlines() if "epoch 0 pairs by corpus" in x]
    a, b = epoch_counts(sizes, [1.0, 0.5]).tolist()
    assert line and f"newstest2015 {a:,} " in line[0] and f"newstest2016 {b:,} " in line[0]
    assert f"{sizes[1]:,} pairs x 0.5" in line[0]
    again = run(mix.replace("0.5", "2"), "train.max_steps=8")
    assert again.returncode == 1
    errors = [x for x in again.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "corpus weights (data.splits.train)" in errors[0], errors


def test_a_bad_weight_is_one_line_from_the_command(tmp_path):
    code = "from mt.cli import prepare_main; prepare_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "data=local", f"data.dir={tmp_path}",
         "data.splits.train=[a,{name:b,weight:-1}]", f"cache_dir={tmp_path / 'cache'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "data.splits.train[1]: weight=-1" in errors[0] and "must be > 0" in errors[0]
