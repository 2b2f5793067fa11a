"""Attention masks for the GPU's fast SDPA kernels: the GPU formulation (no mask without source
padding, else an additive float mask) computes the paper's attention, checked on the CPU
against the boolean-mask reference; on a GPU, training runs with the math kernel ruled out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mt.model.transformer
from mt.data.batches import collate
from mt.model.attention import GPU_TRAINING, SDPA, attention
from mt.model.transformer import build_model
from mt.schema import ModelConfig

V = 40


def _model(device="cpu"):
    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, d_ff=64, h=4, dropout=0.0, max_positions=64)
    return build_model(cfg, V).to(device)


def _batch(lengths):
    rng = np.random.default_rng(1)
    return collate([(rng.integers(4, V, s), rng.integers(4, V, t)) for s, t in lengths])


PADDED = [(7, 3), (2, 6), (5, 5)]
UNPADDED = [(4, 3), (4, 3)]  # same lengths: no padding on either side


def test_key_mask_forms():
    keep = torch.tensor([[True, True, False]])[:, None, None, :]
    assert SDPA.key_mask(keep, padded=True) is keep
    assert GPU_TRAINING.key_mask(keep, padded=False) is None
    additive = GPU_TRAINING.key_mask(keep, padded=True)
    assert additive.dtype == torch.float32 and additive.shape == keep.shape
    assert additive.flatten().tolist() == [0.0, 0.0, float("-inf")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert GPU_TRAINING.key_mask(keep, padded=True).dtype == torch.bfloat16


def test_additive_mask_equals_boolean_mask_in_both_attention_forms():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    keep = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = keep[:, None, None, :]
    k, v = (torch.cat([t, t[:, :, :1]], dim=2) for t in (k, v))  # S = 6 keys
    additive = GPU_TRAINING.key_mask(keep, padded=True)
    for explicit in (False, True):
        ref, _ = attention(q, k, v, keep, explicit=explicit)
        got, _ = attention(q, k, v, additive, explicit=explicit)
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_gpu_formulation_equals_the_reference_on_cpu(lengths, monkeypatch):
    """Logits and gradients of a teacher-forced pass with the GPU's masks equal the boolean
    mask reference (the batch's real positions from collate, as in training)."""
    batch = _batch(lengths)
    assert (batch.real.src is None) == (lengths is UNPADDED)

    def run():
        model = _model().train()
        logits = model(batch.src, batch.tgt_in, batch.real)
        logits.float().pow(2).mean().backward()
        return logits.detach(), [p.grad for p in model.parameters()]

    ref_logits, ref_grads = run()
    monkeypatch.setattr(mt.model.transformer, "teacher_forced_kernels", lambda device: GPU_TRAINING)
    logits, grads = run()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_cpu_keeps_the_boolean_mask():
    assert mt.model.transformer.teacher_forced_kernels(torch.device("cpu")) is SDPA
    assert mt.model.transformer.teacher_forced_kernels(torch.device("cuda", 0)) is GPU_TRAINING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_training_attention_uses_a_fast_sdpa_backend_on_gpu(lengths):
    """Forward and backward in bf16 with SDPA restricted to flash / memory-efficient / cuDNN:
    a mask that only the math kernel accepts would raise "no available kernel"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model("cuda").train()
    batch = _batch(lengths).to("cuda")
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fast), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch.src, batch.tgt_in, batch.real)
    logits.float().logsumexp(-1).mean().backward()
    assert logits.shape == (batch.ntokens, V)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
