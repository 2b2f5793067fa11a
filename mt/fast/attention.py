"""The CPU training copy's attention core: ``softmax(q k^T / sqrt(d_k)) v`` as the model's own
:class:`mt.model.attention.ScaledDotProduct` computes it (on CUDA that one runs, off cuDNN's
kernel: ``mt.device.gpu_attention``).

:class:`CPUTrainingAttention` writes the formula out with the 16-bit dropout masks of
``mt.fast.dropout``, as one autograd function that keeps for backward the weights and the mask
as booleans: 5 bytes per (query, key) pair in float32, against 12 for autograd over the formula.
On a CPU, SDPA with dropout takes its unfused path and draws its mask through ``bernoulli_``;
without dropout its flash kernel is slower than this at sentence lengths in bfloat16. On 16-bit
q, k, v (autocast, ``train.master_weights``) it computes in float32: in bfloat16 its batched
products would go to oneDNN, which builds a kernel for every (rows, queries, keys) it meets,
pushing the linear layers' kernels out of its bounded cache
(``mt.allocator.bound_onednn_kernels``); these products are small, so float32 costs no speed.
"""

from __future__ import annotations

import math

import torch

from mt.fast.dropout import apply_mask, drop, dropout
from mt.model.attention import ScaledDotProduct, attention, attention_weights


class _WrittenOutAttention(torch.autograd.Function):
    """``dropout(softmax(q k^T / sqrt(d_k))) v`` (:func:`mt.model.attention.attention` with
    :func:`mt.fast.dropout.dropout`), keeping for backward only q, k, v, the weights and the
    bool mask; the dropped weights are recomputed there from the last two."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)  # float32 under autocast
    def forward(ctx, q, k, v, mask, is_causal, p):
        # q, k, v are views of the packed projections' (B, T, 3, H, d_k): each batched product
        # would copy its operands (and k^T) again, forward and backward; copied once here, and
        # kept for backward instead of the views (the projection's output is then let go)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        weights = attention_weights(q, k, mask, is_causal)  # (B, H, T, S)
        dropped, keep, c = drop(weights, p) if p > 0 else (weights, None, 1.0)
        out = dropped @ v
        del dropped
        ctx.save_for_backward(q, k, v, weights, keep)
        ctx.scale, ctx.c = 1 / math.sqrt(q.size(-1)), c
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        q, k, v, weights, keep = ctx.saved_tensors
        grad = grad.contiguous()  # a view of (B, T, H, d_k): once, not for each product
        dropped = apply_mask(weights, keep, ctx.c) if keep is not None else weights
        grad_v = dropped.transpose(-2, -1) @ grad
        del dropped
        grad_w = (grad @ v.transpose(-2, -1)).to(weights.dtype)  # (B, H, T, S)
        if keep is not None:
            grad_w = apply_mask(grad_w, keep, ctx.c)
        grad_s = torch._softmax_backward_data(grad_w, weights, -1, weights.dtype)
        del grad_w
        grad_s.mul_(ctx.scale)
        grad_q = (grad_s @ k).to(q.dtype)
        grad_k = (grad_s.transpose(-2, -1) @ q).to(k.dtype)
        return grad_q, grad_k, grad_v.to(v.dtype), None, None, None


class CPUTrainingAttention(ScaledDotProduct):
    """The written-out formula with 16-bit dropout masks, in one autograd function that keeps
    the mask as booleans and not the dropped weights (module docstring)."""

    def forward(self, q, k, v, mask=None, is_causal=False, dropout_p=0.0, need_weights=False):
        if need_weights:
            return attention(q, k, v, mask, is_causal, dropout_p, dropout)
        if q.dtype in (torch.bfloat16, torch.float16):
            # In float32 (module docstring), laid out contiguously in the same pass: the views
            # of the packed projection cast as they are keep its strides, and the forward pass
            # would copy each again (3 copies per call saved).
            q32, k32, v32 = (t.to(torch.float32, memory_format=torch.contiguous_format)
                             for t in (q, k, v))  # fmt: skip
            out = _WrittenOutAttention.apply(q32, k32, v32, mask, is_causal, dropout_p)
            # under autocast the next product casts as it needs; a 16-bit model wants 16 bits
            return (out if torch.is_autocast_enabled("cpu") else out.to(q.dtype)), None
        return _WrittenOutAttention.apply(q, k, v, mask, is_causal, dropout_p), None
