"""GPU memory planning computed on a CPU: the peak of one training step of the paper's models
at the WMT recipes' batch, from fake tensors under torch's memory tracker (nothing allocated),
and what the recipes' per-GPU ceilings make of it."""

from __future__ import annotations

import pytest

from mt.config import load_config
from mt.data.batches import batch_plan
from mt.fast.footprint import estimate_step_gb


@pytest.mark.slow
def test_base_and_big_take_the_25k_batch_in_one_micro_batch_on_an_80_gb_gpu():
    peaks = {}
    for experiment in ("wmt14_en_de_base", "wmt14_en_de_big"):
        cfg = load_config([f"experiment={experiment}"])
        tc = cfg.train
        max_tokens, accum = batch_plan(tc.batch_tokens, tc.max_tokens, world_size=1)
        assert accum == 1 and max_tokens == tc.batch_tokens == 25000  # one micro-batch
        peak = estimate_step_gb(cfg.model, cfg.tokenizer.vocab_size, max_tokens, tc.precision)
        assert peak["activation"] > peak["parameter"] > 0
        peaks[experiment] = peak["total"]
    base, big = peaks["wmt14_en_de_base"], peaks["wmt14_en_de_big"]
    assert 4 < base < big < 40, peaks  # an 80 GB GPU holds either with room to spare


def test_the_estimate_grows_with_the_batch():
    cfg = load_config(["model=small", "model.N=1"]).model
    small, large = (estimate_step_gb(cfg, 8000, n, "fp32")["total"] for n in (500, 2000))
    assert 0 < small < large


def test_master_weights_hold_a_16_bit_copy_and_less_activation_memory():
    """With master weights the step holds the float32 masters and a 16-bit copy (1.5x the
    parameters' bytes) and keeps its activations in 16 bits (fewer bytes than autocast's)."""
    cfg = load_config(["model=small", "model.N=1"]).model
    autocast = estimate_step_gb(cfg, 8000, 2000, "bf16")
    master = estimate_step_gb(cfg, 8000, 2000, "bf16", master_weights=True)
    assert master["parameter"] == pytest.approx(1.5 * autocast["parameter"], rel=1e-3)
    assert master["activation"] < autocast["activation"]


def test_the_peak_only_tracker_finds_the_stock_trackers_peak(monkeypatch):
    """The estimate keeps only the overall peak (fast); torch's tracker, which also keeps each
    module's peak, finds the same figures."""
    from mt.fast import footprint

    cfg = load_config(["model=small", "model.N=1"]).model
    fast = estimate_step_gb(cfg, 8000, 1000, "fp32")
    monkeypatch.setattr(footprint, "_peak_only", lambda tracker_class: tracker_class)
    assert estimate_step_gb(cfg, 8000, 1000, "fp32") == fast and fast["total"] > 0


def test_setup_asks_for_expandable_segments_unless_the_user_chose(monkeypatch):
    from mt import distributed

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    distributed.setup("cpu")
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    distributed.setup("cpu")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


@pytest.fixture(scope="module")
def measured_peaks():
    """A small model's step at 2,000 tokens in float32, with and without activation
    checkpointing: the memory model's peak, and the same step run for real on the CPU, its
    peak the most bytes torch's CPU allocator held (``torch.profiler``'s allocation events,
    ``scripts/bench_memory.py``): a measurement independent of the fake tensors and of torch's
    memory tracker."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_memory import measure_step_gb

    from mt.schema import ModelConfig

    cfg = ModelConfig(N=2, d_model=64, d_ff=256, h=4, dropout=0.1)
    peaks = {}
    for ckpt in (False, True):
        estimated = estimate_step_gb(cfg, 1000, 2000, "fp32", activation_checkpointing=ckpt)
        measured = measure_step_gb(cfg, 1000, 2000, "fp32", False, ckpt, torch.device("cpu"))
        peaks[ckpt] = estimated, measured
    return peaks


def test_the_memory_model_gives_the_measured_peak_with_and_without_checkpointing(measured_peaks):
    """Without checkpointing the model's peak is the measured one (it counts the same tensors);
    with it the model may lean high (within 10%, never below: a plan must not undercount), and
    what checkpointing saves is the measured saving."""
    (plain, plain_measured), (ckpt, ckpt_measured) = measured_peaks[False], measured_peaks[True]
    assert plain["total"] == pytest.approx(plain_measured, rel=0.02), measured_peaks
    assert ckpt_measured <= ckpt["total"] <= 1.1 * ckpt_measured, measured_peaks
    assert plain["total"] - ckpt["total"] == pytest.approx(plain_measured - ckpt_measured, rel=0.1)
    assert ckpt_measured < 0.5 * plain_measured  # the layers' activations are not kept
    assert ckpt["parameter"] == plain["parameter"]  # the same weights
