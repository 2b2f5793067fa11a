"""mt's float32 product for decoding (``torch.ops.mt.f32_linear``, ``mt.fast.fp32``) against
the formula in float64, its row independence, its layout, its checks, and a decoding copy on it
against the model as written."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import count_whole_searches, sharp_random_model, small_searches

import mt.fast.native as native
from mt.data.batches import make_src
from mt.fast.decoding import for_decoding
from mt.fast.fp32 import Fp32Linear, blocks, fp32_copy


@pytest.fixture(scope="module")
def op():
    """The kernel, or a skip where it cannot be (no compiler, kernels off, no AVX2 and FMA);
    a failure where the kernels build on an x86 CPU with AVX2 and FMA and it is missing."""
    kernel = native.f32_linear()
    if kernel is None:
        can_build = shutil.which("c++") is not None and (
            shutil.which("ninja") is not None or (Path(sys.executable).parent / "ninja").exists()
        )
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        if native.enabled() and can_build and " avx2 " in flags and " fma " in flags:
            pytest.fail(f"AVX2, FMA, a compiler and ninja, yet no kernel: "
                        f"{native.unavailable_reason()}")  # fmt: skip
        pytest.skip(f"no float32 kernel here: {native.unavailable_reason() or 'no AVX2/FMA'}")
    return kernel


def exact(x, w, b, relu=False):
    """The formula in float64, rounded once to float32."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    return (y.clamp(min=0) if relu else y).float()


@pytest.mark.parametrize(
    "M, K, N",
    [(1, 1, 1), (1, 5, 3), (6, 16, 16), (7, 33, 17), (13, 64, 40), (140, 96, 48),
     (300, 512, 32), (70, 2100, 20)],  # the last two: rows in 3 chunks (of 256 KB of x at most)
)  # fmt: skip
@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_the_product_computes_the_formula(op, M, K, N, biased, relu):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if biased else None
    y = op(x, blocks(w), b, N, relu)
    assert y.shape == (M, N) and y.dtype == torch.float32
    want = exact(x, w, b, relu)
    # float32 sums of K terms: within a few units of the last place of their magnitudes
    tol = 4e-7 * (K**0.5 + 4) * (x.abs() @ w.abs().t() + (0 if b is None else b.abs())).max()
    assert (y - want).abs().max() <= tol
    if relu:
        assert (y >= 0).all() and (y[want == 0] == 0).all()


def test_the_layout_is_blocks_of_16_channels_input_by_input(op):
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = blocks(w)
    assert packed.shape == (2, 3, 16)  # 20 rows padded to 32: two blocks
    assert torch.equal(packed[0, :, 5], w[5]) and torch.equal(packed[1, :, 3], w[19])
    assert (packed[1, :, 4:] == 0).all()  # the padding's rows


def test_a_rows_result_is_its_own_whatever_the_batch_and_the_threads(op):
    """Each output is added in k's order for every row count, chunk and thread split: a batch
    gives each row what that row alone gives, to the bit."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(200, 300, generator=g), torch.randn(200, generator=g)
    x = torch.randn(37, 300, generator=g)
    packed = blocks(w)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            outs.append(op(x, packed, b, 200, False))
            alone = torch.cat([op(x[i : i + 1], packed, b, 200, False) for i in range(37)])
            assert torch.equal(outs[-1], alone)
            assert torch.equal(op(x[5:12], packed, b, 200, False), outs[-1][5:12])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_the_module_flattens_leading_dims_and_its_subset_is_the_full_products_columns(op):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(50, 24, generator=g), torch.randn(50, generator=g)
    layer = Fp32Linear(w, b)
    x = torch.randn(3, 4, 24, generator=g)
    y = layer(x)
    assert y.shape == (3, 4, 50)
    assert torch.equal(y.view(12, 50), layer(x.view(12, 24)))
    ids = torch.tensor([49, 0, 17, 16, 33])
    part = layer.subset(ids)
    assert isinstance(part, Fp32Linear) and part.out_features == 5
    assert torch.equal(part(x), y[..., ids])
    assert Fp32Linear(w, b, relu=True)(x).equal(y.clamp(min=0))


def test_the_kernel_names_what_it_cannot_take(op):
    w, x = blocks(torch.randn(20, 8)), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="x has 7 inputs, w 8"):
        op(torch.randn(3, 7), w, None, 20, False)
    with pytest.raises(RuntimeError, match="n 33 for 32 rows"):
        op(x, w, None, 33, False)
    with pytest.raises(RuntimeError, match="n 16 for 32 rows"):
        op(x, w, None, 16, False)  # the padding is less than a block
    with pytest.raises(RuntimeError, match=r"w must be float32 \(Np/16, K, 16\)"):
        op(x, torch.randn(20, 8), None, 20, False)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \(20\)"):
        op(x, w, torch.randn(19), 20, False)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(x.double(), w, None, 20, False)


def model_and_sources():
    model = sharp_random_model(50)  # some sentences end early, others at their limits
    g = torch.Generator().manual_seed(2)
    src = make_src([torch.randint(4, 50, (n,), generator=g).tolist() for n in (9, 4, 7, 2, 6)])
    return model, src


def test_a_copy_on_the_kernel_decodes_as_the_model_does(op):
    """``fp32_copy`` (every Linear and the projection on the kernel) gives the model's logits
    to float rounding, and ``for_decoding(..., onednn="mt")`` finds the model's translations,
    greedy and beam, in its whole searches (mt's C++)."""
    model, src = model_and_sources()
    copy, head = fp32_copy(model)
    assert isinstance(head, Fp32Linear) and head.out_features == model.output_weight.size(0)
    assert isinstance(copy.decoder[0].ffn.w1, Fp32Linear) and copy.decoder[0].ffn.w1.relu
    tgt = torch.randint(4, 50, (5, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model.decode(tgt, model.encode(src), model.new_cache())
        h = copy.decode(tgt, copy.encode(src), copy.new_cache(), project=False)
        torch.testing.assert_close(head(h)[..., : model.vocab_size], want, atol=1e-4, rtol=1e-4)
    fast = for_decoding(model, "none", "fp32", "mt")
    fused = fast.fused  # the step, its head and the whole searches on the kernel
    assert fused is not None and fused.products == "f32-avx2" and fused.head[2] == "f32-avx2"
    calls = count_whole_searches(fused)
    with torch.inference_mode():
        for search in small_searches(src):
            got, expected = search(fast), search(model)
            assert [[h.tokens for h in a] for a in got] == [[h.tokens for h in b]
                                                            for b in expected]  # fmt: skip
    assert len(calls) == 2  # each search in one C++ call


def test_mt_products_need_fp32_and_the_kernel(op, monkeypatch):
    model, _ = model_and_sources()
    with pytest.raises(ValueError, match="decodes in fp32"):
        for_decoding(model, "none", "bf16", "mt")
    with pytest.raises(ValueError, match="onednn must be true, false, null or 'mt'"):
        for_decoding(model, "none", "fp32", "mkl")
    monkeypatch.setattr(native, "f32_linear", lambda: None)
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        for_decoding(model, "none", "fp32", "mt")
