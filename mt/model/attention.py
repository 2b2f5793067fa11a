"""Multi-head attention (paper section 3.2), self and encoder-decoder, with a key/value cache.

``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` computed by
``torch.nn.functional.scaled_dot_product_attention`` (fused kernels where the hardware has them),
or written out when the caller asks for the attention weights (SDPA does not return them).
Masks are boolean, True = may attend (see ``mt.model.masks``).

Shape letters: B batch, H heads, T query length, S key length, D = d_model, d_k = D / H.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.kv_cache import CrossAttentionCache, SelfAttentionCache
from mt.model.masks import subsequent_mask


class Kernels:
    """How attention is computed. This default is the paper's formula through SDPA everywhere
    (the explicit form only when the weights are asked for). ``mt.fast.decoding`` supplies the
    rules that make incremental decoding fast on a given device; they reach the layers through
    the decoder's cache (``mt.model.kv_cache.DecoderCache.kernels``) and ``Transformer.encode``."""

    def explicit(self, q: torch.Tensor) -> bool:
        """Whether queries ``q`` (B, H, T, d_k) use the written-out formula instead of SDPA."""
        return False

    def inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The attention inputs (and cached keys/values) of incremental decoding, recast."""
        return tensors

    def scope(self) -> contextlib.AbstractContextManager:
        """The context the attention of incremental decoding runs in (e.g. autocast off)."""
        return contextlib.nullcontext()

    def key_mask(self, keep: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """The source key mask that attention is given, from (B, 1, 1, S) bool ``keep`` (True
        at real tokens); ``padded`` is False when the batch is known to have no padding.
        Here: ``keep`` itself."""
        return keep

    def dropout(self, weights: torch.Tensor, p: float) -> torch.Tensor:
        """Dropout on the attention weights of the written-out formula (training)."""
        return F.dropout(weights, p=p)


SDPA = Kernels()


class GPUTrainingKernels(Kernels):
    """Teacher-forced attention on a GPU, with the masks the fastest SDPA backends accept:
    none when the source has no padding (the flash kernel takes no mask; batches sorted by
    source length often have none), else an additive float mask (0 / -inf) in the compute
    dtype, built once per batch, for the memory-efficient and cuDNN kernels (SDPA would
    convert a boolean mask on every call). The same attention as :data:`SDPA`."""

    def key_mask(self, keep: torch.Tensor, padded: bool) -> torch.Tensor | None:
        if not padded:
            return None
        device = keep.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = torch.get_default_dtype()
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
            ~keep, float("-inf")
        )


GPU_TRAINING = GPUTrainingKernels()


def teacher_forced_kernels(device: torch.device) -> Kernels:
    """How attention is computed in teacher-forced passes (training, validation loss) on
    ``device``: :data:`GPU_TRAINING` on CUDA, the plain :data:`SDPA` elsewhere."""
    return GPU_TRAINING if device.type == "cuda" else SDPA


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    explicit: bool = False,
    dropout: Callable[[torch.Tensor, float], torch.Tensor] = SDPA.dropout,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention over heads.

    Args:
        q: (B, H, T, d_k) queries.
        k: (B, H, S, d_k) keys.
        v: (B, H, S, d_k) values.
        mask: bool, broadcastable to (B, H, T, S); True = may attend (or an additive float
            mask: 0 = may attend, -inf = may not). None: attend everywhere.
        is_causal: apply the subsequent mask (query i sees keys <= i; needs T == S, no mask).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        need_weights: also return the weights (computed explicitly, not through SDPA).
        explicit: compute ``softmax(q k^T / sqrt(d_k)) v`` as written even without
            ``need_weights`` (a kernel choice: see :class:`Kernels`).
        dropout: ``(weights, p) -> weights`` for the written-out formula (``Kernels.dropout``).

    Returns:
        (B, H, T, d_k) output, and the (B, H, T, S) weights (before dropout) or None.
    """
    if not (need_weights or explicit):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
        return out, None
    # In place on the fresh product: neither step's gradient needs the scores themselves.
    scores = (q @ k.transpose(-2, -1)).mul_(1 / math.sqrt(q.size(-1)))  # (B, H, T, S)
    if is_causal:
        mask = subsequent_mask(scores.size(-2), q.device)
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores.add_(mask)
    weights = scores.softmax(dim=-1)
    out = (dropout(weights, dropout_p) if dropout_p > 0 else weights) @ v
    return out, weights if need_weights else None


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

    With ``cache`` the new keys/values are appended to it and the queries attend to everything
    cached so far: incremental decoding.
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
        cache: SelfAttentionCache | None = None,
        kernels: Kernels = SDPA,
    ) -> torch.Tensor:
        """Args: x (B, T, D); mask broadcastable to (B, H, T, S_total). Returns (B, T, D)."""
        B, T, D = x.shape
        # (B, T, 3D) -> (B, T, 3, H, d_k) -> (3, B, H, T, d_k)
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.attention_dropout if self.training else 0.0
        if cache is None:
            out, _ = attention(
                q, k, v, mask, is_causal, p, explicit=kernels.explicit(q), dropout=kernels.dropout
            )
        else:
            q, k, v = kernels.inputs(q, k, v)
            k, v = cache.append(k, v)  # (B, H, S_past + T, d_k)
            with kernels.scope():
                out, _ = attention(q, k, v, mask, is_causal, p, explicit=kernels.explicit(q))
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
        kernels: Kernels = SDPA,
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
        if cache is not None and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            # (n, S, 2D) -> (n, S, 2, H, d_k) -> (2, n, H, S, d_k)
            kv = self.kv(memory).view(n, S, 2, self.h, self.d_k).permute(2, 0, 3, 1, 4)
            k, v = kv.unbind(0)
            if cache is not None:  # contiguous once, not copied by every step's products
                k, v = (t.contiguous() for t in kernels.inputs(k, v))
                cache.k, cache.v = k, v
        p = self.attention_dropout if self.training else 0.0
        explicit = kernels.explicit(q)
        if cache is None:
            out, weights = attention(
                q, k, v, mask, False, p, need_weights, explicit, kernels.dropout
            )
        else:
            (q,) = kernels.inputs(q)
            with kernels.scope():
                out, weights = attention(q, k, v, mask, False, p, need_weights, explicit)
        if weights is not None and G > 1:  # (n, H, G*T, S) -> (B, H, T, S)
            weights = weights.view(n, self.h, G, T, S).transpose(1, 2).reshape(B, self.h, T, S)
        return self.out(out.transpose(1, 2).reshape(B, T, D)), weights  # (n, G*T, H, d_k)
