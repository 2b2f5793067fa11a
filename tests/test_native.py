"""mt's C++ attention kernel (mt.fast.native) against the written-out formula, its build and
its fallback, and decoding with it against decoding without it."""

from __future__ import annotations

import logging
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import count_whole_searches, small_searches

import mt.fast.native as native
from mt.data.batches import make_src
from mt.fast.decoding import for_decoding
from mt.model.attention import attention
from mt.model.transformer import build_model
from mt.schema import ModelConfig
from mt.vocab import EOS

CAN_BUILD = shutil.which("c++") is not None and (
    shutil.which("ninja") is not None or (Path(sys.executable).parent / "ninja").exists()
)


def built(kernel):
    """A kernel of mt.fast.native, built here (a compiler and ninja), or the reason it cannot
    be (a failure where it should have been built, a skip elsewhere)."""
    if kernel is None:
        if native.enabled() and CAN_BUILD:
            pytest.fail(f"a compiler and ninja, yet no kernel: {native.unavailable_reason()}")
        pytest.skip(f"no kernel here: {native.unavailable_reason()}")
    return kernel


@pytest.fixture(scope="module")
def op():
    return built(native.short_attention())


def reference(q, k, v, bias, scale_d):
    """The formula (mt.model.attention.attention) on the kernel's layouts: q (N, H, G, d),
    k/v (N, H, T, d), bias (N, T) or None -> (N, G, H, d)."""
    mask = None if bias is None else bias[:, None, None, :]
    out, _ = attention(q, k, v, mask)
    assert math.isclose(1 / math.sqrt(q.size(-1)), scale_d)
    return out.transpose(1, 2)


def inputs(N, H, G, T, d, seed=0, capacity=None):
    """Queries as a transposed view (as the step makes them) and keys/values as views of
    larger caches (capacity positions)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, G, H, d, generator=g).transpose(1, 2)  # (N, H, G, d), not contiguous
    C = capacity or T
    k = torch.randn(N, H, C, d, generator=g)[:, :, :T]
    v = torch.randn(N, H, C, d, generator=g)[:, :, :T]
    return q, k, v


@pytest.mark.parametrize(
    "N,H,G,T,d",
    [(6, 4, 1, 9, 16), (3, 2, 5, 7, 40), (2, 8, 4, 30, 64), (1, 1, 1, 1, 8), (300, 4, 1, 3, 32),
     (5, 2, 3, 17, 128), (4, 2, 1, 8, 64)],  # head sizes compiled for (32, 64, 128) and any other
)
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_computes_the_formula(op, N, H, G, T, d, masked):
    q, k, v = inputs(N, H, G, T, d, seed=N + T, capacity=T + 5)
    bias = None
    if masked:  # each sentence's padding at its end, the first keeps every key
        lengths = [T - (i % T) for i in range(N)]
        keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        bias = torch.zeros(N, T).masked_fill_(~keep, float("-inf"))
    scale = 1 / math.sqrt(d)
    got = op(q, k, v, bias, scale)
    assert got.shape == (N, G, H, d) and got.is_contiguous()
    torch.testing.assert_close(got, reference(q, k, v, bias, scale), atol=2e-6, rtol=1e-5)


def test_the_kernel_takes_a_mask_broadcast_over_rows(op):
    """A zero-stride bias (one mask row for every sentence) reads as its expansion."""
    q, k, v = inputs(4, 2, 3, 6, 16, seed=1)
    row = torch.tensor([0.0, 0.0, float("-inf"), 0.0, float("-inf"), 0.0])
    bias = row.expand(4, 6)
    got = op(q, k, v, bias, 0.25)
    torch.testing.assert_close(got, reference(q, k, v, bias.contiguous(), 0.25))


def test_a_row_with_every_key_masked_is_nan_as_softmax_gives(op):
    q, k, v = inputs(2, 2, 1, 4, 8)
    bias = torch.zeros(2, 4)
    bias[1] = float("-inf")
    got = op(q, k, v, bias, 1 / math.sqrt(8))
    ref = reference(q, k, v, bias, 1 / math.sqrt(8))
    assert torch.isnan(got[1]).all() and torch.isnan(ref[1]).all()
    torch.testing.assert_close(got[0], ref[0])


def test_the_threads_split_the_rows_without_changing_a_bit(op):
    q, k, v = inputs(64, 8, 4, 25, 64, seed=5)
    bias = torch.zeros(64, 25)
    bias[::3, 20:] = float("-inf")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, bias, 0.125)
        torch.set_num_threads(2)
        two = op(q, k, v, bias, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_kernel_names_what_it_cannot_take(op):
    q, k, v = inputs(2, 2, 1, 3, 8)
    with pytest.raises(RuntimeError, match="float32 only"):
        op(q.double(), k.double(), v.double(), None, 0.5)
    with pytest.raises(RuntimeError, match="do not match"):
        op(q, k[:, :1], v, None, 0.5)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        op(q, torch.randn(2, 2, 8, 3).transpose(2, 3), v, None, 0.5)  # (2, 2, 3, 8), stride 3
    with pytest.raises(RuntimeError, match=r"bias must be float32 \(N, T\)"):
        op(q, k, v, torch.zeros(2, 4), 0.5)


def test_the_build_name_follows_the_cpu_the_sources_and_torch(monkeypatch, tmp_path):
    name = native.build_name()
    assert name.startswith("mt_native_") and name == native.build_name()
    names = {name}
    for i, source in enumerate(native.SOURCES):  # each source's text counts
        edited = tmp_path / source.name
        edited.write_text(source.read_text() + "\n// edited\n")
        others = list(native.SOURCES)
        others[i] = edited
        monkeypatch.setattr(native, "SOURCES", tuple(others))
        names.add(native.build_name())
        monkeypatch.undo()
    for header in native.HEADERS:  # and each header's
        edited = tmp_path / header.name
        edited.write_text(header.read_text() + "\n// edited\n")
        monkeypatch.setattr(native, "HEADERS", (edited,))
        names.add(native.build_name())
        monkeypatch.undo()
    monkeypatch.setattr(native, "_cpu_identity", lambda: "vendor_id=Other|flags=sse2")
    names.add(native.build_name())
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    names.add(native.build_name())
    assert len(names) == 3 + len(native.SOURCES) + len(native.HEADERS)  # a name each


def test_switched_off_or_unbuildable_decoding_takes_torchs_path(monkeypatch, caplog):
    from mt.fast.quantize import Int8Linear

    monkeypatch.setenv("MT_NATIVE_KERNELS", "0")
    assert native.short_attention() is None and native.int8_linear() is None
    assert native.int8_linear("avx2") is None
    assert native.smoothed_ce() is None  # the training loss through torch's operators
    assert native.unavailable_reason() == "MT_NATIVE_KERNELS=0"
    w = torch.randn(8, 4)
    assert Int8Linear(w).kernel == "fbgemm"  # int8 through fbgemm's products
    for kernel in ("vnni", "avx2"):
        with pytest.raises(RuntimeError, match=rf"\({kernel}\) is not available here "
                                               r"\(MT_NATIVE_KERNELS=0\)"):
            Int8Linear(w, kernel=kernel)
    monkeypatch.setenv("MT_NATIVE_KERNELS", "1")

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="mt.fast.native"):
        assert native.short_attention() is None
        assert native.short_attention() is None  # asked again: no second try, no second line
        assert native.int8_linear() is None
    assert native.unavailable_reason() == "RuntimeError: Ninja is required to load C++ extensions"
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 1
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2), vocab_size=20).eval()
    assert for_decoding(model, native=True).kernel is None  # decodes through torch


def small_model():
    torch.manual_seed(7)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.1)
    model = build_model(cfg, vocab_size=50).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # far from the initialisation: peaked outputs
    return model


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_decoding_with_the_kernel_finds_what_torchs_path_finds(op, quantize):
    model = small_model()
    g = torch.Generator().manual_seed(2)
    src = make_src([torch.randint(4, 50, (n,), generator=g).tolist() for n in (9, 4, 7, 2, 6)])
    with_kernel = for_decoding(model, quantize, native=True)
    without = for_decoding(model, quantize, native=False)
    assert with_kernel.kernel is op and without.kernel is None
    fused = with_kernel.fused  # each search in one C++ call, fp32 and int8 on mt's kernels,
    assert fused is not None and without.fused is None  # its attention the kernel's
    calls = count_whole_searches(fused)
    with torch.inference_mode():
        for search in small_searches(src):
            got, expected = search(with_kernel), search(without)
            for a, b in zip(got, expected):
                assert [h.tokens for h in a] == [h.tokens for h in b]
                for x, y in zip(a, b):
                    assert math.isclose(x.score, y.score, rel_tol=1e-4, abs_tol=1e-4)
    assert len(calls) == 2  # the kernel did the searches' attention (in C++)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path, caplog):
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 600
    os.utime(lock, (old, old))  # a build killed ten minutes ago
    with caplog.at_level(logging.WARNING, logger="mt.fast.native"):
        native.clear_stale_lock(tmp_path, max_age_s=120)
    assert not lock.exists() and "did not finish" in caplog.text
    lock.touch()  # a build in progress: released 0.3 s later, never removed here
    threading.Timer(0.3, lock.unlink).start()
    start = time.perf_counter()
    native.clear_stale_lock(tmp_path, max_age_s=120)
    assert 0.25 < time.perf_counter() - start < 5 and not lock.exists()


def test_the_build_lock_waits_for_a_live_build_and_not_for_a_killed_one(tmp_path, caplog):
    """``build_lock``: a build in another process is waited for, however long it takes; a
    build killed mid-way holds nothing (the kernel drops its ``flock``), and the torch lock file
    it left is removed at once, however new (a time rule would wait, or remove a live one)."""
    import subprocess
    import sys
    import time

    hold = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))")  # fmt: skip
    flock = str(tmp_path / "build.flock")
    for seconds, kill in ((0.5, False), (60, True)):
        (tmp_path / "lock").touch()  # torch's, as a build leaves it (alive or killed)
        holder = subprocess.Popen([sys.executable, "-c", hold, flock, str(seconds)],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert holder.stdout.readline().strip() == "held"
        if kill:
            holder.kill()
            holder.wait()
        else:
            (tmp_path / "lock").unlink()  # a live build: it ends and releases torch's lock
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="mt.fast.native"):
            with native.build_lock(tmp_path):
                waited = time.perf_counter() - start
                assert not (tmp_path / "lock").exists()
        holder.wait()
        if kill:  # no wait, and the killed build's lock removed with a warning
            assert waited < 5 and "did not finish" in caplog.text
        else:  # waited for the live one
            assert waited > 0.3 and "did not finish" not in caplog.text


def test_without_flock_the_build_lock_falls_back_to_the_lock_files_age(tmp_path, monkeypatch):
    """A file system that refuses ``flock`` (some network mounts) still builds: the rule by the
    age of torch's lock file (an old one removed), not an error that would turn the kernels off."""
    import errno
    import fcntl
    import os
    import time

    def refuse(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 600
    os.utime(lock, (old, old))  # left by a build killed ten minutes ago
    with native.build_lock(tmp_path):
        assert not lock.exists()


def test_the_kernel_is_built_under_its_own_name_and_directory(op):
    directory = native.build_directory()
    assert directory.name == native.build_name()
    assert any(directory.glob("*.so")) and not (directory / "lock").exists()


def test_int8_kernel_from_the_environment(monkeypatch):
    from mt.fast.quantize import Int8Linear

    w = torch.randn(8, 4)
    monkeypatch.setenv("MT_INT8_KERNEL", "fbgemm")
    assert Int8Linear(w).kernel == "fbgemm"
    monkeypatch.setenv("MT_INT8_KERNEL", "int4")
    with pytest.raises(ValueError, match=r"'int4' \(or \$MT_INT8_KERNEL\)"):
        Int8Linear(w)
    monkeypatch.delenv("MT_INT8_KERNEL")
    # auto: mt's VNNI kernel where this CPU has VNNI, else its AVX2 kernel, else fbgemm's
    expected = next((k for k in ("vnni", "avx2") if native.int8_linear(k)), "fbgemm")
    assert Int8Linear(w).kernel == expected
    with pytest.raises(ValueError, match="kind 'int4'"):
        native.int8_linear("int4")


# mt::smoothed_ce: a block of the training loss (mt.fast.loss) and its gradient, in place.


@pytest.fixture(scope="module")
def ce():
    return built(native.smoothed_ce())


def smoothed_reference(z, target, eps):
    """nll, smooth (-sum log p) and the gradient softmax - q of the real rows, in float64."""
    V = z.size(1)
    lp = torch.log_softmax(z[: target.numel()].double(), dim=-1)
    eps_i = eps / (V - 1)
    q = torch.full_like(lp, eps_i).scatter_(-1, target[:, None], 1 - eps)
    return -lp.gather(-1, target[:, None]).squeeze(-1), -lp.sum(-1), lp.exp() - q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,scale,eps", [(1003, 3.0, 0.1), (8, 1.0, 0.0), (77, 30.0, 0.2)])
def test_smoothed_ce_kernel_computes_the_formula(ce, dtype, V, scale, eps):
    """Sums and gradient against float64 (rows past `rows` are padding: zeroed); V off the
    vector width; bfloat16's gradient is the exact one rounded to nearest even."""
    g = torch.Generator().manual_seed(V)
    R, rows = 13, 11
    z = (torch.randn(R, V, generator=g) * scale).to(dtype)
    target = torch.randint(0, V, (rows,), generator=g)
    target[0] = V - 1  # the last column, in the scalar tail where V is off the width
    eps_i = eps / (V - 1)
    nll_ref, smooth_ref, grad_ref = smoothed_reference(z.float(), target, eps)

    before = z.clone()
    nll, smooth = ce(z, target, rows, eps_i, -(1 - eps - eps_i), False)
    assert torch.equal(z, before)  # no gradient asked: the scores stay
    torch.testing.assert_close(nll.double(), nll_ref, rtol=1e-6, atol=2e-6 * scale)
    torch.testing.assert_close(smooth.double(), smooth_ref, rtol=1e-6, atol=1e-3)

    nll2, smooth2 = ce(z, target, rows, eps_i, -(1 - eps - eps_i), True)
    assert torch.equal(nll2, nll) and torch.equal(smooth2, smooth)
    assert torch.all(z[rows:] == 0)
    if dtype == torch.float32:
        torch.testing.assert_close(z[:rows].double(), grad_ref, rtol=1e-5, atol=1e-6)
    else:
        rounded = grad_ref.float().bfloat16()
        assert (z[:rows] == rounded).float().mean() > 0.999  # but for ties of the float32 sum
        torch.testing.assert_close(z[:rows].float(), rounded.float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("V", [1003, 8, 77])
def test_smoothed_ce_kernels_bfloat16_gradient_is_its_float32_one_rounded(ce, V):
    """bfloat16 scores are widened exactly, so the gradient written for them is the float32
    one of the same values rounded to nearest even as torch rounds, bit for bit: eight lanes at
    a time, and in the scalar tail where V is off the vector width."""
    g = torch.Generator().manual_seed(V + 1)
    z16 = (torch.randn(13, V, generator=g) * 3.0).bfloat16()
    target = torch.randint(0, V, (11,), generator=g)
    target[0] = V - 1
    eps_i = 0.1 / (V - 1)
    z32 = z16.float()
    sums32 = ce(z32, target, 11, eps_i, -(1 - 0.1 - eps_i), True)
    sums16 = ce(z16, target, 11, eps_i, -(1 - 0.1 - eps_i), True)
    assert all(torch.equal(a, b) for a, b in zip(sums32, sums16))
    assert torch.equal(z16.view(torch.int16), z32.bfloat16().view(torch.int16))


def test_smoothed_ce_kernel_names_what_it_cannot_take(ce):
    z, t = torch.zeros(3, 5), torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="outside"):
        ce(z, torch.tensor([1, 5]), 2, 0.0, -1.0, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ce(z.double(), t, 2, 0.0, -1.0, True)
    with pytest.raises(RuntimeError, match="contiguous"):
        ce(torch.zeros(5, 3).t(), t, 2, 0.0, -1.0, True)
    with pytest.raises(RuntimeError, match="rows"):
        ce(z, t, 4, 0.0, -1.0, True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_training_loss_with_the_kernel_is_torchs(ce, precision, monkeypatch):
    """mt.fast.loss.projected_cross_entropy on the CPU: the kernel's loss and gradients equal
    torch's operators' (float32: but for the order of sums; bfloat16: to its rounding)."""
    import mt.fast.loss as loss_module
    from mt.fast.onednn import bucket_rows, bucketed_linear

    g = torch.Generator().manual_seed(3)
    h0, w0 = torch.randn(300, 32, generator=g), torch.randn(1000, 32, generator=g)
    target = torch.randint(0, 990, (300,), generator=g)

    def run():
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, nll = loss_module.projected_cross_entropy(
                h, w, target, 0.1, 990, bucketed_linear, rows=128, bucket=bucket_rows
            )
        loss.backward()
        return loss, nll, h.grad, w.grad

    assert loss_module._block_kernel(torch.device("cpu"), torch.bfloat16) is ce
    kernel = run()
    monkeypatch.setattr(loss_module, "_block_kernel", lambda device, dtype: None)
    torch_ops = run()
    for a, b in zip(kernel, torch_ops):
        if precision == "fp32":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)
        else:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert torch.all(kernel[3][990:] == 0)


# mt::best_token: a greedy step's token and log-probability straight from the logits.


@pytest.fixture(scope="module")
def pick():
    return built(native.best_token())


def pick_reference(z, bias, forbid):
    """Greedy's way through torch, in float64: log-softmax of the (restricted) logits, -inf at
    the forbidden columns, the first largest column and its value."""
    lp = torch.log_softmax((z if bias is None else z + bias).double(), dim=-1)
    for col in range(4):
        if forbid >> col & 1:
            lp[:, col] = float("-inf")
    best = lp.max(dim=-1)
    return best.indices, best.values


@pytest.mark.parametrize("V", [5, 8, 77, 8000])
@pytest.mark.parametrize("forbid", [0, 0b0101, 0b1101])
@pytest.mark.parametrize("biased", [False, True])
def test_best_token_is_greedys_choice_through_the_log_softmax(pick, V, forbid, biased):
    g = torch.Generator().manual_seed(V + forbid)
    z = torch.randn(9, V, generator=g) * 4
    z[:, :4] += 3.0  # the special columns often the largest: the forbidding matters
    bias = None
    if biased:  # a shortlist's rows: some columns -inf, the specials never
        bias = torch.zeros(9, V).masked_fill_(torch.rand(9, V, generator=g) < 0.4, float("-inf"))
        bias[:, :4] = 0.0
    token, lprob = pick(z, bias, forbid)
    ref_token, ref_lprob = pick_reference(z, bias, forbid)
    assert token.dtype == torch.int64 and lprob.dtype == torch.float32
    assert token.tolist() == ref_token.tolist()
    torch.testing.assert_close(lprob.double(), ref_lprob, rtol=1e-6, atol=2e-6)  # torch: ~2e-6


def test_best_token_takes_the_first_of_equal_largest_and_says_nan_as_torch_does(pick):
    z = torch.zeros(4, 40)
    z[0, [13, 5, 29]] = 2.0  # ties in different lanes and blocks: the first column
    z[1, [9, 1]] = 2.0  # the first is forbidden (BOS... column 1): the next
    z[2, 6] = float("nan")  # NaN: the first allowed column, NaN (as log-softmax + argmax)
    z[3, :] = float("-inf")
    z[3, 37] = 0.5  # the tail after the last whole block of 8
    token, lprob = pick(z, None, 0b0011)
    assert token.tolist()[:2] == [5, 9] and token[3] == 37
    assert token[2] == 2 and math.isnan(lprob[2])
    assert lprob[3] == 0.0  # the only finite column: probability 1
    expected = 2.0 - math.log(3 * math.exp(2.0) + 37)
    assert math.isclose(lprob[0], expected, rel_tol=1e-6)


def test_best_token_names_what_it_cannot_take(pick):
    z = torch.randn(3, 10)
    with pytest.raises(RuntimeError, match="float32"):
        pick(z.double(), None, 0)
    with pytest.raises(RuntimeError, match="forbid"):
        pick(z, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        pick(z, torch.zeros(3, 9), 0)


def counted_kernel(monkeypatch, name: str, op) -> list[int]:
    """``native.<name>()`` gives ``op`` counting its calls into the list returned, or None
    (``op`` None: the search takes torch's way)."""
    calls: list[int] = []
    counted = None if op is None else (lambda *a: calls.append(1) or op(*a))
    monkeypatch.setattr(native, name, lambda: counted)
    return calls


def search_case(quantize: str, eos_boost: float, seed: int):
    """A decoding copy of :func:`small_model` whose EOS is made likelier (some sentences end at
    once, so that min_len matters), five sources and a shortlist of 30 pieces for them."""
    from mt.decode.shortlist import Shortlist

    model = for_decoding(small_model(), quantize, native=True)
    decode = model.decode

    def eos_likelier(*args, **kw):
        logits = decode(*args, **kw)
        logits[..., EOS] += eos_boost
        return logits

    model.decode = eos_likelier
    # the whole searches in one call do not ask decode
    model.greedy_search = model.beam_search = lambda *a: None
    g = torch.Generator().manual_seed(seed)
    src = make_src([torch.randint(4, 50, (n,), generator=g).tolist() for n in (9, 4, 7, 2, 6)])
    allowed = torch.rand(5, 30, generator=g) < 0.7
    allowed[:, :4] = True
    ids = torch.cat([torch.arange(4), torch.randperm(46, generator=g)[:26].sort().values + 4])
    return model, src, Shortlist(ids, allowed)


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_greedy_search_with_best_token_finds_what_torchs_path_finds(pick, quantize, monkeypatch):
    """The same tokens and scores with the kernel and without, min_len, a forced prefix and a
    shortlist's restriction included."""
    from mt.decode.search import generate
    from mt.decode.strategies import Greedy

    model, src, shortlist = search_case(quantize, eos_boost=4.0, seed=3)

    def run(use, **kw):
        calls = counted_kernel(monkeypatch, "best_token", pick if use else None)
        with torch.inference_mode():
            out = generate(model, src, Greedy(), 1.0, 5, 1, **kw)
        return [h[0] for h in out], calls

    lengths = []
    for kw in ({}, {"min_len": 3}, {"prefix": [[7, 8], [], [9], [], [5, 6, 7]]},
               {"shortlist": shortlist}):
        got, calls = run(True, **kw)
        expected, none = run(False, **kw)
        assert calls and not none
        assert [h.tokens for h in got] == [h.tokens for h in expected]
        lengths.append([len(h.tokens) for h in got])
        for a, b in zip(got, expected):
            assert math.isclose(a.score, b.score, rel_tol=1e-5, abs_tol=1e-5)
    assert 0 in lengths[0] and min(lengths[1]) >= 3  # EOS at once, and min_len kept it off


# mt::top_tokens: a beam step's k best tokens per row and their log-probabilities.


@pytest.fixture(scope="module")
def top():
    return built(native.top_tokens())


@pytest.mark.parametrize("V", [6, 8, 77, 8000])
@pytest.mark.parametrize("forbid", [0, 0b0110, 0b1110])
@pytest.mark.parametrize("biased", [False, True])
def test_top_tokens_are_beams_candidates_through_the_log_softmax(top, V, forbid, biased):
    """Each row's k best columns and log-probabilities as torch's log-softmax (float64), -inf at
    the forbidden columns and a top-k give them; a shortlist's bias row shared by `width` rows."""
    g = torch.Generator().manual_seed(V + forbid)
    width, n = 3, 4
    z = torch.randn(n * width, V, generator=g) * 4
    z[:, :4] += 3.0  # the special columns often among the best: the forbidding matters
    bias = None
    if biased:  # a sentence's shortlist: some columns -inf for all its rows, the specials never
        bias = torch.zeros(n, V).masked_fill_(torch.rand(n, V, generator=g) < 0.4, float("-inf"))
        bias[:, :4] = 0.0
    k = min(6, V - bin(forbid).count("1"))
    lprob, token = top(z, bias, width, forbid, k)
    assert lprob.shape == token.shape == (n * width, k) and token.dtype == torch.int64
    full = z if bias is None else z + bias.repeat_interleave(width, dim=0)
    lp = torch.log_softmax(full.double(), dim=-1)
    for col in range(4):
        if forbid >> col & 1:
            lp[:, col] = float("-inf")
    ref = lp.topk(k, dim=1)
    finite = torch.isfinite(ref.values)
    assert torch.equal(torch.isfinite(lprob), finite)
    assert token[finite].tolist() == ref.indices[finite].tolist()  # no ties in random values
    torch.testing.assert_close(lprob[finite].double(), ref.values[finite], rtol=1e-6, atol=2e-6)
    taken = token.gather(1, torch.arange(k).expand(n * width, k))
    assert all(len(set(row)) == k for row in taken.tolist())  # k different columns
    assert not any(forbid >> int(c) & 1 for c in token.flatten() if c < 4)


def test_top_tokens_order_equal_values_by_column_and_fill_with_allowed_columns(top):
    z = torch.full((3, 40), float("-inf"))
    z[0, [13, 5, 29, 38]] = 2.0  # ties in different lanes, blocks and the tail: by column
    z[1, :] = 0.0  # all equal: the first allowed columns, in order
    z[2, 20] = 1.0  # one finite allowed column: the rest -inf, the first allowed columns
    lprob, token = top(z, None, 1, 0b0011, 5)
    assert token[0].tolist()[:4] == [5, 13, 29, 38] and token[1].tolist() == [2, 3, 4, 5, 6]
    assert token[2].tolist() == [20, 2, 3, 4, 5] and lprob[2, 0] == 0.0
    assert torch.isinf(lprob[2, 1:]).all()
    assert math.isclose(lprob[0, 0], 2.0 - math.log(4 * math.exp(2.0)), rel_tol=1e-6)
    nan = torch.zeros(1, 16)
    nan[0, 7] = float("nan")
    assert torch.isnan(top(nan, None, 1, 0, 3)[0]).all()  # NaN, as the log-softmax gives


def test_top_tokens_names_what_it_cannot_take(top):
    z = torch.randn(4, 10)
    with pytest.raises(RuntimeError, match="float32"):
        top(z.double(), None, 1, 0, 2)
    with pytest.raises(RuntimeError, match="k 9 of 8 allowed"):
        top(z, None, 1, 0b0011, 9)
    with pytest.raises(RuntimeError, match="4 rows in groups of 3"):
        top(z, None, 3, 0, 2)
    with pytest.raises(RuntimeError, match="bias"):
        top(z, torch.zeros(4, 10), 2, 0, 2)


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_beam_search_with_top_tokens_finds_what_torchs_path_finds(top, quantize, K, monkeypatch):
    """The same hypotheses, scores to float rounding, with the kernel and without: min_len, a
    forced prefix (torch's path for its steps), a shortlist and n-best lists included."""
    from mt.decode.search import generate
    from mt.decode.strategies import Beam

    model, src, shortlist = search_case(quantize, eos_boost=3.0, seed=5)

    def run(use, **kw):
        calls = counted_kernel(monkeypatch, "top_tokens", top if use else None)
        with torch.inference_mode():
            return generate(model, src, Beam(K), 1.0, 6, K, alpha=1.0, **kw), calls

    for kw in ({}, {"min_len": 3}, {"prefix": [[7, 8], [], [9], [], [5, 6, 7]]},
               {"shortlist": shortlist}):
        got, calls = run(True, **kw)
        expected, none = run(False, **kw)
        assert calls and not none
        for a, b in zip(got, expected):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            for x, y in zip(a, b):
                assert math.isclose(x.score, y.score, rel_tol=1e-5, abs_tol=1e-5)


# mt::dropout and mt::masked_scale: the CPU training copy's dropout (mt.fast.dropout) in one pass.


@pytest.fixture(scope="module")
def drop_ops():
    return built(native.dropout())


def hashed_keep(n, seed, dropped):
    """The kernel's mask written out in NumPy: element i keeps when the 16 bits at 16 (i mod 4)
    of SplitMix64's output function over seed + (i div 4 + 1) * golden are >= dropped."""
    import numpy as np

    word = np.arange(n, dtype=np.uint64) // np.uint64(4)
    with np.errstate(over="ignore"):
        z = np.uint64(seed % 2**64) + (word + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    shift = (np.arange(n, dtype=np.uint64) % np.uint64(4)) * np.uint64(16)
    draws = (z >> shift) & np.uint64(0xFFFF)
    return torch.from_numpy(draws >= dropped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,seed", [((7, 13), 12345), ((3, 5, 64), -(2**62) - 7), ((2,), 1)])
def test_dropout_kernel_is_the_stated_hash_and_scale(drop_ops, dtype, shape, seed):
    """Mask to the bit against the hash in NumPy (element counts off the 4 draws of a word, a
    negative seed), kept units times the scale in float32, then rounded to the input's dtype."""
    forward, backward = drop_ops
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    dropped, scale = 6554, 65536 / (65536 - 6554)
    y, keep = forward(x, seed, dropped, scale)
    want_keep = hashed_keep(x.numel(), seed, dropped).view(shape)
    assert keep.dtype == torch.bool and torch.equal(keep, want_keep)
    want = torch.where(want_keep, x.float() * torch.tensor(scale, dtype=torch.float32), 0.0)
    assert y.dtype == dtype and torch.equal(y, want.to(dtype))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = backward(g, keep, scale)
    want_g = torch.where(want_keep, g.float() * torch.tensor(scale, dtype=torch.float32), 0.0)
    assert torch.equal(got, want_g.to(dtype))


def test_dropout_kernel_rounds_bfloat16_as_torch_does(drop_ops):
    """bfloat16's vector path (16 elements at a time) against torch's float32 -> bfloat16
    rounding, to the bit: halfway cases both ways, the largest values (rounding up to inf),
    infinities, NaN and signed zeros, the odd tail after the last whole vector; every bit."""
    forward, _ = drop_ops
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1000, generator=g).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38,
                            -3.3895e38, 1.0, 1.00390625, 1.01171875, -1.00390625, 1e-40, -1e-40])
    x = torch.cat([base, special.to(torch.bfloat16), base[:7]])
    for scale in (65536 / (65536 - 6554), 1.00390625, 1.0 + 2**-9, 1.5):
        y, keep = forward(x, 77, 6554, scale)
        factor = torch.where(keep, torch.tensor(scale, dtype=torch.float32), 0.0)
        want = (x.float() * factor).to(torch.bfloat16)  # a dropped -x is -0, as in the kernel
        number = ~want.isnan()
        assert torch.equal(y.isnan(), ~number)
        assert torch.equal(y.view(torch.int16)[number], want.view(torch.int16)[number])


def test_dropout_kernel_keeps_the_stated_share_and_ignores_the_threads(drop_ops):
    """A million draws keep (65536 - dropped) / 65536 of the units, the four parts of one word
    independently; the same seed gives the same mask on 1 and 2 threads and from a
    non-contiguous input; another seed another mask."""
    forward, _ = drop_ops
    n, dropped = 1_000_000, round(0.3 * 65536)
    x = torch.ones(n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, keep1 = forward(x, 99, dropped, 1.0)
        torch.set_num_threads(2)
        y2, keep2 = forward(x, 99, dropped, 1.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(keep1, keep2) and torch.equal(y1, y2)
    share = 1 - dropped / 65536
    sigma = math.sqrt(share * (1 - share) / n)
    assert abs(keep1.double().mean().item() - share) < 5 * sigma
    m = keep1.view(-1, 4).double()
    for a, b in ((0, 1), (1, 3), (2, 3)):
        both = (m[:, a] * m[:, b]).mean().item()
        assert abs(both - share**2) < 5 * math.sqrt(share**2 * (1 - share**2) / (n // 4))
    assert not torch.equal(forward(x, 100, dropped, 1.0)[1], keep1)
    z = torch.randn(6, 10).t()  # non-contiguous: the mask follows the input's own indices
    assert torch.equal(forward(z, 5, dropped, 1.0)[1], forward(z.contiguous(), 5, dropped, 1.0)[1])


def test_dropout_kernel_names_what_it_cannot_take(drop_ops):
    forward, backward = drop_ops
    with pytest.raises(RuntimeError, match="dropped must be in"):
        forward(torch.ones(4), 1, 65536, 1.0)
    with pytest.raises(RuntimeError, match="keep must be bool"):
        backward(torch.ones(4), torch.ones(4), 1.0)
    with pytest.raises(RuntimeError, match="shapes differ"):
        backward(torch.ones(4), torch.ones(3, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16, got Double"):
        forward(torch.ones(4, dtype=torch.float64), 1, 10, 1.0)
