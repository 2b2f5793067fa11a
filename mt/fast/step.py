"""One incremental decoder step, written for a CPU: the work of ``Transformer.decode`` for one
new token per row against filled caches, with fewer calls into torch.

At a decoder step a CPU spends much of its time dispatching small operations: a 3-layer,
256-wide decoder step over 13 rows makes 657 ATen calls through the modules (eval-mode dropout
calls, a source mask built per layer, ``matmul``'s broadcasting around each batched product),
while its products take ~2 ms. :func:`decoder_step` computes the same formula with the layers'
own products (whatever :mod:`mt.fast.decoding` put there: oneDNN, int8 or torch) and the
attention written out on 3-D batched products, the source mask as one additive row per
sentence for all layers, the residual added in place: 507 ATen calls for the same step (both
counted with ``torch.profiler``), 3-8% faster greedy and beam decodes on an AMD Zen 3.

The beams of a sentence share its encoder rows (G rows per sentence, as ``CrossAttention``
takes them). Used by :class:`mt.fast.decoding.DecodingModel` for the steps it can take (one new
token, caches filled, no autocast); the first step and everything else go through the model.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.kv_cache import DecoderCache


def applies(tgt_in: torch.Tensor, cache: DecoderCache | None, module: nn.Module) -> bool:
    """Whether :func:`decoder_step` computes this call: one new token per row, a cache whose
    encoder-decoder keys/values are filled (every step after the first), eval mode, float32
    outside autocast (under bf16 autocast the model's own path casts)."""
    return (
        cache is not None
        and cache.length > 0
        and tgt_in.size(1) == 1
        and not module.training
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled(tgt_in.device.type)
    )


def _norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _sublayer(x: torch.Tensor, norm: nn.LayerNorm, pre: bool, sublayer) -> torch.Tensor:
    """post-LN: LayerNorm(x + Sublayer(x)); pre-LN: x + Sublayer(LayerNorm(x)) (no dropout)."""
    if pre:
        return sublayer(_norm(x, norm)).add_(x)
    return _norm(sublayer(x).add_(x), norm)


def _self_attention(attn: nn.Module, cache, y: torch.Tensor) -> torch.Tensor:
    """One query per row against the cached keys/values (the new ones appended): (B, D)."""
    B, D = y.shape
    H, d_k = attn.h, attn.d_k
    qkv = attn.qkv(y).view(B, 3, H, 1, d_k)
    k, v = cache.append(qkv[:, 1], qkv[:, 2])  # (B, H, T, d_k) views of the cache
    T = k.size(2)
    q = qkv[:, 0].reshape(B * H, 1, d_k)
    scores = torch.bmm(q, k.reshape(B * H, T, d_k).transpose(1, 2)).mul_(1 / math.sqrt(d_k))
    out = torch.bmm(scores.softmax(-1), v.reshape(B * H, T, d_k))  # (B*H, 1, d_k)
    return attn.out(out.view(B, D))


def _cross_attention(
    attn: nn.Module, cache, n: int, bias: torch.Tensor | None, y: torch.Tensor
) -> torch.Tensor:
    """G = B / n queries per sentence against its encoder keys/values: (B, D)."""
    B, D = y.shape
    H, d_k, G = attn.h, attn.d_k, B // n
    k, v = cache.k, cache.v  # (n, H, S, d_k)
    S = k.size(2)
    # (B, D) -> (n, G, H, d_k) -> (n*H, G, d_k): the G rows of a sentence share its keys
    q = attn.q(y).view(n, G, H, d_k).transpose(1, 2).reshape(n * H, G, d_k)
    scores = torch.bmm(q, k.view(n * H, S, d_k).transpose(1, 2)).mul_(1 / math.sqrt(d_k))
    if bias is not None:  # (n, 1, 1, S): -inf at each sentence's padding
        scores = scores.view(n, H, G, S).add_(bias).view(n * H, G, S)
    out = torch.bmm(scores.softmax(-1), v.view(n * H, S, d_k))  # (n*H, G, d_k)
    return attn.out(out.view(n, H, G, d_k).transpose(1, 2).reshape(B, D))


def decoder_step(
    module: nn.Module, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask, cache: DecoderCache
) -> torch.Tensor:
    """The decoder output (B, D) for one new token per row (before the projection).

    Args:
        module: an ``mt.model.transformer.Transformer`` or its decoding copy, in eval mode.
        tgt_in: (B, 1) the new token of each row.
        memory: (n, S, D) encoder output, B = G * n (the G rows of a sentence consecutive).
        src_mask: (n, 1, 1, S) bool, True = real source token, or None (no padding).
        cache: the rows' state, encoder-decoder keys/values filled (see :func:`applies`);
            the new keys/values are appended to it.

    Returns:
        (B, D) float32, what ``module.decode(tgt_in, enc, cache, project=False)`` gives.

    Raises:
        ValueError: when the new position is beyond the model's ``max_positions``.
    """
    past, B, n = cache.length, tgt_in.size(0), memory.size(0)
    if past + 1 > module.max_positions:
        raise ValueError(
            f"sequence of length {past + 1} exceeds model.max_positions={module.max_positions}"
        )
    D = module.d_model
    # Dropout(Embedding(y) * sqrt(D) + PE[past]); dropout is off in eval mode.
    emb = F.embedding(tgt_in.view(B), module.tgt_embedding)
    x = torch.add(module.pe[past], emb, alpha=math.sqrt(D))  # (B, D)
    bias = None  # (n, 1, 1, S): 0 where a sentence may attend, -inf at its padding
    if src_mask is not None:
        bias = x.new_zeros(src_mask.shape).masked_fill_(~src_mask, float("-inf"))
    pre = module.cfg.norm == "pre"
    for layer, state in zip(module.decoder, cache.layers):
        norms = layer.norms
        x = _sublayer(x, norms[0], pre, partial(_self_attention, layer.self_attn, state.self_attn))
        cross = partial(_cross_attention, layer.cross_attn, state.cross_attn, n, bias)
        x = _sublayer(x, norms[1], pre, cross)
        x = _sublayer(x, norms[2], pre, layer.ffn)
    return module.decoder_norm(x)
