"""oneDNN's kernel caches sized for training: bounded bucketed shapes, a capacity that holds
them, the precision probe under the run's capacity and buckets, bf32 only where measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mt.fast.onednn as onednn
import mt.fast.precision as precision
import mt.fast.probe
from mt.allocator import ONEDNN_KERNELS, bound_onednn_kernels, size_onednn_kernels
from mt.fast.onednn import (
    MAX_TRAINING_KERNELS,
    PASSES,
    bucket_count,
    bucket_rows,
    bucketed_linear,
    layer_product_shapes,
    training_kernels,
)
from mt.fast.training import for_training
from mt.model.transformer import build_model
from mt.schema import ModelConfig

CAPS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY",
        "MT_ONEDNN_CAPS_SET_BY_MT")  # fmt: skip


@pytest.fixture
def clean_caps(monkeypatch):
    for name in CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(onednn, "_SIZED", set())


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 64), (1, 2048), (1025, 2048),
                                           (300, 700), (2049, 4096), (5, 4)])  # fmt: skip
def test_bucket_count_counts_the_padded_sizes(low, high):
    assert bucket_count(low, high) == len({bucket_rows(r) for r in range(low, high + 1)
                                           if bucket_rows(r) <= high})  # fmt: skip


def test_layer_product_shapes_are_the_models():
    for d, f in ((32, 64), (256, 1024), (48, 96)):  # 96 = 2d: the FFN's and k/v's coincide
        model = build_model(ModelConfig(N=1, d_model=d, d_ff=f, h=4), 40)
        shapes = {m.weight.shape for m in model.modules() if isinstance(m, nn.Linear)}
        assert layer_product_shapes(d, f) == len(shapes)


def test_training_kernels_formula_and_memory_bound():
    # 5 shapes x 16 buckets of (1024, 2048] + 48 projection buckets up to 512, x3 passes, x1.25
    assert training_kernels(5, 2048, 512) == 480
    assert training_kernels(1, 8, 8) == 16  # never below the decoding cap
    assert training_kernels(50, 1 << 16, 1 << 16) == MAX_TRAINING_KERNELS  # memory bounded


def _recording_products(monkeypatch) -> set:
    """(padded rows, weight shape) of every product bucketed_linear hands to torch."""
    seen: set = set()

    def record(x, w, b=None):
        seen.add((x.size(0), tuple(w.shape)))
        return F.linear(x, w, b)

    monkeypatch.setattr(onednn, "F", types.SimpleNamespace(linear=record, pad=F.pad))
    return seen


def test_a_bf16_step_meets_no_more_kernels_than_the_cache_holds(monkeypatch, clean_caps):
    """Batches of many row counts: their bucketed products' shapes, 3 kernels each, fit the
    capacity the run sets for its max_tokens (the count a run's steps would fill)."""
    seen = _recording_products(monkeypatch)
    torch.manual_seed(0)
    vocab, max_tokens = 40, 256
    model = build_model(ModelConfig(N=1, d_model=32, d_ff=64, h=4, dropout=0.0), vocab)
    fwd = for_training(model, torch.device("cpu"), True, "bf16", tokens=max_tokens)
    capacity = int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
    assert capacity == int(os.environ["LRU_CACHE_CAPACITY"]) > ONEDNN_KERNELS
    g = torch.Generator().manual_seed(1)
    rows = set()
    for batch, length in [(b, t) for b in (4, 6, 8) for t in (17, 21, 25, 29, 31)]:  # > 128
        src = torch.randint(4, vocab, (batch, length), generator=g)
        tgt = torch.randint(4, vocab, (batch, length - 2), generator=g)
        rows |= {batch * length, batch * (length - 2)}
        with torch.autocast("cpu", torch.bfloat16):
            h = fwd(src, tgt, project=False).reshape(-1, 32)
            loss, _ = fwd.loss(h, tgt.flatten(), 0.1)
        loss.float().backward()
    assert len(rows) > 16  # many row counts ...
    padded = {r for r, _ in seen}
    assert padded <= {bucket_rows(r) for r in range(1, max_tokens + 1)}  # ... bucketed
    assert PASSES * len(seen) <= capacity  # every kernel they need fits


def test_sizing_keeps_the_users_caps_and_raises_mts(monkeypatch, clean_caps):
    assert bound_onednn_kernels()  # a command's start: 16
    assert size_onednn_kernels(480) == 480  # training raises mt's own cap
    assert os.environ["LRU_CACHE_CAPACITY"] == "480"
    assert size_onednn_kernels(300) == 300
    for name in CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")  # the user's
    assert bound_onednn_kernels()
    assert size_onednn_kernels(480) == 64 and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "480"  # the one mt set is sized


def test_the_precision_probe_runs_under_the_runs_capacity_and_buckets(monkeypatch, clean_caps):
    """The probe sizes the caches exactly as the run does (the same function, the same
    shapes) before its first product, and times bf16 on the run's bucketed products."""
    calls = []

    def fake_layer_step(c, rows, d, f, device, product):
        calls.append((c, product, os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")))
        return lambda: None

    monkeypatch.setattr(precision, "layer_step", fake_layer_step)
    monkeypatch.setattr(precision, "onednn_bf32_available", lambda: False)
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    bound_onednn_kernels()
    shape, vocab = (1024, 64, 128), 500
    precision.resolve_precision("auto", torch.device("cpu"), shape, True, None, vocab)
    probed = {os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]}
    assert {cap for _, _, cap in calls} == probed  # every probe call under the sized cache
    assert {c: p for c, p, _ in calls}["bf16"] is bucketed_linear
    model = build_model(ModelConfig(N=1, d_model=64, d_ff=128, h=4), vocab)
    for_training(model, torch.device("cpu"), True, "bf16", tokens=shape[0])
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == probed.pop()  # the run's own
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) > ONEDNN_KERNELS


def _onednn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


@pytest.mark.skipif(not _onednn_bf16(), reason="no oneDNN bfloat16 kernels here")
def test_no_batch_rebuilds_a_kernel_once_the_cache_is_sized(tmp_path):
    """In a fresh process as an mt command runs (cap 16 first, then the training's sizing):
    a second pass over 24 row counts builds no kernel (oneDNN's own log says cache_hit).
    Under the cap alone every product rebuilds."""
    script = textwrap.dedent("""
        import json, os, sys
        from mt.allocator import bound_onednn_kernels
        bound_onednn_kernels()
        import torch
        from mt.fast.onednn import bucketed_linear, size_kernel_cache
        if sys.argv[1] == "sized":
            size_kernel_cache(256, 32, 64, 40)
        w1, w2 = torch.randn(64, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True)
        def run():
            for rows in range(100, 256, 7):
                x = torch.randn(rows, 32, requires_grad=True)
                with torch.autocast("cpu", torch.bfloat16):
                    y = bucketed_linear(torch.relu(bucketed_linear(x, w1)), w2)
                y.float().sum().backward()
        run()
        print("SECOND PASS", flush=True)
        run()
    """)
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create", PYTHONPATH=os.getcwd())
    for name in CAPS:
        env.pop(name, None)
    counts = {}
    for mode in ("sized", "capped"):
        out = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout  # fmt: skip
        second = out.split("SECOND PASS", 1)[1]
        counts[mode] = (second.count("create:cache_miss"), second.count("create:cache_hit"))
    assert counts["sized"][0] == 0 and counts["sized"][1] > 0, json.dumps(counts)
    assert counts["capped"][0] > 0, json.dumps(counts)


@pytest.mark.parametrize("bf32_here", [False, True])
def test_auto_weighs_bf32_only_where_measured(monkeypatch, caplog, bf32_here):
    """Given figures where bf32 is the fastest: chosen (as fp32 with oneDNN's bf16 math turned
    on by for_training) where the CPU has it; where it does not, never timed, never chosen.
    No cache directory: given figures never reach a shared probe cache."""
    asked = []

    def fake_measure(make, candidates, size, screen_size, sync=None):
        asked.append(list(candidates))
        return {c: {"fp32": 1.0, "bf16": 0.8, "bf32": 0.5}[c] for c in candidates}

    monkeypatch.setattr(mt.fast.probe, "measure", fake_measure)
    monkeypatch.setattr(mt.fast.probe, "_DECIDED", {})
    monkeypatch.setattr(precision, "onednn_bf32_available", lambda: bf32_here)
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    cpu = torch.device("cpu")
    flags = torch.backends.mkldnn.matmul
    before = flags.fp32_precision
    try:
        with caplog.at_level("INFO", logger="mt.fast.probe"):
            choice = precision.resolve_precision("auto", cpu, (256, 32, 64), True, None, 40)
        assert ("bf32" in asked[0]) is bf32_here
        assert choice == ("fp32" if bf32_here else "bf16")
        assert ("bf32 500.0 ms" in caplog.text) is bf32_here
        assert precision.apply_fp32_math(cpu) is bf32_here
        assert (flags.fp32_precision == "bf16") is bf32_here
    finally:
        flags.fp32_precision = before


def test_bf32_math_restores_the_flag_and_the_check_runs():
    flags = torch.backends.mkldnn.matmul
    before = flags.fp32_precision
    with precision.bf32_math():
        assert flags.fp32_precision == "bf16"
    assert flags.fp32_precision == before
    with precision.bf32_math(False):
        assert flags.fp32_precision == before
    assert precision.onednn_bf32_available() in (True, False)
    assert flags.fp32_precision == before


@pytest.mark.skipif(
    not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
    reason="needs a CPU with AMX (torch's own check, as mt.fast.precision.native_bf16 uses)",
)
def test_bf32_is_found_on_an_amx_cpu():
    """oneDNN runs float32 products in bfloat16 on AMX when asked; the check must see it (a
    tiny product runs on float32 kernels there and would hide it)."""
    precision.onednn_bf32_available.cache_clear()
    assert precision.onednn_bf32_available()
