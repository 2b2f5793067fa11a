"""Multi-head attention (paper section 3.2), self and encoder-decoder, with a key/value cache.

``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` is one small module, :class:`ScaledDotProduct`
(the *core*, each layer's ``core``): SDPA (fused kernels where the hardware has them), or the
formula written out (:func:`attention`) when the caller wants the weights, which SDPA does not
return. ``mt.fast`` swaps the cores of a training copy for faster ones. Masks are boolean,
True = may attend (``mt.model.masks``).

Shape letters: B batch, H heads, T query length, S key length, D = d_model, d_k = D / H.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.kv_cache import CrossAttentionCache, SelfAttentionCache
from mt.model.masks import subsequent_mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    dropout: Callable[[torch.Tensor, float], torch.Tensor] = F.dropout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(d_k)) v`` written out: q (B, H, T, d_k), k/v (B, H, S, d_k) ->
    the (B, H, T, d_k) output and the (B, H, T, S) weights (before dropout).

    ``mask`` broadcasts to (B, H, T, S): bool, True = may attend, or additive float (0 / -inf);
    None: attend everywhere. ``is_causal``: query i sees keys <= i (T == S, no mask).
    ``dropout`` is ``(weights, p) -> weights`` (``mt.fast`` passes its own kernel).
    """
    weights = attention_weights(q, k, mask, is_causal)
    out = (dropout(weights, dropout_p) if dropout_p > 0 else weights) @ v
    return out, weights


def attention_weights(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False
) -> torch.Tensor:
    """The (B, H, T, S) weights of :func:`attention`."""
    # In place on the fresh product: neither step's gradient needs the scores themselves.
    scores = (q @ k.transpose(-2, -1)).mul_(1 / math.sqrt(q.size(-1)))  # (B, H, T, S)
    if is_causal:
        mask = subsequent_mask(scores.size(-2), q.device)
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores.add_(mask)
    return scores.softmax(dim=-1)


class ScaledDotProduct(nn.Module):
    """The attention core: ``softmax(q k^T / sqrt(d_k)) v`` through SDPA, or written out
    (:func:`attention`) when the weights are wanted. No parameters."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        dropout_p: float = 0.0,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`attention`'s output, and its weights or None (``need_weights`` False)."""
        if need_weights:
            return attention(q, k, v, mask, is_causal, dropout_p)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
        return out, None


def _init_chunks(linear: nn.Linear, chunks: int) -> None:
    """Xavier-uniform on each (D, D) block of a fused projection, so a fused QKV (3D, D) is
    initialised exactly like three separate D x D matrices (the paper's reference code)."""
    for w in linear.weight.data.chunk(chunks, dim=0):
        nn.init.xavier_uniform_(w)
    nn.init.zeros_(linear.bias)


class _MultiHead(nn.Module):
    """The head bookkeeping shared by self- and cross-attention: h heads of d_k = d_model / h."""

    def __init__(self, d_model: int, h: int, attention_dropout: float) -> None:
        super().__init__()
        if d_model % h:
            raise ValueError(f"d_model={d_model} is not divisible by h={h}")
        self.h, self.d_k = h, d_model // h
        self.attention_dropout = attention_dropout
        self.core = ScaledDotProduct()


class SelfAttention(_MultiHead):
    """Multi-head self-attention with one fused Q/K/V projection. With ``cache`` (incremental
    decoding) the new keys/values are appended to it and the queries see everything cached."""

    def __init__(self, d_model: int, h: int, attention_dropout: float) -> None:
        super().__init__(d_model, h, attention_dropout)
        self.qkv = nn.Linear(d_model, 3 * d_model)  # W^Q, W^K, W^V stacked
        self.out = nn.Linear(d_model, d_model)  # W^O
        _init_chunks(self.qkv, 3)
        _init_chunks(self.out, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: SelfAttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, D), mask broadcastable to (B, H, T, S_total) -> (B, T, D)."""
        B, T, D = x.shape
        # (B, T, 3D) -> (B, T, 3, H, d_k) -> (3, B, H, T, d_k)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, H, S_past + T, d_k)
        p = self.attention_dropout if self.training else 0.0
        out, _ = self.core(q, k, v, mask, is_causal, p)
        return self.out(out.transpose(1, 2).reshape(B, T, D))  # (B, H, T, d_k) -> (B, T, D)


class CrossAttention(_MultiHead):
    """Multi-head encoder-decoder attention: queries from the decoder, keys/values from the
    encoder output ``memory`` through one fused K/V projection.

    With ``cache`` the memory's keys/values are computed on the first call and reused after.
    ``x`` may hold G rows per memory row (beam search: rows ``i*G .. i*G+G-1`` belong to
    sentence ``i``): the memory and its keys/values are then shared, never copied per beam.
    """

    def __init__(self, d_model: int, h: int, attention_dropout: float) -> None:
        super().__init__(d_model, h, attention_dropout)
        self.q = nn.Linear(d_model, d_model)  # W^Q
        self.kv = nn.Linear(d_model, 2 * d_model)  # W^K, W^V stacked
        self.out = nn.Linear(d_model, d_model)  # W^O
        _init_chunks(self.q, 1)
        _init_chunks(self.kv, 2)
        _init_chunks(self.out, 1)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        mask: torch.Tensor | None,
        cache: CrossAttentionCache | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, D), memory (n, S, D), mask (n, 1, 1, S), B = G * n -> (B, T, D) output,
        and the (B, H, T, S) weights when ``need_weights`` else None."""
        B, T, D = x.shape
        n, S = memory.shape[:2]
        G = B // n  # query rows per memory row (beams of one sentence share its memory)
        if G * n != B:
            raise ValueError(f"{B} query rows do not divide into {n} memory rows")
        # The G rows of one sentence become G*T query positions of that sentence's attention:
        # (B, T, D) -> (n, G*T, H, d_k) -> (n, H, G*T, d_k); row i*G+g, position t <-> g*T+t.
        q = self.q(x).view(n, G * T, self.h, self.d_k).transpose(1, 2)
        k, v = self.memory_kv(memory, cache)
        p = self.attention_dropout if self.training else 0.0
        out, weights = self.core(q, k, v, mask, False, p, need_weights)
        if weights is not None and G > 1:  # (n, H, G*T, S) -> (B, H, T, S)
            weights = weights.view(n, self.h, G, T, S).transpose(1, 2).reshape(B, self.h, T, S)
        return self.out(out.transpose(1, 2).reshape(B, T, D)), weights  # (n, G*T, H, d_k)

    def memory_kv(
        self, memory: torch.Tensor, cache: CrossAttentionCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (n, H, S, d_k) of ``memory`` (n, S, D): ``cache``'s where it
        holds them, else computed (and kept in ``cache``)."""
        if cache is not None and cache.k is not None:
            return cache.k, cache.v
        n, S = memory.shape[:2]
        # (n, S, 2D) -> (n, S, 2, H, d_k) -> (2, n, H, S, d_k)
        k, v = self.kv(memory).view(n, S, 2, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)
        return (k, v) if cache is None else cache.store(k, v)
