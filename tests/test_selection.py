"""Model selection: train.best_metric (bleu, chrf, loss) picks best.pt and counts patience;
train.valid_beam decodes validation by beam search; the log and report.md say which."""

from __future__ import annotations

import logging

import pytest
import torch
from test_train import TINY
from test_validation import model_for

import mt.decode.search as search_module
from mt.checkpoint import load_checkpoint
from mt.config import load_config
from mt.data.build import prepare
from mt.evaluation.report import write_report
from mt.train.recipe import train
from mt.train.state import better, metric_key
from mt.train.validation import describe_selection, valid_hypotheses, validation_search


def _cfg(*overrides: str):
    return load_config([*TINY, *overrides])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.best_metric=bleu", "train.eval_bleu=true"], "valid_bleu"),
        (["train.best_metric=chrf", "train.eval_bleu=true"], "valid_chrf"),
        (["train.best_metric=loss", "train.eval_bleu=true"], "valid_loss"),
        (["train.best_metric=bleu", "train.eval_bleu=false"], "valid_loss"),  # nothing decoded
    ],
)
def test_metric_key(overrides, key):
    assert metric_key(_cfg(*overrides)) == key


def test_higher_is_better_for_scores_lower_for_the_loss():
    assert better("valid_chrf", 41.0, 40.0) and not better("valid_chrf", 39.0, 40.0)
    assert better("valid_bleu", 21.0, 20.0) and not better("valid_bleu", 20.0, 20.0)
    assert better("valid_loss", 2.0, 2.5) and not better("valid_loss", 2.6, 2.5)
    assert all(better(key, 1.0, None) for key in ("valid_bleu", "valid_chrf", "valid_loss"))


def test_bad_selection_settings_are_refused():
    with pytest.raises(ValueError, match="train.best_metric must be bleu, chrf or loss"):
        metric_key(_cfg("train.best_metric=ter"))
    with pytest.raises(ValueError, match="train.best_metric=chrf needs train.eval_bleu=true"):
        metric_key(_cfg("train.best_metric=chrf", "train.eval_bleu=false"))
    with pytest.raises(ValueError, match="train.valid_beam must be a beam size >= 1"):
        validation_search(_cfg("train.valid_beam=0"))


def test_validation_search_is_greedy_or_the_test_beam():
    greedy = validation_search(_cfg("decode.beam_size=5", "decode.sample=true"))
    assert (greedy.beam_size, greedy.nbest, greedy.sample) == (1, 1, False)
    cfg = _cfg("train.valid_beam=3", "decode.alpha=0.8", "decode.max_len_b=7", "decode.nbest=2")
    beam = validation_search(cfg)
    assert (beam.beam_size, beam.nbest, beam.alpha, beam.max_len_b) == (3, 1, 0.8, 7)
    assert describe_selection(cfg, "valid_loss") == "valid_loss (lower is better)"
    greedy_bleu = describe_selection(_cfg(), "valid_bleu")
    assert greedy_bleu == "valid_bleu (higher is better) of greedy search"
    assert describe_selection(cfg, "valid_chrf") == (
        "valid_chrf (higher is better) of beam 3 (alpha 0.8, max length 1 x source + 7) search"
    )


@pytest.mark.parametrize("valid_beam", [None, 3])
def test_valid_beam_makes_validation_search_with_beams(real_data, tmp_path, monkeypatch,
                                                       valid_beam):  # fmt: skip
    """Validation's translations come from beam search with valid_beam beams and the decode
    node's length penalty when it is set, from greedy search when it is not."""
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    calls = {"beam": [], "greedy": 0}
    beam_search, greedy_search = search_module.beam_search, search_module.greedy_search

    def beam_spy(model, src, beam_size=4, alpha=0.6, *args, **kwargs):
        calls["beam"].append((beam_size, alpha))
        return beam_search(model, src, beam_size, alpha, *args, **kwargs)

    def greedy_spy(*args, **kwargs):
        calls["greedy"] += 1
        return greedy_search(*args, **kwargs)

    monkeypatch.setattr(search_module, "beam_search", beam_spy)
    monkeypatch.setattr(search_module, "greedy_search", greedy_spy)
    overrides = ["train.eval_bleu=true", "train.eval_max_sentences=6", "decode.alpha=0.8",
                 "decode.max_len_b=6", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    if valid_beam is not None:
        overrides.append(f"train.valid_beam={valid_beam}")
    cfg = _cfg(*overrides)
    prepared = prepare(cfg)
    hyps = valid_hypotheses(model_for(cfg, prepared.vocab_size), prepared, cfg, torch.device("cpu"))
    assert len(hyps) == 6
    if valid_beam is None:
        assert calls["greedy"] > 0 and calls["beam"] == []
    else:
        assert calls["greedy"] == 0 and calls["beam"]
        assert set(calls["beam"]) == {(3, 0.8)}


SCORES = [  # per validation: chrF peaks at the 2nd, BLEU keeps rising, the loss bottoms at the 3rd
    {"valid_chrf": 30.0, "valid_bleu": 1.0, "valid_loss": 5.0},
    {"valid_chrf": 40.0, "valid_bleu": 2.0, "valid_loss": 4.0},
    {"valid_chrf": 35.0, "valid_bleu": 3.0, "valid_loss": 3.0},
    {"valid_chrf": 38.0, "valid_bleu": 4.0, "valid_loss": 3.5},
    {"valid_chrf": 39.0, "valid_bleu": 5.0, "valid_loss": 3.2},
    {"valid_chrf": 20.0, "valid_bleu": 6.0, "valid_loss": 3.1},
]


@pytest.mark.parametrize(
    "metric, best_step, stop_step, chosen",
    [
        ("chrf", 2, 4, "validation chrF (higher is better) of beam 3 ("),
        ("bleu", 6, 6, "validation BLEU (higher is better) of beam 3 ("),
        ("loss", 3, 5, "validation loss (lower is better) |"),
    ],
)
def test_best_pt_and_patience_follow_the_chosen_metric(
    real_data, tmp_path, monkeypatch, caplog, metric, best_step, stop_step, chosen
):
    """With given validation scores, best.pt is the checkpoint of the best value of the chosen
    metric (the loss: the lowest), patience counts validations without a better one of it,
    and the log and report.md name the metric and the search."""
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    scores = iter(SCORES)

    def fake_validate(model, prepared, cfg, device, rank=0, world_size=1, loss_model=None):
        return {"valid_nll": 1.0, **next(scores)}

    monkeypatch.setattr("mt.train.recipe.validate", fake_validate)
    run = tmp_path / "run"
    cfg = _cfg(f"run_dir={run}", "train.max_steps=6", "train.eval_every=1", "train.patience=2",
               f"train.best_metric={metric}", "train.eval_bleu=true",
               "train.valid_beam=3")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mt.train.recipe"):
        result = train(cfg)
    assert result["step"] == stop_step
    assert result["stop"] == ("patience" if stop_step < 6 else "max_steps")
    assert result["best"] == SCORES[best_step - 1][f"valid_{metric}"]
    assert load_checkpoint(run / "checkpoints" / "best.pt")["step"] == best_step
    assert f"best.pt and patience: valid_{metric}" in caplog.text
    report = write_report(run).read_text()
    assert f"| best.pt chosen by | {chosen}" in report
    assert "beam 3 (alpha 0.6, max length" in report  # the search, in the time-to-BLEU text too
