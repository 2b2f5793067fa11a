"""Label smoothing against an explicit smoothed target distribution and F.cross_entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mt.fast.loss import label_smoothed_cross_entropy
from mt.model.loss import label_smoothed_nll_loss
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


# The fused form used in training: same values, gradient g * (softmax - q).


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fused_matches_explicit_distribution(eps):
    logits, target = _data(N=9, V=13, seed=4)
    loss, nll = label_smoothed_cross_entropy(logits, target, eps)
    ref_loss, ref_nll = _explicit(logits, target, eps)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)


def test_fused_gradient_passes_gradcheck():
    """Numerical differentiation (float64) of the fused loss, with padded rows and blocks of
    rows smaller than N (the row loop is exercised)."""
    from mt.fast.loss import _SmoothedCrossEntropy

    logits, target = _data(N=7, V=5, seed=2)
    keep = target != PAD
    z = logits[keep].clone().requires_grad_(True)

    def f(x):
        return _SmoothedCrossEntropy.apply(x, target[keep], 0.1, 2)[0]

    assert torch.autograd.gradcheck(f, (z,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_autograd_through_log_softmax(dtype):
    """Loss, NLL and gradient against autograd through the unfused reference (the gradient in
    the logits' dtype), over several row blocks (V large enough for blocks of 104 rows)."""
    g = torch.Generator().manual_seed(5)
    N, V = 300, 10_000
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
    target = torch.randint(1, V, (N,), generator=g)
    target[::7] = PAD
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ref_loss, ref_nll = label_smoothed_nll_loss(torch.log_softmax(a.float(), -1), target, 0.1)
    loss, nll = label_smoothed_cross_entropy(b, target, 0.1)
    (ref_loss * 0.25).backward()
    (loss * 0.25).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-5, atol=1e-3)
    assert b.grad.dtype == dtype
    assert torch.all(b.grad[target == PAD] == 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # gradients are up to 0.25 here
    torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=0, atol=tol)
    assert not nll.requires_grad


def test_fused_shape_errors():
    with pytest.raises(ValueError, match="expected logits"):
        label_smoothed_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), 0.1)


def test_block_rows_stay_cache_sized():
    """Blocks of 4 MB of float32 (as measured before), at least one row."""
    from mt.fast.loss import block_rows

    assert block_rows(37_000) == (1 << 20) // 37_000 == 28
    assert block_rows(1) == 1 << 20 and block_rows(10**9) == 1


def test_fused_in_one_block_equals_the_textbook_formula():
    """A 1200-row batch in one fused pass (the loop over several blocks is tested above),
    against -sum_k q(k) log p(k) with q written out in float64: loss and NLL at 1e-5, the
    gradient at 1e-5 (float32 logits)."""
    from mt.fast.loss import _SmoothedCrossEntropy

    N, V, eps = 1200, 4096, 0.1
    rows = N
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N, V, generator=g) * 4
    target = torch.randint(1, V, (N,), generator=g)
    fused = logits.clone().requires_grad_(True)
    loss, nll = _SmoothedCrossEntropy.apply(fused, target, eps, rows)
    loss.backward()

    ref = logits.double().requires_grad_(True)
    lp = torch.log_softmax(ref, dim=-1)
    q = torch.full((N, V), eps / (V - 1), dtype=torch.float64)
    q.scatter_(1, target[:, None], 1.0 - eps)
    ref_loss = -(q * lp).sum()
    ref_nll = -lp.gather(1, target[:, None]).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(nll.double(), ref_nll.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(fused.grad.double(), ref.grad, rtol=0, atol=1e-5)


# The projection and the loss in row blocks (the CPU training copy's): the same sums and
# gradients as projecting first, without the (N, V) logits.


def _projection_data(N=11, V=13, V_padded=16, D=6, seed=21, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype)
    weight = torch.randn(V_padded, D, generator=g, dtype=dtype)
    target = torch.randint(1, V, (N,), generator=g)
    return h, weight, target


@pytest.mark.parametrize("rows", [1, 4, 11, 64])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_projected_equals_the_explicit_distribution_of_the_projection(rows, eps):
    """Loss, NLL and both gradients against the textbook formula on ``h W[:V]^T`` (float64,
    q written out), over one block and several, with padded rows of W never scored."""
    from mt.fast.loss import projected_cross_entropy

    h, weight, target = _projection_data()
    h1, w1 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, nll = projected_cross_entropy(h1, w1, target, eps, vocab=13, rows=rows)
    (loss * 0.5).backward()

    h2, w2 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_loss, ref_nll = _explicit(h2 @ w2[:13].t(), target, eps)
    (ref_loss * 0.5).backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
    assert torch.all(w1.grad[13:] == 0)  # the padded rows get no gradient
    assert not nll.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [0, 11])
def test_projected_weight_gradient_is_written_not_added_to_fresh_memory(monkeypatch, N, dtype):
    """The weight's gradient is allocated without a zero fill (the first block's product writes
    it): with every fresh tensor full of NaN, the gradients are still the reference's, the
    never-scored rows zero, and a batch without rows gives a zero gradient. Also under bf16
    autocast (16-bit products added to a float32 gradient)."""
    from mt.fast.loss import projected_cross_entropy

    h, weight, target = _projection_data(N=max(N, 1), dtype=torch.float32)
    h, target = h[:N], target[:N]
    h2, w2 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        want, _ = projected_cross_entropy(h2, w2, target, 0.1, vocab=13, rows=4)
    (want * 0.25).backward()
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(math.nan))
    h1, w1 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss, _ = projected_cross_entropy(h1, w1, target, 0.1, vocab=13, rows=4)
    (loss * 0.25).backward()
    assert torch.isfinite(w1.grad).all() and torch.all(w1.grad[13:] == 0)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=0)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)
    if N == 0:
        assert torch.all(w1.grad == 0)


def test_projected_gradient_passes_gradcheck():
    from mt.fast.loss import projected_cross_entropy

    h, weight, target = _projection_data(N=5, V=7, V_padded=8, D=3, seed=3)
    h.requires_grad_(True)
    weight.requires_grad_(True)

    def f(x, w):
        return projected_cross_entropy(x, w, target, 0.1, vocab=7, rows=2)[0]

    assert torch.autograd.gradcheck(f, (h, weight))


def test_projected_without_gradients_and_with_another_product():
    """Under no_grad (validation) only the sums are computed; a product function (oneDNN's in
    the CPU training copy) is used for the products."""
    from mt.fast.loss import projected_cross_entropy

    h, weight, target = _projection_data(dtype=torch.float32)
    calls = []

    def product(x, w, bias):
        calls.append(tuple(x.shape))
        return F.linear(x, w, bias)

    with torch.no_grad():
        loss, nll = projected_cross_entropy(h, weight, target, 0.1, 13, product, rows=4)
    ref_loss, ref_nll = label_smoothed_cross_entropy(h @ weight[:13].t(), target, 0.1, None)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    assert calls == [(4, 6), (4, 6), (3, 6)]  # forward products only, block by block


def test_projected_under_bf16_autocast_is_close_to_the_logits_path():
    """Under bf16 autocast the products run in bfloat16 (as F.linear's would) and the scores
    in float32: the same loss and gradients as autocast's projection then the fused loss,
    within bfloat16 rounding."""
    from mt.fast.loss import projected_cross_entropy

    g = torch.Generator().manual_seed(8)
    N, V, D = 300, 1000, 32
    h = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    target = torch.randint(1, V, (N,), generator=g)
    a_h, a_w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    b_h, b_w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, _ = label_smoothed_cross_entropy(F.linear(a_h, a_w), target, 0.1, None)
        loss, _ = projected_cross_entropy(b_h, b_w, target, 0.1, rows=128)
    (ref_loss / N).backward()
    (loss / N).backward()
    assert loss.dtype == torch.float32 and b_h.grad.dtype == b_w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=0)
    for got, want in ((b_h.grad, a_h.grad), (b_w.grad, a_w.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_projected_shape_errors():
    from mt.fast.loss import projected_cross_entropy

    with pytest.raises(ValueError, match="expected h"):
        projected_cross_entropy(torch.zeros(2, 3), torch.zeros(5, 4), torch.zeros(2).long(), 0.1)


def test_gpu_sized_blocks_give_the_reference_loss_and_gradient():
    """The GPU's blockwise loss: blocks of thousands of rows (here 1,024 of 2,500, so three
    blocks), equal to the formula of mt.model.loss in values and gradients (float32, 1e-5)."""
    from mt.fast.loss import projected_block_rows, projected_cross_entropy

    assert projected_block_rows(37000, "cuda") == (1 << 29) // (4 * 37000)  # 3,627 rows
    assert projected_block_rows(8000, "cpu") == 524
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2500, 16, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(48, 16, generator=g, dtype=torch.float64).requires_grad_()
    target = torch.randint(1, 40, (2500,), generator=g)
    loss, nll = projected_cross_entropy(h, w, target, 0.1, vocab=40, rows=1024)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lprobs = F.log_softmax(h2 @ w2[:40].t(), dim=-1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lprobs, target, 0.1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-5, atol=0)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-9)
    assert torch.all(w.grad[40:] == 0)  # padded rows are never scored


def test_the_gpu_training_model_scores_in_blocks():
    from mt.fast import for_training
    from mt.model import build_model
    from mt.schema import ModelConfig

    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2), 40)
    on_gpu = for_training(model, torch.device("cuda"), True, "bf16")
    assert on_gpu.model is model and on_gpu.blockwise and on_gpu.in_flight is None


def test_projected_blocks_come_at_the_products_row_counts():
    """Given the row counts a product pads to (``bucket``), the blocks hold such counts: full
    blocks are cut to one, the last block's rows of h are padded with zeros here (D wide), so
    the product never pads the (rows, V) scores' gradient itself; the padding rows count for
    nothing in the sums and gradients (float64, against the textbook formula)."""
    from mt.fast.loss import projected_cross_entropy

    def bucket(r):  # a multiple of 4
        return -(-r // 4) * 4

    h, weight, target = _projection_data(N=11)
    calls = []

    def product(x, w, bias):
        calls.append(x.size(0))
        return F.linear(x, w, bias)

    h1, w1 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, nll = projected_cross_entropy(h1, w1, target, 0.1, 13, product, rows=6, bucket=bucket)
    loss.backward()
    # rows 6 -> 4 (the largest count <= 6 that needs no padding): blocks of 4, 4 and 3 (-> 4);
    # each block's scores and its G W
    assert calls == [4, 4, 4, 4, 4, 4]
    h2, w2 = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_loss, ref_nll = _explicit(h2 @ w2[:13].t(), target, 0.1)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)
    assert torch.all(w1.grad[13:] == 0)
