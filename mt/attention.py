"""Multi-head attention (paper section 3.2), self and encoder-decoder, with a key/value cache.

``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` computed by
``torch.nn.functional.scaled_dot_product_attention`` (fused kernels where the hardware has them),
or written out when the caller asks for the attention weights (SDPA does not return them).
Masks are boolean, True = may attend (see ``mt.masks``).

Shape letters: B batch, H heads, T query length, S key length, D = d_model, d_k = D / H.
"""

from __future__ import annotations

import contextlib
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
        need_weights: also return the weights (computed explicitly, not through SDPA). Short
            queries on CPU are computed explicitly too (see ``_explicit_is_faster``).

    Returns:
        (B, H, T, d_k) output, and the (B, H, T, S) weights (before dropout) or None.
    """
    if not (need_weights or _explicit_is_faster(q)):
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
    return out, weights if need_weights else None


# Query lengths up to this go through explicit matrix products on CPU (see _explicit_is_faster).
EXPLICIT_MAX_QUERIES = 16


def _explicit_is_faster(q: torch.Tensor) -> bool:
    """Incremental decoding on CPU: 1 query per row (self-attention) or one per beam
    (encoder-decoder attention). There the explicit ``softmax(q k^T) v`` with batched matrix
    products takes 40-70% of the time of SDPA's CPU kernel, which is built for long queries.
    Training (gradients on) keeps SDPA whatever the length."""
    return (
        q.device.type == "cpu"
        and q.size(-2) <= EXPLICIT_MAX_QUERIES
        and not torch.is_grad_enabled()
    )


def _decoding_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Half-precision attention inputs as float32 on CPU, for cached (incremental) decoding.

    Under bf16 autocast the projections run in bf16, but CPU attention kernels with one query
    per row are several times slower in bf16 than in float32 (and the cache is small): the
    cache and the attention stay float32 there. GPUs and training are left as they are.
    """
    if tensors[0].device.type != "cpu" or tensors[0].dtype == torch.float32:
        return tensors
    return tuple(t.float() for t in tensors)


def _float32_on_cpu(active: bool):
    """Autocast off (attention in the inputs' float32) while ``active``; see _decoding_dtype."""
    if active and torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def append_to_cache(
    cache: dict, prefix: str, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new keys/values into a preallocated per-layer buffer; return all of them so far.

    The cache holds ``prefix + "k"/"v"``: (B, H, C, d_k) buffers of capacity C >= the length
    ``cache[prefix + "len"]``. New positions are written in place (no re-concatenation of the
    whole prefix each step); the capacity doubles when it runs out.

    Args:
        k, v: (B, H, T, d_k) keys/values of the T new positions.

    Returns:
        (B, H, S_past + T, d_k) views of the keys/values of every position so far.
    """
    past = cache.get(prefix + "len", 0)
    end = past + k.size(2)
    buf_k, buf_v = cache.get(prefix + "k"), cache.get(prefix + "v")
    if buf_k is None or buf_k.size(2) < end or buf_k.dtype != k.dtype:
        B, H, _, d_k = k.shape
        capacity = max(end, 2 * past, 16)
        new_k, new_v = k.new_empty(B, H, capacity, d_k), v.new_empty(B, H, capacity, d_k)
        if past:
            new_k[:, :, :past], new_v[:, :, :past] = buf_k[:, :, :past], buf_v[:, :, :past]
        buf_k, buf_v = cache[prefix + "k"], cache[prefix + "v"] = new_k, new_v
    buf_k[:, :, past:end], buf_v[:, :, past:end] = k, v
    cache[prefix + "len"] = end
    return buf_k[:, :, :end], buf_v[:, :, :end]


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


class SelfAttention(_MultiHead):
    """Multi-head self-attention with one fused Q/K/V projection.

    With ``cache`` (a dict) the new keys/values are appended to the cache (see
    :func:`append_to_cache`) and the queries attend to everything cached so far: incremental
    decoding.
    """

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
        cache: dict | None = None,
        prefix: str = "",
    ) -> torch.Tensor:
        """Args: x (B, T, D); mask broadcastable to (B, H, T, S_total). Returns (B, T, D)."""
        B, T, D = x.shape
        # (B, T, 3D) -> (B, T, 3, H, d_k) -> (3, B, H, T, d_k)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is not None:
            q, k, v = _decoding_dtype(q, k, v)
            k, v = append_to_cache(cache, prefix, k, v)  # (B, H, S_past + T, d_k)
        p = self.attention_dropout if self.training else 0.0
        with _float32_on_cpu(cache is not None and q.device.type == "cpu"):
            out, _ = attention(q, k, v, mask=mask, is_causal=is_causal, dropout_p=p)
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
        cache: dict | None = None,
        prefix: str = "",
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args: x (B, T, D); memory (n, S, D); mask (n, 1, 1, S), where B = G * n (G >= 1).

        Returns:
            (B, T, D) output, and the (B, H, T, S) weights when ``need_weights`` else None.
        """
        B, T, D = x.shape
        n, S = memory.shape[:2]
        G = B // n  # query rows per memory row (beams of one sentence share its memory)
        if G * n != B:
            raise ValueError(f"{B} query rows do not divide into {n} memory rows")
        # The G rows of one sentence become G*T query positions of that sentence's attention:
        # (B, T, D) -> (n, G*T, H, d_k) -> (n, H, G*T, d_k); row i*G+g, position t <-> g*T+t.
        q = self.q(x).view(n, G * T, self.h, self.d_k).transpose(1, 2)
        if cache is not None and prefix + "k" in cache:
            k, v = cache[prefix + "k"], cache[prefix + "v"]
        else:
            # (n, S, 2D) -> (n, S, 2, H, d_k) -> (2, n, H, S, d_k)
            kv = self.kv(memory).view(n, S, 2, self.h, self.d_k).permute(2, 0, 3, 1, 4)
            k, v = kv.unbind(0)
            if cache is not None:  # contiguous once, not copied by every step's products
                k, v = (t.contiguous() for t in _decoding_dtype(k, v))
                cache[prefix + "k"], cache[prefix + "v"] = k, v
        if cache is not None:
            (q,) = _decoding_dtype(q)
        p = self.attention_dropout if self.training else 0.0
        with _float32_on_cpu(cache is not None and q.device.type == "cpu"):
            out, weights = attention(q, k, v, mask=mask, dropout_p=p, need_weights=need_weights)
        if weights is not None and G > 1:  # (n, H, G*T, S) -> (B, H, T, S)
            weights = weights.view(n, self.h, G, T, S).transpose(1, 2).reshape(B, self.h, T, S)
        return self.out(out.transpose(1, 2).reshape(B, T, D)), weights  # (n, G*T, H, d_k)
