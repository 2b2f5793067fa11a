"""The Noam schedule against the paper's formula written out with math."""

from __future__ import annotations

import math

import pytest
import torch

from mt.schema import TrainConfig
from mt.train.schedule import (
    cooldown_factor,
    describe_budget,
    noam_factor,
    noam_lambda,
    noam_lr,
)


def _paper(step, d_model, warmup, factor=1.0):
    return factor * (1 / math.sqrt(d_model)) * min(1 / math.sqrt(step), step / warmup**1.5)


@pytest.mark.parametrize("step", [1, 2, 100, 3999, 4000, 4001, 20000, 100000])
def test_formula(step):
    assert noam_lr(step, 512, 4000) == pytest.approx(_paper(step, 512, 4000), rel=1e-12)
    assert noam_lr(step, 1024, 4000, 2.0) == pytest.approx(_paper(step, 1024, 4000, 2.0), rel=1e-12)


def test_warmup_then_decay_peak_at_warmup():
    lrs = [noam_lr(s, 512, 100) for s in range(1, 400)]
    peak = max(range(len(lrs)), key=lrs.__getitem__) + 1
    assert peak == 100
    assert all(a < b for a, b in zip(lrs[:99], lrs[1:100]))
    assert all(a > b for a, b in zip(lrs[100:], lrs[101:]))
    # paper figure: base model peak about 7e-4
    assert noam_lr(4000, 512, 4000) == pytest.approx(1 / math.sqrt(512 * 4000))


def test_peak_override():
    f = noam_factor(64, 20, factor=123.0, lr=3e-3)
    assert noam_lr(20, 64, 20, f) == pytest.approx(3e-3, rel=1e-12)
    assert max(noam_lr(s, 64, 20, f) for s in range(1, 200)) == pytest.approx(3e-3, rel=1e-12)
    assert noam_factor(64, 20, factor=2.5) == 2.5


def test_lambda_lr_gives_update_k_the_rate_of_step_k():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam_lambda(64, 10, lr=1e-3))
    f = 1e-3 * math.sqrt(64 * 10)
    for k in range(1, 30):
        assert opt.param_groups[0]["lr"] == pytest.approx(_paper(k, 64, 10, f), rel=1e-12)
        opt.step()
        sched.step()


def test_bad_warmup():
    with pytest.raises(ValueError):
        noam_lr(1, 512, 0)


def test_cooldown_factor_is_linear_to_zero_over_the_last_share():
    c = 0.25
    for p in (0.0, 0.3, 0.75):
        assert cooldown_factor(p, c) == 1.0
    for p, expected in ((0.8, 0.8), (0.875, 0.5), (0.95, 0.2), (1.0, 0.0), (1.5, 0.0)):
        assert cooldown_factor(p, c) == pytest.approx(expected, abs=1e-12)
    assert cooldown_factor(0.99, 0.0) == 1.0  # off
    with pytest.raises(ValueError, match="train.cooldown"):
        cooldown_factor(0.5, 1.5)


def test_the_budget_is_described_in_updates_with_time_as_a_cap():
    tc = TrainConfig(max_steps=4000, max_minutes=42, cooldown=0.3, patience=4)
    assert describe_budget(tc) == (
        "4,000 updates, or 42 minutes (a cap), whichever comes first; the rate falls to 0 over "
        "the last 30% of it; stops early after 4 validations without a better bleu"
    )
    assert describe_budget(TrainConfig(max_minutes=15)) == "15 minutes"
    assert describe_budget(TrainConfig()) == "no limit"
