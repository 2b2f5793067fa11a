"""train.fit_batch: each GPU's batch chosen by the memory model, accumulation keeping the
recipe's global batch."""

from __future__ import annotations

import pytest
import torch

from mt.config import load_config
from mt.data.batches import batch_plan
from mt.fast.compile import fitted_max_tokens
from mt.fast.footprint import fit_tokens


def _line(constant: float, per_token: float, calls: list):
    def estimate(tokens: int) -> float:
        calls.append(tokens)
        return constant + per_token * tokens

    return estimate


@pytest.mark.parametrize(("constant", "per_token", "memory"),
                         [(2.0, 3e-4, 80.0), (0.5, 1e-3, 24.0), (6.0, 5e-4, 141.0)])  # fmt: skip
def test_the_fitted_batch_is_the_largest_step_multiple_within_the_headroom(
    constant, per_token, memory
):
    calls = []
    got = fit_tokens(_line(constant, per_token, calls), memory, 1024, 400_000, headroom=0.85)
    budget = 0.85 * memory
    assert got % 1024 == 0
    assert constant + per_token * got <= budget < constant + per_token * (got + 1024)
    assert len(calls) <= 3  # two for the line, one to check it


def test_a_batch_that_fits_whole_is_the_recipes_share_and_one_that_never_fits_says_so():
    assert fit_tokens(lambda t: 1.0 + 1e-5 * t, 80.0, 1024, 25_000) == 25_000
    with pytest.raises(ValueError, match="1024 tokens needs 90.0 GiB"):
        fit_tokens(lambda t: 90.0, 80.0, 1024, 25_000)
    # an estimate that bends upwards: the check steps down until one fits
    got = fit_tokens(lambda t: 1.0 + (t / 10_000) ** 2, 10.0, 1024, 40_000, headroom=1.0)
    assert 1.0 + (got / 10_000) ** 2 <= 10.0 and got % 1024 == 0


@pytest.mark.parametrize("global_batch", [25_000, 100_000, 400_000])
@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("fitted", [3072, 12_288, 50_176])
def test_accumulation_times_gpu_batch_times_world_is_the_global_batch(global_batch, world, fitted):
    """accum x per-GPU batch x world == the global batch, less under accum x world tokens of
    rounding; the per-GPU batch within what fits; no more accumulation than memory needs."""
    max_tokens, accum = batch_plan(global_batch, fitted, world)
    assert max_tokens <= fitted
    total = accum * max_tokens * world
    assert global_batch - accum * world < total <= global_batch
    if accum > 1:  # one accumulation step fewer would not fit
        assert -(-global_batch // ((accum - 1) * world)) > fitted


def test_fit_batch_applies_on_cuda_with_a_global_batch_only(monkeypatch):
    cfg = load_config(["train.fit_batch=true", "train.batch_tokens=25000",
                       "train.activation_checkpointing=true"])  # fmt: skip
    assert fitted_max_tokens(cfg, 100, torch.device("cpu")) is None  # the CPU path as it was
    off = load_config(["train.batch_tokens=25000"])
    assert fitted_max_tokens(off, 100, torch.device("cuda")) is None
    import mt.fast.footprint as footprint

    seen = {}

    def fake(model_cfg, vocab, tokens, precision="bf16", master_weights=False,
             activation_checkpointing=False):  # fmt: skip
        seen["args"] = (vocab, precision, master_weights, activation_checkpointing)
        return {"total": 1.0 + tokens * 1e-3}

    class Props:
        total_memory = 16 * 2**30

    monkeypatch.setattr(footprint, "estimate_step_gb", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    got = fitted_max_tokens(cfg, 100, torch.device("cuda"))
    assert got == 12288 and 1.0 + got * 1e-3 <= 0.85 * 16 < 1.0 + (got + 1024) * 1e-3
    assert seen["args"] == (100, cfg.train.precision, cfg.train.master_weights, True)
