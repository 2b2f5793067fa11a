"""Decoding copies (mt.fast.decoding): the oneDNN fp32 copy computes what the model computes, the
bf16 copy stays close, the copies follow weight changes, and search gives the same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_nbest, sharp_random_model
from torch import nn

import mt.fast.decoding
import mt.fast.native as native
from mt.data.batches import make_src
from mt.decode.driver import translate_nbest
from mt.decode.search import beam_search
from mt.fast.decoding import (
    OneDNNLinear,
    for_decoding,
    needs_autocast,
    onednn_available,
    onednn_bf16_available,
)
from mt.fast.fp32 import Fp32Linear
from mt.schema import DecodeConfig
from mt.vocab import BOS

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN linear kernel")
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16_available(), reason="oneDNN has no bfloat16 kernels on this CPU (no AVX-512)"
)


@pytest.fixture()
def model():
    return sharp_random_model(vocab_size=45)  # 45: padded to 48, the head slices it back


def sources(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 45, (n,), generator=g).tolist() for n in lengths]


@needs_onednn
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [None, 4, 64])  # packed for other row counts than it gets
def test_onednn_linear_equals_f_linear(relu, bias, rows):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x = torch.randn(5, 3, 16, generator=g)[:, 1:]  # (5, 2, 16), not contiguous
    expected = F.linear(x.double(), w.double(), b.double() if bias else None)
    expected = expected.relu() if relu else expected
    lin = OneDNNLinear(w, b if bias else None, relu=relu, rows=rows)
    assert (lin.packed is not None) == (rows is not None)  # this torch can pack
    assert lin.weight.data_ptr() == w.data_ptr()  # float32: the given weight, not a copy
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (5, 2, 24)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


@needs_onednn_bf16
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_bf16_linear_is_close_to_f_linear(relu, bias):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x = torch.randn(5, 3, 16, generator=g)[:, 1:]  # (5, 2, 16), not contiguous
    expected = F.linear(x.double(), w.double(), b.double() if bias else None)
    expected = expected.relu() if relu else expected
    y16 = OneDNNLinear(w, b if bias else None, torch.bfloat16, relu)(x)
    assert y16.dtype == torch.float32  # bf16 product, float32 out
    torch.testing.assert_close(y16.double(), expected, atol=0.1, rtol=0.02)


@needs_onednn
def test_fp32_copy_shares_weights_and_computes_the_same_logits(model):
    fast = for_decoding(model, "none", "fp32", onednn=True)
    assert fast.module is not model and for_decoding(model) is fast  # the default, cached
    assert type(fast.module.decoder[0].self_attn.qkv) is OneDNNLinear
    assert type(model.decoder[0].self_attn.qkv) is nn.Linear
    assert not hasattr(model, "decode_head")  # nothing set on the caller's model
    qkv = fast.module.decoder[0].self_attn.qkv.weight
    assert qkv.data_ptr() == model.decoder[0].self_attn.qkv.weight.data_ptr()  # not copied
    assert fast.module.decoder[0].self_attn.qkv.packed is not None  # and packed for oneDNN
    assert fast.module.decoder[0].ffn.w1.packed is not None and fast.head.packed is not None
    assert fast.head.weight.data_ptr() == model.embed.data_ptr()
    src = make_src(sources(0, [7, 3, 11]))
    tgt = torch.randint(4, 45, (3, 6))
    with torch.inference_mode():
        ref = model.decode(tgt, model.encode(src))
        out = fast.decode(tgt, fast.encode(src))
    assert out.shape == ref.shape == (3, 6, 45)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_copies_follow_weight_changes(model):
    fast = for_decoding(model)
    with torch.no_grad():
        model.decoder[1].ffn.w2.bias.add_(1.0)  # an in-place update (an optimiser step)
    again = for_decoding(model)
    assert again is not fast  # rebuilt, and it computes with the new weights
    src, tgt = make_src(sources(1, [5])), torch.randint(4, 45, (1, 4))
    with torch.inference_mode():
        ref = model.decode(tgt, model.encode(src))
        out = again.decode(tgt, again.encode(src))
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("products", ["onednn", "torch", "mt"])
def test_a_stale_copy_is_let_go_before_its_replacement_is_built(model, monkeypatch, products):
    """Validation during training rebuilds the copy after every change of the weights: the old
    one must not be held while the new one is built (two copies at the process's peak)."""
    onednn = {"onednn": True, "torch": None, "mt": "mt"}[products]
    if products == "torch":  # auto, measured torch's: its products with the copy's attention
        monkeypatch.setattr(mt.fast.decoding, "onednn_available", lambda: False)
        monkeypatch.setattr(mt.fast.decoding, "fp32_products", lambda *a, **k: "torch")
    elif products == "onednn" and not onednn_available():
        pytest.skip("no oneDNN linear kernel")
    elif products == "mt" and native.f32_linear() is None:
        pytest.skip(f"no float32 kernel: {native.unavailable_reason() or 'no AVX2'}")
    import gc
    import weakref

    stale = weakref.ref(for_decoding(model, onednn=onednn))
    gc.collect()
    assert stale() is not None  # the cache holds it while the weights are unchanged
    seen = []
    for name in ("onednn_copy", "shared_copy", "fp32_copy"):
        build = getattr(mt.fast.decoding, name)

        def recording(*args, _build=build, **kwargs):
            gc.collect()
            seen.append(stale() is None)
            return _build(*args, **kwargs)

        monkeypatch.setattr(mt.fast.decoding, name, recording)
    with torch.no_grad():
        model.encoder[0].ffn.w1.weight.mul_(0.5)
    fresh = for_decoding(model, onednn=onednn)
    assert seen and all(seen) and fresh is for_decoding(model, onednn=onednn)  # then cached


@needs_onednn_bf16
def test_bf16_copy_is_close_and_keeps_float32_activations(model):
    fast = for_decoding(model, "none", "bf16")
    assert fast.module.decoder[0].ffn.w1.weight.dtype == torch.bfloat16
    assert model.decoder[0].ffn.w1.weight.dtype == torch.float32  # the model is untouched
    assert not needs_autocast(model, "none", "bf16", True)  # the copy casts for itself
    assert needs_autocast(model, "none", "bf16", False)  # plain kernels: autocast
    assert needs_autocast(model, "int8", "bf16", True)
    src, tgt = make_src(sources(2, [9, 4])), torch.randint(4, 45, (2, 5))
    with torch.inference_mode():
        enc = fast.encode(src)
        assert enc.memory.dtype == torch.float32
        out = fast.decode(tgt, enc)
        ref = model.decode(tgt, model.encode(src))
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


@needs_onednn
def test_beam_search_on_the_copy_equals_the_model(model):
    src = make_src(sources(3, [2, 30, 7, 18, 1, 11]))
    ref = beam_search(model, src, 4, 0.6, 0.5, 8, nbest=4)
    assert_same_nbest(ref, beam_search(for_decoding(model), src, 4, 0.6, 0.5, 8, nbest=4))


def test_bf16_without_onednn_bf16_kernels_decodes_the_model_under_autocast(model, monkeypatch):
    # CPUs without AVX-512 (e.g. AMD Zen 3): oneDNN builds no bfloat16 kernels there, so a bf16
    # copy would fail at its first product; the model itself runs under bf16 autocast instead.
    monkeypatch.setattr(mt.fast.decoding, "onednn_bf16_available", lambda: False)
    fast = for_decoding(model, "none", "bf16")
    assert fast.module is model
    assert needs_autocast(model, "none", "bf16", True)
    ids = sources(5, [6, 3])
    cfg = DecodeConfig(beam_size=2, max_len_a=0, max_len_b=4, precision="bf16")
    out = translate_nbest(model, ids, cfg)
    assert len(out) == 2 and all(len(nbest) >= 1 for nbest in out)


def test_without_onednn_the_model_itself_decodes(model, monkeypatch):
    assert for_decoding(model, onednn=False).module is model
    monkeypatch.setattr(mt.fast.decoding, "onednn_available", lambda: False)
    assert for_decoding(model).module is model  # a torch without oneDNN: plain kernels
    ids = sources(4, [6, 2])
    cfg = DecodeConfig(beam_size=3, max_len_a=0, max_len_b=5)
    plain = translate_nbest(model, ids, DecodeConfig(**{**cfg.__dict__, "onednn": False}))
    fast = translate_nbest(model, ids, cfg)
    assert [h[0].tokens for h in plain] == [h[0].tokens for h in fast]


def test_bad_settings_are_named(model):
    with pytest.raises(ValueError, match="decode.precision"):
        for_decoding(model, "none", "fp16")
    with pytest.raises(ValueError, match="decode.quantize"):
        for_decoding(model, "int4")


def test_auto_decode_precision_follows_the_probe(model, monkeypatch):
    """decode.precision=auto: fp32 or bf16, whichever the probe measures faster for the
    decoding copy's products at batch size x beam rows; decoding then runs in it."""
    import mt.fast.probe
    from mt.decode.driver import resolve_decode

    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "put", lambda self, key, entry: None)
    shapes = []

    def measure(make, candidates, size, screen_size, sync=None):
        shapes.append(size)
        return {"fp32": 1.0, "bf16": 0.5}

    monkeypatch.setattr(mt.fast.probe, "measure", measure)
    cfg = DecodeConfig(beam_size=3, batch_size=8, precision="auto")
    assert resolve_decode(cfg, model).precision == "bf16" and shapes == [24]
    assert resolve_decode(DecodeConfig(precision="fp32"), model).precision == "fp32"
    assert resolve_decode(DecodeConfig(precision="auto", quantize="int8"), model).precision == (
        "fp32"
    )
    out = translate_nbest(model, sources(6, [4, 2]), DecodeConfig(beam_size=2, max_len_b=3,
                                                                   max_len_a=0, precision="auto"))
    assert len(out) == 2


def test_the_real_decoding_probe_measures_both_candidates(model, monkeypatch):
    import mt.fast.probe
    from mt.fast.decoding import resolve_precision

    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    assert resolve_precision(model, "auto", "none", True, 32) in ("fp32", "bf16")


def test_onednn_rows_are_bucketed_to_few_sizes():
    """oneDNN keeps a kernel per input shape (about 1 MB each, never freed: 1.5 GB after 1,500
    row counts); products pad their rows to few sizes, at most 6.25% (or 7 rows) more."""
    from mt.fast.onednn import bucket_rows

    sizes = {bucket_rows(r) for r in range(400, 2601)}
    assert len(sizes) <= 48  # 16 per doubling
    for r in range(1, 5000):
        b = bucket_rows(r)
        assert r <= b <= max(r * 1.0625, r + 7)
        assert bucket_rows(b) == b


@needs_onednn
def test_a_bucketed_product_equals_the_plain_one():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x = torch.randn(5, 3, 16, generator=g)  # 15 rows: padded to 16 inside
    torch.testing.assert_close(OneDNNLinear(w, b)(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_auto_onednn_decodes_with_whichever_products_measure_faster(model, monkeypatch):
    """decode.onednn=null: oneDNN's products, mt's float32 kernel or torch's, whichever the
    probe measures fastest among those this build has; torch's in a copy that keeps the
    short-query attention (not the model as written)."""
    import mt.fast.probe
    from mt.fast.attention import ShortQueryAttention

    monkeypatch.setattr(mt.fast.probe.ProbeCache, "get", lambda self, key: None)
    monkeypatch.setattr(mt.fast.probe.ProbeCache, "put", lambda self, key, entry: None)
    built = {"torch": True, "onednn": onednn_available(), "mt": native.f32_linear() is not None}
    products = {"torch": nn.Linear, "onednn": OneDNNLinear, "mt": Fp32Linear}
    for faster, product in products.items():
        if not built[faster]:
            continue
        figures = {c: 1.0 if c == faster else 2.0 for c in products}
        offered = []

        def measure(make, candidates, *a, f=figures, seen=offered, **k):
            seen.append(candidates)
            return {c: f[c] for c in candidates}

        monkeypatch.setattr(mt.fast.probe, "measure", measure)
        monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
        with torch.no_grad():
            model.decoder[0].ffn.w1.bias.add_(0.0)  # a new weights' identity: a new copy
        fast = for_decoding(model, "none", "fp32", None, rows=64)
        # each built kind measured (then, where torch's won, the projection alone)
        assert offered[0] == [c for c in products if built[c]]
        assert fast.module is not model
        assert type(fast.module.decoder[0].self_attn.qkv) is product
        assert type(fast.module.decoder[0].self_attn.core) is ShortQueryAttention


@needs_onednn
def test_auto_onednn_can_run_the_projection_alone(model, monkeypatch):
    """decode.onednn=null where the FFN's products measure faster in torch but the projection
    over the vocabulary faster in oneDNN: torch's Linear layers, oneDNN's projection (sliced
    back to the vocabulary), the same log-probabilities and the same translations."""
    import mt.fast.probe

    asked = []

    def choose(what, *args, **kwargs):
        asked.append(what)
        return "onednn" if what == "decode.onednn_projection" else "torch"

    monkeypatch.setattr(mt.fast.probe, "choose", choose)
    fast = for_decoding(model, "none", "fp32", None, rows=64)
    assert asked == ["decode.fp32_products", "decode.onednn_projection"]
    assert type(fast.module.decoder[0].self_attn.qkv) is nn.Linear
    assert isinstance(fast.head, OneDNNLinear)
    src = make_src(sources(4, [5, 9, 2]))
    tgt = torch.tensor([[BOS, 7, 9], [BOS, 11, 4], [BOS, 5, 5]])
    with torch.inference_mode():
        got = fast.decode(tgt, fast.encode(src), fast.new_cache())
        want = model.decode(tgt, model.encode(src), model.new_cache())
    assert got.shape == want.shape == (3, 3, 45)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _record_calls(monkeypatch, path, then):
    """``search`` replaced by one that appends (process id, thread name, intra-op threads) to
    ``path`` (one line each: a forked worker's calls reach the parent through the file), then
    calls ``then``."""
    import os
    import threading

    import mt.decode.driver

    def spy(*args, **kwargs):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name} {torch.get_num_threads()}\n")
        return then(*args, **kwargs)

    monkeypatch.setattr(mt.decode.driver, "search", spy)


def _calls(path) -> list[tuple[int, str, int]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(p), n, int(t)) for p, n, t in (line.split() for line in lines)]


@pytest.mark.parametrize("processes", [True, False])
@pytest.mark.parametrize(
    "settings",
    [{"beam_size": 1}, {"beam_size": 3, "nbest": 2}, {"beam_size": 2, "quantize": "int8"},
     {"sample": True, "top_k": 5, "seed": 3}],
)  # fmt: skip
def test_batches_decoded_side_by_side_equal_one_worker(
    model, monkeypatch, tmp_path, settings, processes
):
    """decode.workers=2: the same batches in two forked processes of one intra-op thread each
    (or two threads of two, where this process may not fork), give the n-best lists of one
    worker; the thread count is restored after."""
    import os

    import mt.decode.driver

    ids = sources(7, [3, 9, 5, 12, 1, 7, 4, 10, 6, 2, 8, 11])
    cfg = {"batch_size": 2, "max_len_a": 1.0, "max_len_b": 4, "onednn": False, **settings}
    one = translate_nbest(model, ids, DecodeConfig(**cfg, workers=1))
    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes and each == 1)
    _record_calls(monkeypatch, tmp_path / "calls", mt.decode.driver.search)
    before = torch.get_num_threads()
    threads = 2 if processes else 4
    torch.set_num_threads(threads)
    try:
        two = translate_nbest(model, ids, DecodeConfig(**cfg, workers=2))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    seen = _calls(tmp_path / "calls")
    assert len(seen) == 6 and all(t == threads // 2 for _, _, t in seen)
    if processes:  # every batch in a child of this process, none here
        assert all(pid != os.getpid() for pid, _, _ in seen) and len({p for p, _, _ in seen}) <= 2
    else:
        assert all(pid == os.getpid() and n.startswith("mt-decode") for pid, n, _ in seen)
    assert_same_nbest(one, two)


def test_workers_fork_only_from_a_process_without_other_threads():
    """A fork copies only the calling thread (and any lock another holds): with a second thread
    running, side-by-side decoding keeps to threads."""
    import threading

    from mt.decode.driver import forks_workers

    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not forks_workers()
    finally:
        release.set()
        other.join()
    alone = threading.active_count() == 1
    assert forks_workers() == alone and not forks_workers(2)  # never two OpenMP threads each


FORKED_DECODING = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[2])  # the tests' conftest
torch.set_num_threads(2)
import mt.decode.driver as driver
from conftest import sharp_random_model
from mt.schema import DecodeConfig
model = sharp_random_model(vocab_size=45)
g = torch.Generator().manual_seed(7)
ids = [torch.randint(4, 45, (n,), generator=g).tolist() for n in [3, 9, 5, 12, 1, 7, 4, 10]]
cfg = dict(batch_size=2, beam_size=3, nbest=2, max_len_a=1.0, max_len_b=4)
one = driver.translate_nbest(model, ids, DecodeConfig(**cfg, workers=1))
real = driver.search
def spy(*args, **kwargs):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {torch.get_num_threads()}\\n")
    return real(*args, **kwargs)
driver.search = spy
two = driver.translate_nbest(model, ids, DecodeConfig(**cfg, workers=2))
flat = lambda r: [[(h.tokens, h.score) for h in n] for n in r]
print(json.dumps({"one": flat(one), "two": flat(two), "pid": os.getpid(),
                  "threads": torch.get_num_threads(), "forks": driver.forks_workers()}))
"""


def test_a_process_alone_decodes_in_forked_workers_of_one_thread(tmp_path):
    """In a fresh interpreter (no other thread, as ``mt-translate``) with 2 intra-op threads,
    ``decode.workers=2`` decodes every batch in forked children of one thread each (after the
    parent ran its OpenMP threads: the children must not hang), with the n-best lists of one
    worker on both threads (the same tokens; the scores to rounding, one thread summing in
    another order than two)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mt.decode.search import Hypothesis

    calls = tmp_path / "calls"
    tests = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", FORKED_DECODING, str(calls), tests],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["forks"] and out["threads"] == 2

    def hyps(lists):
        return [[Hypothesis(tokens, score, score) for tokens, score in n] for n in lists]

    assert_same_nbest(hyps(out["one"]), hyps(out["two"]))
    seen = [line.split() for line in calls.read_text().splitlines()]
    assert len(seen) == 4  # 8 sentences, batches of 2
    assert all(int(pid) != out["pid"] and threads == "1" for pid, threads in seen)


@pytest.mark.parametrize("processes", [True, False])
def test_an_error_in_a_decoding_worker_is_raised_and_the_threads_restored(
    model, monkeypatch, tmp_path, processes
):
    import time

    import mt.decode.driver

    def failing(*args, **kwargs):
        time.sleep(0.01)  # long enough for the other batches to be cancelled, not run
        raise RuntimeError("out of memory in batch")

    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes)
    _record_calls(monkeypatch, tmp_path / "calls", failing)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # one thread per worker
    try:
        with pytest.raises(RuntimeError, match="out of memory in batch"):
            translate_nbest(model, sources(8, [3] * 40), DecodeConfig(batch_size=1, workers=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert 1 <= len(_calls(tmp_path / "calls")) < 40  # the batches not started were cancelled


def test_decode_workers_auto_is_one_per_thread_on_a_cpu_and_one_on_a_gpu():
    from mt.decode.driver import decode_workers

    threads = torch.get_num_threads()
    assert decode_workers(0, "cpu", 100) == threads
    assert decode_workers(0, "cpu", 1) == 1  # never more workers than batches
    assert decode_workers(3, "cpu", 2) == 2 and decode_workers(3, "cpu", 10) == 3
    assert decode_workers(0, "cuda", 100) == 1 and decode_workers(4, "cuda", 100) == 1
    with pytest.raises(ValueError, match="decode.workers"):
        decode_workers(-1, "cpu", 10)


@pytest.mark.parametrize("processes", [True, False])
def test_stopping_while_workers_decode_drops_the_batches_not_started(
    monkeypatch, tmp_path, processes
):
    """An error (or Ctrl-C) in the loop that reads the workers' results: the batches not yet
    started are dropped, not decoded before the error surfaces."""
    import time

    import mt.decode.driver
    from mt.decode.driver import side_by_side

    monkeypatch.setattr(mt.decode.driver, "forks_workers", lambda each: processes)
    calls = tmp_path / "calls"

    def job(batch):
        with open(calls, "a") as f:
            f.write(f"{batch[0]}\n")
        time.sleep(0.02)
        return batch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(KeyboardInterrupt), side_by_side(2, job) as run:
            results = run([[i] for i in range(60)])  # held, as translate_nbest holds it
            for out in results:
                if out == [1]:
                    raise KeyboardInterrupt
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert 2 <= len(calls.read_text().splitlines()) < 20
