"""The model card of ``mt-export format=hf`` (mt.export.card), read back as the hub reads it
(huggingface_hub's ModelCard and metadata parser, offline, from the local file): what the run
knows of its data (the prepared data's meta), scores with signatures, budget and machine."""

from __future__ import annotations

import copy
import json

import pytest

hub = pytest.importorskip("huggingface_hub")

from fault_inject import make_corpus  # noqa: E402

from mt.checkpoint import load_checkpoint, model_cfg_from  # noqa: E402
from mt.config import load_config  # noqa: E402
from mt.export.card import model_card  # noqa: E402


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(checkpoint path, checkpoint, results.json) of a tiny model trained 3 updates on a
    small local corpus (not Multi30k) and evaluated on its test split."""
    from mt.evaluation.evaluate import evaluate_run
    from mt.train.recipe import train

    tmp = tmp_path_factory.mktemp("card")
    data = make_corpus(tmp / "news")
    cfg = load_config([
        "name=news_test", "data=local", f"data.dir={data}", "data.clean.max_ratio=0",
        f"cache_dir={tmp / 'cache'}", f"run_dir={tmp / 'run'}",
        "tokenizer.vocab_size=120", "tokenizer.byte_fallback=false", "tokenizer.threads=1",
        "model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "train.device=cpu",
        "train.threads=1", "train.max_tokens=300", "train.warmup=10", "train.max_steps=3",
        "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.eval_bleu=false",
        "decode=greedy", "eval.report=false",
    ])  # fmt: skip
    train(cfg)
    results = evaluate_run(cfg)
    path = tmp / "run" / "checkpoints" / "best.pt"
    return path, load_checkpoint(path), results


def _card(tmp_path, ckpt, path, **kwargs):
    readme = tmp_path / "README.md"
    readme.write_text(model_card(ckpt, model_cfg_from(ckpt), path, **kwargs), encoding="utf-8")
    return readme, readme.read_text(encoding="utf-8")


def test_the_card_says_what_the_run_knows_and_the_hub_reads_it(evaluated, tmp_path):
    path, ckpt, results = evaluated
    readme, text = _card(tmp_path, ckpt, path, license="cc-by-4.0")
    card = hub.ModelCard.load(readme)
    assert card.data.language == ["de", "en"] and card.data.license == "cc-by-4.0"
    assert card.data.pipeline_tag == "translation" and card.data.datasets is None  # local files
    assert card.data.metrics == ["bleu", "chrf"]
    evals = {e.metric_type: e for e in card.data.eval_results}
    assert sorted(evals) == ["bleu", "chrf"]
    for metric, e in evals.items():
        assert e.metric_value == round(results["scores"][metric]["score"], 2)
        assert e.metric_args == {"signature": results["scores"][metric]["signature"]}
        assert e.task_type == "translation" and e.dataset_split == "test"
        assert e.dataset_type == "local" and e.dataset_args == "de-en"
    meta = hub.metadata_load(readme)
    assert meta["model-index"][0]["results"][0]["dataset"]["name"] == "local test split (test)"
    # the corpora and their sizes, counted here from the files the run read
    pairs = {s: len((path.parents[2] / "news" / f"{s}.de").read_text().splitlines())
             for s in ("train", "valid", "test")}  # fmt: skip
    assert f"| train: train | {pairs['train']:,} |" in text
    assert f"| valid: valid | {pairs['valid']:,} |" in text
    assert f"| test: test | {pairs['test']:,} |" in text
    assert "From local (local files, folder news), de→en." in text
    assert f"{pairs['train']:,} training pairs read, {pairs['train']:,} kept" in text
    # the budget and the machine, from the run's end-of-training record
    # the command: the default experiment and the settings that differ (not experiment=news_test)
    assert "mt-train name=news_test data.dir=" not in text
    assert "mt-train data." in text and " model.N=1 " in text and " name=news_test " in text
    assert "3 updates in" in text and "budget: max_steps=3" in text and "on cpu (" in text
    sig = results["scores"]["bleu"]["signature"]
    assert f"| bleu | {results['scores']['bleu']['score']:.2f} | `{sig}` |" in text
    assert text.splitlines()[text.splitlines().index("---", 1) + 2] == "# news_test (de→en)"
    assert "multi30k" not in text.lower() and "image captions" not in text
    assert str(path.parents[2]) not in json.dumps(ckpt["data_summary"])  # no local paths


def test_the_license_is_unknown_unless_given(evaluated, tmp_path):
    path, ckpt, _ = evaluated
    readme, text = _card(tmp_path, ckpt, path)
    assert hub.ModelCard.load(readme).data.license == "unknown"
    assert "| license | unknown |" in text


def test_a_hub_dataset_is_named_and_multi30k_described(evaluated, tmp_path):
    path, ckpt, _ = evaluated
    ckpt = copy.deepcopy(ckpt)
    ckpt["data_summary"].update(name="multi30k", source="hub", hf_path="bentrevett/multi30k",
                                local_dir=None, revision="4c8f1a2")  # fmt: skip
    readme, text = _card(tmp_path, ckpt, path)
    card = hub.ModelCard.load(readme)
    assert card.data.datasets == ["bentrevett/multi30k"]
    assert {e.dataset_type for e in card.data.eval_results} == {"bentrevett/multi30k"}
    assert {e.dataset_revision for e in card.data.eval_results} == {"4c8f1a2"}
    assert "From bentrevett/multi30k at revision 4c8f1a2, de→en." in text
    assert "Multi30k is image captions" in text


def test_the_summary_names_a_hub_datasets_revision():
    """``data_summary`` from a prepared data's meta.json: a hub dataset's resolved commit (its
    ``revision``), else the revision asked for (``data.revision``); none for local files."""
    from types import SimpleNamespace

    from mt.train.state import data_summary

    def summary(meta):
        return data_summary(SimpleNamespace(meta=meta))["revision"]

    hub_data = {"name": "wmt14", "source": "hf", "hf_path": "wmt/wmt14", "revision": "main"}
    assert summary({"data": hub_data, "revision": "b199e40"}) == "b199e40"
    assert summary({"data": hub_data, "revision": None}) == "main"
    local = {"name": "news", "source": "local", "dir": "/data/news", "revision": "main"}
    assert summary({"data": local, "revision": None}) is None


def test_an_older_checkpoint_finds_its_data_in_the_cache(evaluated, tmp_path):
    """A checkpoint without ``data_summary``: the prepared data's meta.json that its run's
    config.yaml names (same data and tokenizer settings) gives the same card."""
    path, ckpt, _ = evaluated
    _, expected = _card(tmp_path, ckpt, path)
    old = {k: v for k, v in ckpt.items() if k != "data_summary"}
    _, text = _card(tmp_path, old, path)
    assert text == expected
