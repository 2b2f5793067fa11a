"""Label smoothing against an explicit smoothed target distribution and F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mt.loss import label_smoothed_nll_loss
from mt.vocab import PAD


def _data(N: int = 7, V: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64)
    target = torch.randint(PAD + 1, V, (N,), generator=g)
    target[2] = PAD
    target[5] = PAD
    return logits, target


def _explicit(logits, target, eps):
    """Build q explicitly (1-eps on the target, eps/(V-1) elsewhere) and sum -q.log p."""
    N, V = logits.shape
    lp = torch.log_softmax(logits, -1)
    loss = torch.zeros((), dtype=logits.dtype)
    nll = torch.zeros((), dtype=logits.dtype)
    for i in range(N):
        t = int(target[i])
        if t == PAD:
            continue
        q = torch.full((V,), eps / (V - 1), dtype=logits.dtype)
        q[t] = 1.0 - eps
        assert abs(float(q.sum()) - 1.0) < 1e-12
        loss = loss - (q * lp[i]).sum()
        nll = nll - lp[i, t]
    return loss, nll


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_matches_explicit_distribution(eps):
    logits, target = _data()
    loss, nll = label_smoothed_nll_loss(torch.log_softmax(logits, -1), target, eps)
    ref_loss, ref_nll = _explicit(logits, target, eps)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)


def test_equals_kl_plus_entropy():
    """CE(q, p) = KL(q || p) + H(q): an independent route through F.kl_div."""
    eps = 0.1
    logits, target = _data(seed=3)
    keep = target != PAD
    N, V = logits.shape
    lp = torch.log_softmax(logits, -1)
    q = torch.full((N, V), eps / (V - 1), dtype=logits.dtype)
    q.scatter_(1, target.unsqueeze(1), 1.0 - eps)
    q = q[keep]
    kl = F.kl_div(lp[keep], q, reduction="sum")
    entropy = -(q * q.log()).sum()
    loss, _ = label_smoothed_nll_loss(lp, target, eps)
    torch.testing.assert_close(loss, kl + entropy)


def test_eps_zero_is_cross_entropy():
    logits, target = _data(N=20, V=30, seed=1)
    loss, nll = label_smoothed_nll_loss(torch.log_softmax(logits, -1), target, 0.0)
    ref = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref)


def test_padding_ignored_and_gradient_zero_there():
    logits, target = _data()
    logits.requires_grad_(True)
    loss, _ = label_smoothed_nll_loss(torch.log_softmax(logits, -1), target, 0.1)
    loss.backward()
    assert torch.all(logits.grad[target == PAD] == 0)
    assert torch.all(logits.grad[target != PAD].abs().sum(-1) > 0)
    # all padding: zero loss
    lp = torch.log_softmax(torch.randn(3, 5), -1)
    loss, nll = label_smoothed_nll_loss(lp, torch.full((3,), PAD), 0.1)
    assert float(loss) == 0.0 and float(nll) == 0.0


def test_smoothed_loss_is_minimised_by_the_smoothed_distribution():
    """The optimum of the smoothed loss is p = q, not the one-hot target (worse ppl, as in §5.4)."""
    V, eps = 6, 0.2
    target = torch.tensor([4])
    q = torch.full((1, V), eps / (V - 1))
    q[0, 4] = 1 - eps
    at_q, _ = label_smoothed_nll_loss(q.log(), target, eps)
    sharper = torch.softmax(torch.log(q) * 3, -1)
    at_sharper, _ = label_smoothed_nll_loss(sharper.log(), target, eps)
    assert float(at_q) < float(at_sharper)


def test_shape_errors():
    with pytest.raises(ValueError):
        label_smoothed_nll_loss(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), 0.1)
