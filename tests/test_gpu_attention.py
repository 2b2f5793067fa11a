"""Attention masks for the GPU's fast SDPA kernels: a training batch without source padding
passes no mask (the flash kernel takes none), one with padding a boolean key mask, and both
compute the paper's attention, checked on the CPU against the always-masked reference; on a
GPU, training runs with the math kernel ruled out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mt.data.batches import collate
from mt.model.attention import ScaledDotProduct, attention
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
    """No source padding in a training batch (its real positions from collate): no mask;
    padding: a boolean key mask, True at real tokens; decoding (no real positions): a mask."""
    model = _model().eval()
    unpadded, padded = _batch(UNPADDED), _batch(PADDED)
    assert model.encode(unpadded.src, unpadded.real).src_mask is None
    mask = model.encode(padded.src, padded.real).src_mask
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 1, padded.src.size(1))
    assert torch.equal(mask[:, 0, 0], padded.src != 0)
    assert model.encode(unpadded.src).src_mask is not None


def test_additive_mask_equals_boolean_mask_in_both_attention_forms():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    keep = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = keep[:, None, None, :]
    k, v = (torch.cat([t, t[:, :, :1]], dim=2) for t in (k, v))  # S = 6 keys
    additive = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    for attend in (ScaledDotProduct(), attention):  # SDPA; the formula written out
        ref = attend(q, k, v, keep)[0]
        got = attend(q, k, v, additive)[0]
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_gpu_formulation_equals_the_reference_on_cpu(lengths):
    """Decoder outputs and gradients of a teacher-forced pass given the batch's real positions
    (no mask without source padding) equal the always-masked reference."""
    batch = _batch(lengths)
    assert (batch.real.src is None) == (lengths is UNPADDED)

    def run(real):
        model = _model().train()
        h = model.features(batch.src, batch.tgt_in, real)
        h.float().pow(2).mean().backward()
        return h.detach(), [p.grad for p in model.parameters()]

    ref_h, ref_grads = run(None)
    h, grads = run(batch.real)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.fixture
def cudnn_sdp_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_gpu_attention_turns_cudnn_attention_off_on_cuda_only(cudnn_sdp_restored):
    """cuDNN's SDPA builds a plan per new shape (8x slower training on an H200 with batches by
    tokens): the training and decoding seams turn it off on CUDA, and nowhere else."""
    from mt.decode.driver import translate_nbest
    from mt.device import gpu_attention
    from mt.fast import for_training
    from mt.schema import DecodeConfig

    torch.backends.cuda.enable_cudnn_sdp(True)
    gpu_attention(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for_training(_model(), torch.device("cpu"), cpu_kernels=False)
    assert translate_nbest(_model(), [], DecodeConfig(), "cpu") == []
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for_training(_model(), torch.device("cuda"))  # nothing moves: the flag is process-wide
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert translate_nbest(_model(), [], DecodeConfig(), "cuda") == []  # decoding's seam
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    gpu_attention(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_training_attention_uses_a_fast_sdpa_backend_on_gpu(lengths, cudnn_sdp_restored):
    """Forward and backward in bf16 with SDPA restricted to flash / memory-efficient (what
    ``for_training`` leaves on CUDA): a mask that only the math kernel accepts would raise
    "no available kernel"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mt.fast import for_training

    model = _model("cuda").train()
    step = for_training(model, torch.device("cuda"))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    batch = _batch(lengths).to("cuda")
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fast), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = step(batch.src, batch.tgt_in, batch.real)
    logits.float().logsumexp(-1).mean().backward()
    assert logits.shape == (batch.ntokens, V)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
