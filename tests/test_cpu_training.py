"""mt.fast.training: the CPU training copy computes the model's math (products, gradients,
dropout statistics) and shares the model's parameters."""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mt.fast.attention as attention_module
from mt.fast.attention import CPUTrainingAttention
from mt.fast.dropout import Dropout, drop, dropout
from mt.fast.onednn import (
    BucketedLinear,
    Linear,
    bucket_rows,
    bucketed_linear,
    linear,
    onednn_available,
)
from mt.fast.training import for_training, training_copy
from mt.model.attention import ScaledDotProduct
from mt.model.transformer import build_model
from mt.schema import ModelConfig

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear kernel")


def expected_keep(p: float) -> float:
    """The keep probability of mt's dropout at rate p: 16-bit draws, round(p * 65536) dropped."""
    return 1.0 - round(p * 65536) / 65536


@pytest.fixture(params=["native", "torch"])
def dropout_path(request, monkeypatch):
    """Dropout through mt's one-pass kernel (mt.fast.native; skipped where it is not built:
    tests/test_native.py fails if it should have been) and through torch's operators."""
    import mt.fast.dropout as dropout_module
    import mt.fast.native as native

    if request.param == "native":
        if native.dropout() is None:
            pytest.skip(f"no kernel here: {native.unavailable_reason()}")
    else:
        monkeypatch.setattr(dropout_module, "_kernels", lambda x: None)
    return request.param


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear_forward_and_backward(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16)
    w = torch.randn(24, 16)
    b = torch.randn(24) if bias else None
    up = torch.randn(3, 7, 24)  # an arbitrary upstream gradient

    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    ref_leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    y = linear(leaves[0], leaves[1], leaves[2] if bias else None)
    ref = F.linear(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    # The gradients by hand: dx = up W, dW = up^T x, db = sum of up.
    torch.testing.assert_close(leaves[0].grad, up @ w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        leaves[1].grad, up.reshape(-1, 24).t() @ x.reshape(-1, 16), rtol=1e-4, atol=1e-4
    )


@needs_onednn
def test_linear_non_contiguous_input_and_frozen_weight():
    torch.manual_seed(1)
    x = torch.randn(8, 5, 12).transpose(0, 1).requires_grad_()  # (5, 8, 12), strided
    w = torch.randn(6, 12)  # no gradient wanted for the weight
    y = linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 8, 6) @ w, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # inference: the plain oneDNN product
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bucketed_linear_is_f_linear_on_padded_rows(precision):
    """bf16 training's products (autocast hands them to oneDNN, which keeps a kernel per row
    count) see a bucketed row count, and compute F.linear's values and gradients."""
    from torch.overrides import TorchFunctionMode

    class Rows(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                self.seen.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(2)
    x, w, b = torch.randn(37, 16), torch.randn(24, 16), torch.randn(24)
    up = torch.randn(37, 24)
    got = [t.clone().requires_grad_() for t in (x, w, b)]
    want = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), Rows() as rows:
        y = bucketed_linear(*got)
        ref = F.linear(*want)
    assert rows.seen == [bucket_rows(37), 37] and bucket_rows(37) == 40
    assert y.shape == ref.shape == (37, 24) and y.dtype == ref.dtype
    tol = 1e-5 if precision == "fp32" else 1e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    (y.float() * up).sum().backward()
    (ref.float() * up).sum().backward()
    for g, r in zip(got, want):
        torch.testing.assert_close(g.grad, r.grad, rtol=tol, atol=tol * 10)
    assert bucketed_linear(x[:32], w).shape == (32, 24)  # a bucket size: no padding
    assert bucketed_linear(x.reshape(37, 2, 8)[:, 0].reshape(37, 1, 8), w[:, :8]).shape == (
        37,
        1,
        24,
    )


def test_linear_leaves_other_dtypes_to_torch():
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(linear(x, w), F.linear(x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x.float(), w.float())
    assert y.dtype == torch.bfloat16  # autocast's own bfloat16 product


def test_dropout_keeps_units_with_the_stated_probability(dropout_path):
    torch.manual_seed(2)
    n, p = 1_000_000, 0.1
    x = torch.ones(n)
    y = dropout(x, p)
    keep = expected_keep(p)
    kept = (y != 0).double().mean().item()
    sigma = math.sqrt(keep * (1 - keep) / n)
    assert abs(kept - keep) < 5 * sigma  # a fair 16-bit draw per element
    # Kept units are scaled by 1 / P(keep): the expectation is the input.
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / keep))
    assert abs(y.double().mean().item() - 1.0) < 5 * sigma / keep
    # Neighbouring elements (the four 16-bit parts of one 64-bit draw) are independent.
    m = (y != 0).view(-1, 4).double()
    both = (m[:, 0] * m[:, 1]).mean().item()
    assert abs(both - keep**2) < 5 * math.sqrt(keep**2 * (1 - keep**2) / (n // 4))


@pytest.mark.parametrize("p", [0.3, 0.5])
def test_dropout_other_rates_and_gradient(p, dropout_path):
    torch.manual_seed(3)
    x = torch.randn(200, 300, requires_grad=True)
    y = dropout(x, p)
    frac = (y != 0).float().mean().item()
    assert abs(frac - expected_keep(p)) < 0.01
    y.sum().backward()  # the gradient is the mask times the scale
    mask = (y != 0).float() / expected_keep(p)
    torch.testing.assert_close(x.grad, mask)


def test_dropout_off_and_bad_rate(dropout_path):
    x = torch.randn(5, 6)
    assert dropout(x, 0.1, training=False) is x
    assert dropout(x, 0.0) is x
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.0)
    torch.manual_seed(4)
    a = dropout(torch.ones(1000), 0.2)
    torch.manual_seed(4)
    b = dropout(torch.ones(1000), 0.2)
    assert torch.equal(a, b)  # torch's generator: seeded runs repeat
    c = dropout(torch.ones(1000, dtype=torch.float64), 0.2)  # not the kernel's: torch's way
    assert c.dtype == torch.float64 and set(c.unique().tolist()) == {0.0, 1 / expected_keep(0.2)}


CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.1)


def test_training_copy_shares_parameters_and_swaps_modules():
    torch.manual_seed(5)
    model = build_model(CFG, vocab_size=40)
    copy = training_copy(model)
    assert list(copy.state_dict()) == list(model.state_dict())
    for (name, a), (_, b) in zip(model.named_parameters(), copy.named_parameters()):
        assert a is b, name
    kinds = {type(m) for m in copy.modules()}
    assert nn.Dropout not in kinds and Dropout in kinds
    if onednn_available():
        assert nn.Linear not in kinds and Linear in kinds
    # The model itself is untouched.
    assert nn.Dropout in {type(m) for m in model.modules()}
    assert nn.Linear in {type(m) for m in model.modules()}
    assert "product" not in vars(model)
    cores = {type(m) for m in copy.modules() if isinstance(m, ScaledDotProduct)}
    assert cores == {CPUTrainingAttention}
    assert {type(m) for m in model.modules() if isinstance(m, ScaledDotProduct)} == {
        ScaledDotProduct
    }


def test_training_copy_computes_the_model_without_dropout():
    torch.manual_seed(6)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    model = build_model(cfg, vocab_size=40)
    copy = training_copy(model)
    src = torch.tensor([[5, 6, 7, 3, 0], [8, 9, 10, 11, 3]])
    tgt = torch.tensor([[2, 12, 13, 0], [2, 14, 15, 16]])
    torch.testing.assert_close(copy(src, tgt), model(src, tgt), rtol=1e-4, atol=1e-5)

    def grads(module):
        module.zero_grad()
        F.cross_entropy(module(src, tgt).flatten(0, 1), tgt.roll(-1, 1).flatten()).backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(grads(copy), grads(model)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_copy_scores_in_row_blocks_like_the_model(precision, monkeypatch):
    """The copy's training loss (projection and loss in row blocks, several blocks here) gives
    the model's loss (logits, then the fused loss) and the same gradients, through the
    training step's own ``batch_loss``; the model keeps the logits path."""
    import numpy as np

    import mt.fast.loss
    from mt.data.batches import collate
    from mt.train.update import batch_loss

    monkeypatch.setattr(mt.fast.loss, "BLOCKWISE_MIN_ROWS", 3)
    monkeypatch.setattr(mt.fast.loss, "BLOCKWISE_BLOCK_BYTES", 3 * 4 * 40)  # 3 rows a block
    torch.manual_seed(9)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, vocab_multiple=16)
    model = build_model(cfg, vocab_size=40)  # 48 rows, 40 scored
    copy = for_training(model, torch.device("cpu"), True, precision)
    assert copy.blockwise and not hasattr(model, "blockwise")
    rng = np.random.default_rng(2)
    pairs = [(rng.integers(4, 40, n), rng.integers(4, 40, m)) for n, m in [(5, 4), (3, 7), (6, 2)]]
    batch = collate(pairs)

    def loss_and_grads(module):
        model.zero_grad()
        loss, nll = batch_loss(module, batch, 0.1, precision)
        (loss / batch.ntokens).backward()
        return loss, nll, [p.grad.clone() for p in model.parameters()]

    got, want = loss_and_grads(copy), loss_and_grads(model)
    assert torch.all(model.embed.grad[40:] == 0)
    if precision == "fp32":
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        return
    # bf16: both paths round differently; each must be as close to float32 as the other.
    model.zero_grad()
    exact = batch_loss(model, batch, 0.1, "fp32")
    (exact[0] / batch.ntokens).backward()
    exact_grads = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(got[0], exact[0], rtol=0.01, atol=0)
    torch.testing.assert_close(got[1], exact[1], rtol=0.01, atol=0)

    def error(grads):
        return sum(float((g - e).norm()) for g, e in zip(grads, exact_grads))

    assert error(got[2]) <= 1.5 * error(want[2])


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("causal", [False, True])
def test_written_out_attention_is_the_formula_with_its_dropout(p, causal, dropout_path):
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 3, 4, 8, requires_grad=True) for _ in range(3))
    keep = torch.tensor([True, True, True, False]).view(1, 1, 1, 4).expand(2, 1, 1, 4)
    mask = None if causal else keep
    torch.manual_seed(8)
    out, _ = CPUTrainingAttention()(q, k, v, mask, causal, dropout_p=p)
    # By hand: the paper's formula, padded (or future) keys at -inf, then the same 16-bit mask
    # (same seed).
    allowed = torch.ones(4, 4).tril().bool() if causal else keep
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(8)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    torch.manual_seed(8)
    want = (dropout(weights, p) if p else weights) @ v
    torch.testing.assert_close(out, want)
    if p == 0:  # and SDPA's own result
        sdpa, _ = ScaledDotProduct()(q, k, v, mask, causal)
        torch.testing.assert_close(out, sdpa)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    for got, ref in zip(grads, torch.autograd.grad((want * g).sum(), (q, k, v))):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_written_out_attention_under_autocast_runs_in_float32(p, dropout_path):
    """Under bf16 autocast the core takes bfloat16 q, k, v (what the autocast products give)
    and computes the written-out formula in float32 on them, to the bit, forward and backward:
    no bfloat16 batched product (each batch shape would build a oneDNN kernel)."""
    from mt.model.attention import attention

    torch.manual_seed(11)
    q, k, v = (torch.randn(2, 3, 6, 8).bfloat16().requires_grad_() for _ in range(3))
    mask = torch.rand(2, 1, 1, 6) > 0.3
    mask[..., 0] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(12)
        out, _ = CPUTrainingAttention()(q, k, v, mask, dropout_p=p)
    torch.manual_seed(12)
    want, _ = attention(q.float(), k.float(), v.float(), mask, False, p, dropout)  # no autocast
    assert out.dtype == want.dtype == torch.float32
    assert torch.equal(out, want)
    g = torch.randn(out.shape)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    for got, ref in zip(grads, torch.autograd.grad((want * g).sum(), (q, k, v))):
        assert got.dtype == ref.dtype == torch.bfloat16  # back to the inputs' dtype
        assert torch.equal(got, ref)


def _saved_for_backward(fn) -> list[torch.Tensor]:
    """The tensors autograd keeps for the backward pass of ``fn()``."""
    saved = []

    def keep(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return saved


def test_training_attention_keeps_the_weights_and_a_bool_mask_for_backward():
    """What the backward pass holds per attention: q, k, v, the float weights and the bool
    mask (5 bytes per query-key pair), not the float mask and the dropped weights as well."""
    from mt.model.attention import attention

    q, k, v = (torch.randn(2, 4, 30, 8, requires_grad=True) for _ in range(3))
    pairs = 2 * 4 * 30 * 30
    saved = _saved_for_backward(lambda: CPUTrainingAttention()(q, k, v, None, True, 0.1))
    big = sorted(str(t.dtype) for t in saved if t.numel() == pairs)
    assert big == ["torch.bool", "torch.float32"]
    assert sum(t.numel() for t in saved if t.numel() != pairs) == 3 * q.numel()  # q, k, v

    # autograd over the formula with a float mask keeps three float tensors of that size
    def float_mask(w, p):
        return w * (torch.rand_like(w) >= p).float().div_(1 - p)

    formula = _saved_for_backward(lambda: attention(q, k, v, None, True, 0.1, float_mask))
    floats = {t.data_ptr() for t in formula if t.numel() == pairs and t.is_floating_point()}
    assert len(floats) == 3


def test_dropout_keeps_a_bool_mask_for_backward(dropout_path):
    x = torch.randn(50, 40, requires_grad=True)
    saved = _saved_for_backward(lambda: dropout(x, 0.1))
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bool, x.shape)]


def test_training_copy_attention_goes_through_its_kernels(monkeypatch):
    torch.manual_seed(9)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, attention_dropout=0.2)
    model = build_model(cfg, vocab_size=40)
    copy = training_copy(model)
    calls = []

    def spy(x, p):
        calls.append((tuple(x.shape), p))
        return drop(x, p)

    monkeypatch.setattr(attention_module, "drop", spy)
    src = torch.tensor([[5, 6, 7, 3, 0], [8, 9, 10, 11, 3]])
    tgt = torch.tensor([[2, 12, 13, 0], [2, 14, 15, 16]])
    model(src, tgt)
    assert calls == []  # the model itself: SDPA with torch's dropout
    copy(src, tgt)
    # encoder self-attention, decoder self-attention, encoder-decoder attention, per layer
    assert sorted(calls) == sorted(
        [((2, 4, 5, 5), 0.2)] * 2 + [((2, 4, 4, 4), 0.2)] * 2 + [((2, 4, 4, 5), 0.2)] * 2
    )
    calls.clear()
    copy.eval()
    copy(src, tgt)
    assert calls == []  # no dropout in eval mode
    assert type(model.encoder[0].self_attn.core) is ScaledDotProduct  # the model: SDPA
    assert type(copy.encoder[0].self_attn.core) is CPUTrainingAttention


def test_training_copy_in_bfloat16_matches_the_model():
    torch.manual_seed(10)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    model = build_model(cfg, vocab_size=40)
    copy = training_copy(model, products=False)  # bf16 training: autocast's products
    src = torch.tensor([[5, 6, 7, 3, 0], [8, 9, 10, 11, 3]])
    tgt = torch.tensor([[2, 12, 13, 0], [2, 14, 15, 16]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = copy(src, tgt), model(src, tgt)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_hold_freed_memory_is_idempotent_and_harmless():
    import sys

    from mt.fast.memory import hold_freed_memory

    first = hold_freed_memory()
    assert hold_freed_memory() == first
    if sys.platform.startswith("linux"):
        import platform

        if platform.libc_ver()[0] == "glibc":
            assert first  # glibc takes the settings
    x = torch.randn(2000, 1000)  # 8 MB: allocation still works and frees
    del x


def test_bound_onednn_kernels_sets_the_cap_unless_the_user_did(monkeypatch):
    from mt.allocator import ONEDNN_KERNELS, bound_onednn_kernels

    caps = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's
    for name in (*caps, "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    assert bound_onednn_kernels()
    assert all(os.environ[name] == str(ONEDNN_KERNELS) for name in caps)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        for cap in caps:
            monkeypatch.delenv(cap, raising=False)
        monkeypatch.setenv(name, "500")  # the user's choice stands; ideep's cap is still set
        assert bound_onednn_kernels()
        assert os.environ[name] == "500" and os.environ["LRU_CACHE_CAPACITY"] == str(ONEDNN_KERNELS)
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "500")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "300")
    assert not bound_onednn_kernels()  # both the user's: nothing set here
    assert os.environ["LRU_CACHE_CAPACITY"] == "300"


@pytest.mark.parametrize("command", ["translate", "serve", "evaluate", "train"])
def test_every_command_bounds_onednn_before_its_task(monkeypatch, command):
    """The caps are set as a command starts, before its configuration is even read (so a
    decoding server holds 16 built products, not 1,024)."""
    from mt import cli
    from mt.allocator import ONEDNN_KERNELS

    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY",
                 "DNNL_PRIMITIVE_CACHE_CAPACITY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [f"mt-{command}", "no_such_node.key=1"])
    with pytest.raises(SystemExit):  # the bad key ends it before any task runs
        getattr(cli, f"{command}_main")()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_KERNELS)
    assert os.environ["LRU_CACHE_CAPACITY"] == str(ONEDNN_KERNELS)


def test_for_training_picks_the_copy_on_cpu_only():
    model = build_model(CFG, vocab_size=40)
    assert for_training(model, torch.device("cpu"), False, "fp32").model is model
    assert for_training(model, torch.device("cuda"), True, "fp32").model is model
    fp32 = for_training(model, torch.device("cpu"), True, "fp32")
    bf16 = for_training(model, torch.device("cpu"), True, "bf16")
    assert fp32.model is not model and Dropout in {type(m) for m in fp32.modules()}
    # bf16 keeps autocast's products, over bucketed row counts.
    kinds = {type(m) for m in bf16.modules()}
    assert nn.Linear not in kinds and BucketedLinear in kinds and Dropout in kinds
    assert bf16.product is bucketed_linear  # the projection's row blocks too
    assert BucketedLinear not in {type(m) for m in fp32.modules()}


def test_packed_ffn_runs_on_the_real_rows_of_a_padded_batch_only():
    """mt.fast.packing: a side is packed when at least MIN_PADDING of it is padding (decided
    from sizes on the host); the FFN then runs on the real rows, zeros at the padded ones."""
    import numpy as np

    from mt.data.batches import collate
    from mt.fast.packing import MIN_PADDING, InFlight, Packed
    from mt.model.transformer import FeedForward

    rng = np.random.default_rng(4)
    lengths = [(9, 2), (3, 8)]
    padded = collate([(rng.integers(4, 40, n), rng.integers(4, 40, m)) for n, m in lengths])
    even = collate([(rng.integers(4, 40, 20), rng.integers(4, 40, 20)) for _ in range(2)])
    even_src = collate([(rng.integers(4, 40, n), rng.integers(4, 40, 5)) for n in (20, 19)])
    flight = InFlight()
    flight.set(padded.src, padded.tgt_in, padded.real)
    assert flight.src is padded.real.src and flight.tgt is padded.real.tgt
    for pad, tokens in ((flight.src_pad, padded.src), (flight.tgt_pad, padded.tgt_in)):
        assert torch.equal(pad, (tokens.reshape(-1) == 0).nonzero().squeeze(1))  # the others
    flight.set(even.src, even.tgt_in, even.real)
    assert flight.src is None and flight.tgt is None  # no padding at all
    flight.set(even_src.src, even_src.tgt_in, even_src.real)
    assert even_src.real.src is not None and flight.src is None  # 1 of 42: below MIN_PADDING
    assert 1 / 42 < MIN_PADDING
    flight.set(padded.src, padded.tgt_in, None)
    assert flight.src is None and flight.tgt is None  # decoding: never packed

    torch.manual_seed(11)
    ffn = FeedForward(16, 32)
    packed = Packed(ffn, flight, "tgt")
    x = torch.randn(*padded.tgt_in.shape, 16, requires_grad=True)
    flight.set(padded.src, padded.tgt_in, padded.real)
    with torch.no_grad():  # memory that held NaN before: the padded rows still come out 0
        torch.full((64, 32), float("nan"))
    y = packed(x)
    real = padded.tgt_in.reshape(-1) != 0  # tgt_in: BOS + ids, PAD after
    flat, want = y.reshape(-1, 16), ffn(x).reshape(-1, 16)
    torch.testing.assert_close(flat[real], want[real])
    assert torch.all(flat[~real] == 0)
    flat[real].sum().backward()
    grad = x.grad.reshape(-1, 16)
    assert torch.all(grad[~real] == 0) and torch.all(grad[real].abs().sum(-1) > 0)

    # The training copy packs every position-wise product: FFNs and attention projections,
    # the encoder-decoder attention's keys and values on the source side.
    copy = for_training(build_model(CFG, vocab_size=40), torch.device("cpu"), True, "fp32")
    sides = [(name, m.side) for name, m in copy.model.named_modules() if isinstance(m, Packed)]
    enc = {"ffn": "src", "self_attn.qkv": "src", "self_attn.out": "src"}
    dec = {"ffn": "tgt", "self_attn.qkv": "tgt", "self_attn.out": "tgt", "cross_attn.q": "tgt",
           "cross_attn.kv": "src", "cross_attn.out": "tgt"}  # fmt: skip
    want = [(f"encoder.{i}.{k}", v) for i in range(CFG.N) for k, v in enc.items()]
    want += [(f"decoder.{i}.{k}", v) for i in range(CFG.N) for k, v in dec.items()]
    assert sorted(sides) == sorted(want)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packed_rows_come_at_the_products_row_counts(precision):
    """With the products' row counts (``InFlight(bucket)``), the real rows are joined by as many
    padded ones as reach such a count, so no product pads its input; the padded rows' gradient
    is zero, and the training copy's loss and gradients are those of the real rows alone
    (bf16: to the bit; fp32: the weight gradients' sums run over more rows, zeros, whose
    order MKL may block otherwise)."""
    import numpy as np

    from mt.data.batches import collate
    from mt.fast.packing import InFlight, Packed, pack
    from mt.fast.training import TrainingModel
    from mt.train.update import batch_loss

    rng = np.random.default_rng(5)
    lens = [(9, 3), (2, 8), (4, 5), (6, 1)]
    batch = collate([(rng.integers(4, 40, n), rng.integers(4, 40, m)) for n, m in lens])
    flight = InFlight(bucket_rows)
    flight.set(batch.src, batch.tgt_in, batch.real)
    for side, tokens, real in (("src", batch.src, batch.real.src), ("tgt", batch.tgt_in,
                                                                      batch.real.tgt)):  # fmt: skip
        rows, pad = getattr(flight, side), getattr(flight, f"{side}_pad")
        want = min(bucket_rows(real.numel()), tokens.numel())
        assert real.numel() < want == rows.numel()  # padded rows joined (this batch has them)
        assert torch.equal(rows[: real.numel()], real)
        assert torch.equal(torch.cat((rows, pad)).sort().values, torch.arange(tokens.numel()))
        assert torch.all(tokens.reshape(-1)[rows[real.numel() :]] == 0)

    torch.manual_seed(12)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    model = build_model(cfg, vocab_size=40)
    onednn = precision == "fp32" and onednn_available()
    copy = training_copy(model, products=onednn, bucketed=precision == "bf16")
    in_flight = pack(copy, bucket_rows)
    product = linear if onednn else (bucketed_linear if precision == "bf16" else F.linear)
    trainer = TrainingModel(copy, blockwise=True, product=product, in_flight=in_flight)
    seen = []
    for m in copy.modules():
        if isinstance(m, Packed):
            m.register_forward_pre_hook(lambda mod, args: seen.append(
                getattr(mod.in_flight, mod.side).numel()))  # fmt: skip

    def loss_and_grads(bucket):
        in_flight.bucket = bucket
        model.zero_grad()
        loss, nll = batch_loss(trainer, batch, 0.1, precision)
        (loss / batch.ntokens).backward()
        return [loss, nll] + [p.grad.clone() for p in model.parameters()]

    joined, alone = loss_and_grads(bucket_rows), seen[:]
    seen.clear()
    real = loss_and_grads(None)
    assert all(bucket_rows(n) == n for n in alone) and not all(bucket_rows(n) == n for n in seen)
    for a, b in zip(joined, real):
        if precision == "bf16":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_training_products_follow_the_probe(monkeypatch):
    """fp32 training on a CPU runs its products on oneDNN only where that measures faster than
    torch's at the run's shapes (on an AMD Zen 3 it is slower)."""
    import mt.fast.probe

    model = build_model(CFG, vocab_size=40)
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    for faster in ("torch", "onednn"):
        figures = (
            {"torch": 1.0, "onednn": 2.0} if faster == "torch" else {"torch": 2.0, "onednn": 1.0}
        )
        monkeypatch.setattr(mt.fast.probe, "measure", lambda *a, f=figures, **k: dict(f))
        monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
        kinds = {type(m) for m in for_training(model, torch.device("cpu"), True, "fp32").modules()}
        assert (Linear in kinds) == (faster == "onednn" and onednn_available())
        assert Dropout in kinds  # the rest of the copy either way


def test_the_losss_projection_follows_its_own_probe(monkeypatch):
    """fp32: the blockwise loss projects onto the vocabulary with oneDNN's products where its
    own probe (at the loss's block shape) measures them faster, whatever the layers' probe
    chose (on an AMD Zen 4 torch's won the layers and oneDNN the projection); bf16 never asks."""
    import mt.fast.probe
    from mt.fast.loss import projected_block_rows

    model = build_model(CFG, vocab_size=40)
    asked: dict[str, str] = {}
    winners: dict[str, str] = {}

    def choose(what, device, shape, make, candidates, *args, **kwargs):
        asked[what] = shape
        return winners[what]

    monkeypatch.setattr(mt.fast.probe, "choose", choose)
    cpu = torch.device("cpu")
    for layers in ("torch", "onednn"):
        for projection in ("torch", "onednn"):
            winners.update({"train.products": layers, "train.projection": projection})
            asked.clear()
            fwd = for_training(model, cpu, True, "fp32")
            if not onednn_available():
                assert fwd.product is F.linear and not asked
                continue
            kinds = {type(m) for m in fwd.modules()}
            assert (Linear in kinds) == (layers == "onednn")
            assert fwd.product is (linear if projection == "onednn" else F.linear)
            assert fwd.bucket is (bucket_rows if projection == "onednn" else None)
            rows = projected_block_rows(40, "cpu", bucket_rows)
            assert asked["train.projection"] == f"projection {rows}x{CFG.d_model}x40"
    asked.clear()
    fwd = for_training(model, cpu, True, "bf16")
    assert "train.projection" not in asked and fwd.product is bucketed_linear


def test_the_projection_probe_times_a_loss_blocks_two_products():
    """projection_step: the block's scores x W^T and its input gradient G W (W^T passed as the
    weight, as the loss passes it), the kernels built on a call before the timing."""
    from mt.fast.precision import projection_step

    seen = []

    def product(x, w, bias=None):
        seen.append((tuple(x.shape), tuple(w.shape)))
        return F.linear(x, w, bias)

    step = projection_step(12, 8, 40, torch.device("cpu"), product)
    assert seen == [((12, 8), (40, 8)), ((12, 40), (8, 40))]
    step()
    assert len(seen) == 4 and seen[2:] == seen[:2]
