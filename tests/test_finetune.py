"""Fine-tuning on a parent's tokenizer: tokenizer.reuse, and init_from/resume refuse a checkpoint
whose SentencePiece model differs from the prepared data's (same vocabulary size, other pieces)."""

from __future__ import annotations

import pytest

from mt.checkpoint import CheckpointError, load_checkpoint, tokenizer_blobs
from mt.config import load_config
from mt.data.build import cache_key, prepare
from mt.data.tokenizer import Tokenizer, TokenizerError
from mt.train.recipe import train

TINY = [
    "data.max_train_pairs=400",
    "tokenizer.vocab_size=400",
    "tokenizer.threads=1",
    "model.N=1",
    "model.d_model=32",
    "model.d_ff=64",
    "model.h=2",
    "train.max_tokens=400",
    "train.threads=1",
    "train.max_steps=2",
    "train.warmup=10",
    "train.lr=3e-3",
    "train.eval_every=0",
    "train.save_every=0",
    "train.eval_bleu=false",
    "train.precision=fp32",
]


def _parent(real_data, run_dir):
    """Multi30k captions."""
    return load_config(
        ["experiment=smoke", f"data.dir={real_data / 'multi30k'}", *TINY, f"run_dir={run_dir}"]
    )


def _child(real_data, run_dir, *extra):
    """News text: another corpus, so a tokenizer trained on it has other pieces."""
    return load_config(
        ["experiment=smoke", "data=local", f"data.dir={real_data}",
         "data.splits.train=wmt_newstest_de-en/newstest2012",
         "data.splits.valid=wmt14/newstest2013",
         "data.splits.test=wmt14/newstest2014", *TINY, f"run_dir={run_dir}", *extra]
    )  # fmt: skip


@pytest.mark.slow
def test_fine_tune_on_another_corpus_needs_the_parents_tokenizer(real_data, tmp_path):
    train(_parent(real_data, tmp_path / "parent"))
    parent = tmp_path / "parent" / "checkpoints" / "last.pt"
    parent_blobs = tokenizer_blobs(load_checkpoint(parent))

    # Without tokenizer.reuse: a tokenizer of the same size trained on the news text; refused.
    own = _child(real_data, tmp_path / "refused", f"train.init_from={parent}")
    assert prepare(own).vocab_size == Tokenizer.from_bytes(parent_blobs).vocab_size
    with pytest.raises(CheckpointError, match="different SentencePiece model.*tokenizer.reuse"):
        train(own)

    # With it: the news text encoded with the parent's pieces; fine-tuning runs.
    reuse = _child(real_data, tmp_path / "child", f"train.init_from={parent}",
                   f"tokenizer.reuse={parent}")  # fmt: skip
    prepared = prepare(reuse)
    assert prepared.tokenizer.to_bytes() == parent_blobs
    assert train(reuse)["step"] == 2
    child = load_checkpoint(tmp_path / "child" / "checkpoints" / "last.pt")
    assert tokenizer_blobs(child) == parent_blobs

    # Resuming the refused run's directory with other data is refused the same way: the child's
    # last.pt (parent pieces) in a run whose prepared data has its own tokenizer.
    own_resume = _child(real_data, tmp_path / "child", "train.max_steps=3")
    with pytest.raises(CheckpointError, match="different SentencePiece model"):
        train(own_resume)


def test_reuse_reads_a_model_file_and_keys_the_cache_by_its_bytes(real_data, tmp_path):
    base = _child(real_data, tmp_path / "r")
    p = prepare(base)
    model_file = p.dir / "spm.model"
    copy = tmp_path / "copy.model"
    copy.write_bytes(model_file.read_bytes())
    a = _child(real_data, tmp_path / "r", f"tokenizer.reuse={model_file}")
    b = _child(real_data, tmp_path / "r", f"tokenizer.reuse={copy}")
    assert cache_key(a) == cache_key(b) != cache_key(base)  # the bytes decide, not the path
    reused = prepare(b)
    assert reused.tokenizer.sha256() == p.tokenizer.sha256()
    assert [x.tolist() for x in reused.split("test").src] == [
        x.tolist() for x in p.split("test").src
    ]
    other = tmp_path / "other.model"
    other.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="tokenizer.reuse=.*other.model"):
        prepare(_child(real_data, tmp_path / "r", f"tokenizer.reuse={other}"))
    with pytest.raises(TokenizerError, match="no such file"):
        prepare(_child(real_data, tmp_path / "r", f"tokenizer.reuse={tmp_path / 'missing.pt'}"))


def test_a_run_resumes_on_its_data_prepared_again(real_data, tmp_path):
    """The cache removed and the data prepared again (SentencePiece trained anew in another
    temporary folder, its recorded input paths other): the same tokenizer, so the run resumes."""

    def cfg(cache, steps):
        return load_config(["experiment=smoke", f"data.dir={real_data / 'multi30k'}", *TINY,
                            f"run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / cache}",
                            f"train.max_steps={steps}"])  # fmt: skip

    assert train(cfg("first", 2))["step"] == 2
    assert train(cfg("second", 3))["step"] == 3  # resumed from step 2, not refused
    (a,), (b,) = ((tmp_path / c).glob("*/spm.model") for c in ("first", "second"))
    assert a.read_bytes() == b.read_bytes()  # prepared twice, the same bytes
