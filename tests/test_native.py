"""mt's C++ training kernels (mt.fast.native: the loss block smoothed_ce, dropout) against the
formulas written out, their build, its lock and the fallback where they cannot be built."""

from __future__ import annotations

import logging
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

import mt.fast.native as native

CAN_BUILD = shutil.which("c++") is not None and (
    shutil.which("ninja") is not None or (Path(sys.executable).parent / "ninja").exists()
)


def built(kernel):
    """A kernel of mt.fast.native, built here (a compiler and ninja), or the reason it cannot
    be (a failure where it should have been built, a skip elsewhere)."""
    if kernel is None:
        if CAN_BUILD:
            pytest.fail(f"a compiler and ninja, yet no kernel: {native.unavailable_reason()}")
        pytest.skip(f"no kernel here: {native.unavailable_reason()}")
    return kernel


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


def test_unbuildable_kernels_leave_training_on_torchs_operators(monkeypatch, caplog):
    """Where the kernels cannot be built, each asks once, says why once, and gives None: the
    loss and dropout then run on torch's operators (mt.fast.loss, mt.fast.dropout)."""

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="mt.fast.native"):
        assert native.smoothed_ce() is None
        assert native.smoothed_ce() is None  # asked again: no second try, no second line
        assert native.dropout() is None
    assert native.unavailable_reason() == "RuntimeError: Ninja is required to load C++ extensions"
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 1


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


def test_the_kernel_is_built_under_its_own_name_and_directory(ce):
    directory = native.build_directory()
    assert directory.name == native.build_name()
    assert any(directory.glob("*.so")) and not (directory / "lock").exists()


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
