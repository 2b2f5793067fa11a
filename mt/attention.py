"""Multi-head attention (paper section 3.2), self and encoder-decoder, with a key/value cache.

``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` computed by
``torch.nn.functional.scaled_dot_product_attention`` (fused kernels where the hardware has them),
or written out when the caller asks for the attention weights (SDPA does not return them).
Masks are boolean, True = may attend (see ``mt.masks``).

Shape letters: B batch, H heads, T query length, S key length, D = d_model, d_k = D / H.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention over heads.

    Args:
        q: (B, H, T, d_k) queries.
        k: (B, H, S, d_k) keys.
        v: (B, H, S, d_k) values.
        mask: bool, broadcastable to (B, H, T, S); True = may attend. None: attend everywhere.
        is_causal: apply the subsequent mask (query i sees keys <= i; needs T == S, no mask).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        need_weights: also return the weights (computed explicitly, not through SDPA).

    Returns:
        (B, H, T, d_k) output, and the (B, H, T, S) weights (before dropout) or None.
    """
    if not need_weights:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
        return out, None
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    out = F.dropout(weights, p=dropout_p) @ v
    return out, weights


def _init_chunks(linear: nn.Linear, chunks: int) -> None:
    """Xavier-uniform on each (D, D) block of a fused projection, so a fused QKV (3D, D) is
    initialised exactly like three separate D x D matrices (the paper's reference code)."""
    for w in linear.weight.data.chunk(chunks, dim=0):
        nn.init.xavier_uniform_(w)
    nn.init.zeros_(linear.bias)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused Q/K/V projection.

    With ``cache`` (a dict) the new keys/values are appended to ``cache[prefix + "k"/"v"]``
    and the queries attend to everything cached so far: incremental decoding.
    """

    def __init__(self, d_model: int, h: int, attention_dropout: float) -> None:
        super().__init__()
        if d_model % h:
            raise ValueError(f"d_model={d_model} is not divisible by h={h}")
        self.h, self.d_k = h, d_model // h
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # W^Q, W^K, W^V stacked
        self.out = nn.Linear(d_model, d_model)  # W^O
        _init_chunks(self.qkv, 3)
        _init_chunks(self.out, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: dict | None = None,
        prefix: str = "",
    ) -> torch.Tensor:
        """Args: x (B, T, D); mask broadcastable to (B, H, T, S_total). Returns (B, T, D)."""
        B, T, D = x.shape
        # (B, T, 3D) -> (B, T, 3, H, d_k) -> (3, B, H, T, d_k)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            if prefix + "k" in cache:
                k = torch.cat([cache[prefix + "k"], k], dim=2)  # (B, H, S_past + T, d_k)
                v = torch.cat([cache[prefix + "v"], v], dim=2)
            cache[prefix + "k"], cache[prefix + "v"] = k, v
        p = self.attention_dropout if self.training else 0.0
        out, _ = attention(q, k, v, mask=mask, is_causal=is_causal, dropout_p=p)
        return self.out(out.transpose(1, 2).reshape(B, T, D))  # (B, H, T, d_k) -> (B, T, D)


class CrossAttention(nn.Module):
    """Multi-head encoder-decoder attention: queries from the decoder, keys/values from the
    encoder output ``memory`` through one fused K/V projection.

    With ``cache`` the memory's keys/values are computed on the first call and reused after.
    """

    def __init__(self, d_model: int, h: int, attention_dropout: float) -> None:
        super().__init__()
        if d_model % h:
            raise ValueError(f"d_model={d_model} is not divisible by h={h}")
        self.h, self.d_k = h, d_model // h
        self.attention_dropout = attention_dropout
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
        cache: dict | None = None,
        prefix: str = "",
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args: x (B, T, D); memory (B, S, D); mask (B, 1, 1, S).

        Returns:
            (B, T, D) output, and the (B, H, T, S) weights when ``need_weights`` else None.
        """
        B, T, D = x.shape
        q = self.q(x).view(B, T, self.h, self.d_k).transpose(1, 2)  # (B, H, T, d_k)
        if cache is not None and prefix + "k" in cache:
            k, v = cache[prefix + "k"], cache[prefix + "v"]
        else:
            S = memory.size(1)
            # (B, S, 2D) -> (B, S, 2, H, d_k) -> (2, B, H, S, d_k)
            kv = self.kv(memory).view(B, S, 2, self.h, self.d_k).permute(2, 0, 3, 1, 4)
            k, v = kv.unbind(0)
            if cache is not None:
                cache[prefix + "k"], cache[prefix + "v"] = k, v
        p = self.attention_dropout if self.training else 0.0
        out, weights = attention(q, k, v, mask=mask, dropout_p=p, need_weights=need_weights)
        return self.out(out.transpose(1, 2).reshape(B, T, D)), weights
