"""Attention cores for a device: the same ``softmax(q k^T / sqrt(d_k)) v`` as the model's own
:class:`mt.model.attention.ScaledDotProduct`, computed the way that is fastest there. Each layer
of a model holds its core as ``core``; :func:`install` swaps the cores of a model's copy.

* :class:`CPUTrainingAttention` (CPU training): the formula written out
  (:func:`mt.model.attention.attention`) with the 16-bit dropout masks of ``mt.fast.dropout``
  on the weights. On a CPU, SDPA with dropout takes its unfused reference path and draws its
  mask through ``bernoulli_``; without dropout it takes a flash kernel that is slower than the
  written-out form at sentence lengths in bfloat16.
* :class:`ShortQueryAttention` (CPU decoding): short queries (one per row in incremental
  self-attention, one per beam in encoder-decoder attention, short sources in the encoder)
  through the written-out formula with batched matrix products: 40-70% of the time of SDPA's
  CPU kernel, which is built for long queries. Against a float32 cache under bf16 autocast
  (``DecoderCache(dtype=float32)``) the attention runs in float32 with autocast off: CPU
  attention with one query per row is several times slower in bfloat16, and the cache is small.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mt.fast.dropout import dropout
from mt.fast.modules import replace_modules
from mt.model.attention import ScaledDotProduct, attention

# Query lengths up to this go through explicit matrix products on CPU (ShortQueryAttention).
EXPLICIT_MAX_QUERIES = 16


class CPUTrainingAttention(ScaledDotProduct):
    """The written-out formula with 16-bit dropout masks (module docstring)."""

    def dropout(self, weights: torch.Tensor, p: float) -> torch.Tensor:
        """Dropout on the attention weights (``mt.fast.dropout.dropout``)."""
        return dropout(weights, p)

    def forward(self, q, k, v, mask=None, is_causal=False, dropout_p=0.0, need_weights=False):
        out, weights = attention(q, k, v, mask, is_causal, dropout_p, self.dropout)
        return out, weights if need_weights else None


class ShortQueryAttention(ScaledDotProduct):
    """Short queries written out, long ones (and anything with gradients) through SDPA."""

    def __init__(self, max_queries: int = EXPLICIT_MAX_QUERIES) -> None:
        super().__init__()
        self.max_queries = max_queries

    def forward(self, q, k, v, mask=None, is_causal=False, dropout_p=0.0, need_weights=False):
        scope = contextlib.nullcontext()
        if q.dtype != k.dtype:  # bf16 queries (autocast) against a float32 cache
            q, scope = q.to(k.dtype), torch.autocast(q.device.type, enabled=False)
        with scope:
            if q.size(-2) > self.max_queries or torch.is_grad_enabled():
                return super().forward(q, k, v, mask, is_causal, dropout_p, need_weights)
            out, weights = attention(q, k, v, mask, is_causal, dropout_p)
        return out, weights if need_weights else None


def install(model: nn.Module, make_core) -> nn.Module:
    """Give every attention layer of ``model`` (in place; pass a copy) the core ``make_core()``;
    returns ``model``."""
    replace_modules(model, lambda m: make_core() if isinstance(m, ScaledDotProduct) else None)
    return model
