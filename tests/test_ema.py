"""The moving average of the weights (train.ema): its formula against a float64 recomputation
from every update's weights, resume, validation at the end and the best.pt rule."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import mt.train.ema
from mt.checkpoint import load_checkpoint, load_model
from mt.config import load_config
from mt.data.build import prepare
from mt.train.ema import WeightEMA, decay_at
from mt.train.recipe import train
from mt.train.validation import validate
from tests.test_train import TINY


@pytest.fixture(autouse=True)
def _data_env(real_data, monkeypatch):
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))


def _cfg(run_dir: Path, *overrides: str):
    return load_config([*TINY, f"run_dir={run_dir}", *overrides])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reference(initial: list[torch.Tensor], steps: list[list[torch.Tensor]], decay: float):
    """The average written out: avg_0 = w_0, avg_n = d avg_{n-1} + (1 - d) w_n in float64,
    d = decay while it is below the ramp (1 + n) / (10 + n)."""
    avg = [w.double() for w in initial]
    for n, weights in enumerate(steps, start=1):
        ramp = (1 + n) / (10 + n)
        d = decay if decay < ramp else ramp
        avg = [d * a + (1 - d) * w.double() for a, w in zip(avg, weights)]
    return avg


def test_decay_ramps_up_to_the_setting():
    assert decay_at(0.999, 1) == pytest.approx(2 / 11)
    assert decay_at(0.999, 90) == pytest.approx(91 / 100)
    assert decay_at(0.5, 1) == pytest.approx(2 / 11) and decay_at(0.5, 9) == 0.5
    assert decay_at(0.999, 10**6) == 0.999


def test_the_average_follows_its_formula():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    initial = [p.detach().clone() for p in params]
    ema = WeightEMA(params, decay=0.6)  # the ramp below 0.6 until update 13
    steps = []
    with torch.no_grad():
        for _ in range(25):
            for p in params:
                p.add_(torch.randn_like(p))
            steps.append([p.detach().clone() for p in params])
            ema.update()
    for got, want in zip(ema.weights, _reference(initial, steps, 0.6)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert ema.updates == 25
    # the average is its own copy: the parameters moved on without it
    assert not torch.equal(ema.weights[0], params[0].detach())


def test_a_bf16_parameter_is_averaged_in_float32():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ema = WeightEMA([p], decay=0.5)
    with torch.no_grad():
        p.fill_(3.0)
    ema.update()  # d_1 = 2/11
    assert ema.weights[0].dtype == torch.float32
    torch.testing.assert_close(ema.weights[0], torch.full((4,), 2 / 11 + 3 * 9 / 11))


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_a_decay_outside_zero_one_is_refused(decay):
    with pytest.raises(ValueError, match="train.ema"):
        WeightEMA([torch.nn.Parameter(torch.ones(2))], decay)


def test_a_run_averages_every_update_validates_the_average_and_keeps_it(tmp_path, monkeypatch):
    """ema.pt holds the average of the run's weights after every update (read back from a
    checkpoint per update) started at the initial weights; it is validated at the end as a
    model loaded from ema.pt validates, and becomes best.pt by the stated rule."""
    initial: list[list[torch.Tensor]] = []
    real_init = WeightEMA.__init__

    def spy(self, params, decay):
        params = list(params)
        initial.append([p.detach().clone() for p in params])
        real_init(self, params, decay)

    monkeypatch.setattr(WeightEMA, "__init__", spy)
    run, steps = tmp_path / "run", 6
    train(_cfg(run, f"train.max_steps={steps}", "train.save_every=1", f"train.keep_last={steps}",
               "train.eval_every=3", "train.ema=0.3"))  # ramp, then 0.3 from update 3  # fmt: skip
    ckpts = run / "checkpoints"
    model, _, _ = load_model(ckpts / "last.pt", "cpu")
    names = [n for n, _ in model.named_parameters()]  # parameters() order, shared ones once
    per_step = [[load_checkpoint(ckpts / f"checkpoint_{n}.pt")["model"][k] for k in names]
                for n in range(1, steps + 1)]  # fmt: skip
    want = _reference(initial[0], per_step, 0.3)
    ema_ckpt = load_checkpoint(ckpts / "ema.pt")
    assert ema_ckpt["ema_decay"] == 0.3 and ema_ckpt["ema_updates"] == steps
    for name, w in zip(names, want):
        torch.testing.assert_close(ema_ckpt["model"][name].double(), w, rtol=0, atol=1e-5)
    last = load_checkpoint(ckpts / "last.pt", require_training=True)
    assert last["ema"]["updates"] == steps
    torch.testing.assert_close(last["ema"]["weights"][0].double(), want[0], rtol=0, atol=1e-5)

    cfg = _cfg(run)
    expected = validate(load_model(ckpts / "ema.pt", "cpu")[0], prepare(cfg), cfg, "cpu")
    records = _records(run)
    (logged,) = [r for r in records if "ema_decay" in r]
    for key, value in expected.items():
        assert logged[f"ema_{key}"] == pytest.approx(value, rel=1e-5), key
    best_single = min(r["valid_loss"] for r in records if "valid_loss" in r)
    best = load_checkpoint(ckpts / "best.pt")
    if expected["valid_loss"] <= best_single:  # TINY's best_metric: the loss (no BLEU)
        assert best["ema_updates"] == steps and best["best"] == logged["ema_valid_loss"]
    else:
        assert "ema_updates" not in best and best["best"] == best_single


def test_a_resumed_run_averages_as_the_uninterrupted_one(tmp_path, caplog):
    common = ["train.ema=0.7", "model.dropout=0.1"]
    full, split = tmp_path / "full", tmp_path / "split"
    train(_cfg(full, *common, "train.max_steps=6"))
    train(_cfg(split, *common, "train.max_steps=3"))
    train(_cfg(split, *common, "train.max_steps=6"))
    a = load_checkpoint(full / "checkpoints" / "last.pt")["ema"]
    b = load_checkpoint(split / "checkpoints" / "last.pt")["ema"]
    assert a["updates"] == b["updates"] == 6
    for x, y in zip(a["weights"], b["weights"]):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-6)
    # a run resumed with the average newly switched on starts it at the resumed weights
    plain = tmp_path / "plain"
    train(_cfg(plain, "train.max_steps=2"))
    with caplog.at_level(logging.INFO, logger="mt.train"):
        train(_cfg(plain, "train.max_steps=4", "train.ema=0.7"))
    assert "holds no moving average; it starts at the resumed weights" in caplog.text
    assert load_checkpoint(plain / "checkpoints" / "last.pt")["ema"]["updates"] == 2


def test_without_the_setting_nothing_is_averaged(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no moving average without train.ema")

    monkeypatch.setattr(mt.train.ema.WeightEMA, "__init__", refuse)
    run = tmp_path / "run"
    train(_cfg(run, "train.max_steps=2"))
    assert "ema" not in load_checkpoint(run / "checkpoints" / "last.pt")
    assert not (run / "checkpoints" / "ema.pt").exists()
