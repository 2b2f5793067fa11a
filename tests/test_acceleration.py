"""Speed settings that leave the math alone: padded lengths rounded up for torch.compile,
compile before the DDP wrap (torch's documented order), compiled graphs counted in the log,
TF32 on CUDA only."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import mt.fast.precision
import mt.train.recipe
from mt.data.batches import collate
from mt.fast.compile import compile_model, pad_multiple
from mt.fast.precision import native_bf16, resolve_precision, set_fp32_precision
from mt.model.transformer import build_model
from mt.schema import ModelConfig, TrainConfig
from mt.train.update import batch_loss

V = 40


def _pairs():
    rng = np.random.default_rng(3)
    return [(rng.integers(4, V, s), rng.integers(4, V, t)) for s, t in [(9, 3), (2, 6), (5, 12)]]


def test_padding_to_a_multiple_keeps_tokens_positions_and_loss():
    plain, bucketed = collate(_pairs()), collate(_pairs(), pad_multiple=8)
    assert plain.src.shape == (3, 10) and plain.tgt_in.shape == (3, 13)
    assert bucketed.src.shape == (3, 16) and bucketed.tgt_in.shape == (3, 16)
    assert bucketed.ntokens == plain.ntokens == 4 + 7 + 13
    for name in ("src", "tgt_in", "tgt_out"):
        a, b = getattr(plain, name), getattr(bucketed, name)
        assert torch.equal(b[:, : a.size(1)], a) and not b[:, a.size(1) :].any()
    # the real positions select the same tokens
    assert torch.equal(
        bucketed.tgt_out.flatten()[bucketed.real.tgt], plain.tgt_out.flatten()[plain.real.tgt]
    )
    assert torch.equal(
        bucketed.src.flatten()[bucketed.real.src], plain.src.flatten()[plain.real.src]
    )
    torch.manual_seed(0)
    model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0), V)
    ref = batch_loss(model, plain, 0.1, "fp32")
    got = batch_loss(model, bucketed, 0.1, "fp32")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pad_multiple"):
        collate(_pairs(), pad_multiple=0)


def test_pad_multiple_setting():
    assert pad_multiple(TrainConfig()) == 1
    assert pad_multiple(TrainConfig(compile=True)) == 8
    assert pad_multiple(TrainConfig(compile=True, pad_multiple=16)) == 16
    assert pad_multiple(TrainConfig(pad_multiple=4)) == 4
    with pytest.raises(ValueError, match="train.pad_multiple"):
        pad_multiple(TrainConfig(pad_multiple=-1))


def test_compile_model_wraps_only_when_asked():
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, TrainConfig()) is model
    compiled = compile_model(model, TrainConfig(compile=True))
    assert compiled is not model and compiled._orig_mod is model  # the raw model stays eager


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "native"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_native_bf16_on_cpu_follows_the_cpu_features(monkeypatch, avx512_bf16, amx, native):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert native_bf16(torch.device("cpu")) is native


def test_native_bf16_on_a_torch_without_the_feature_checks(monkeypatch):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert native_bf16(torch.device("cpu")) is False  # unknown: fp32, the safe choice


@pytest.mark.parametrize("native", [False, True])
def test_resolve_precision(monkeypatch, caplog, native):
    monkeypatch.setattr(mt.fast.precision, "native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == ("bf16" if native else "fp32")
    assert resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("fp16", cpu) == "fp16"
    caplog.clear()
    assert resolve_precision("bf16", cpu) == "bf16"  # an explicit choice is kept ...
    emulated = [r for r in caplog.records if "emulated" in r.getMessage()]
    assert len(emulated) == (0 if native else 1)  # ... with a warning where it is emulated
    with pytest.raises(ValueError, match="train.precision must be one of"):
        resolve_precision("bf17", cpu)


def test_tf32_only_on_cuda():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        set_fp32_precision(torch.device("cpu"), True)
        assert torch.get_float32_matmul_precision() == "highest"
        set_fp32_precision(torch.device("cuda", 0), True)
        assert torch.get_float32_matmul_precision() == "high"
        set_fp32_precision(torch.device("cuda", 0), False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.slow
def test_compiled_training_runs_compile_then_ddp_wrap_and_logs_graphs(
    real_data, tmp_path, monkeypatch
):
    """A short run with train.compile=true: the model handed to the DDP wrap is the compiled
    one around the raw model, batches are padded to multiples of 8, the log counts compiled
    graphs. Dynamo traces for real; its "eager" backend stands in for inductor (minutes of C++
    compilation on this CPU)."""
    from test_train import _cfg, _records

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    wrapped, shapes = [], []
    real_wrap, real_update = mt.train.recipe.distributed.wrap, mt.train.recipe.Updater.__call__

    def wrap(model, info):
        wrapped.append(model)
        return real_wrap(model, info)

    def update(self, batches, state):
        shapes.extend((b.src.size(1), b.tgt_in.size(1)) for b in batches)
        return real_update(self, batches, state)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(mt.train.recipe.distributed, "wrap", wrap)
    monkeypatch.setattr(mt.train.recipe.Updater, "__call__", update)
    run = tmp_path / "run"
    result = mt.train.recipe.train(_cfg(run, "train.compile=true", "train.max_steps=4"))
    assert result["step"] == 4
    (model,) = wrapped
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert all(s % 8 == 0 and t % 8 == 0 for s, t in shapes) and shapes
    logged = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    # one graph for the first shapes, one with dynamic shapes after: no more, no graph break
    graphs = [r["compiled_graphs"] for r in logged]
    assert graphs[0] == 1 and graphs[-1] <= 2 and graphs == sorted(graphs)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert json.dumps(logged)  # plain numbers
