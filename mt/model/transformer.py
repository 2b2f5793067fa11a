"""The Transformer of "Attention Is All You Need": the paper's full encoder-decoder.

- N encoder layers (self-attention, FFN) and N decoder layers (causal self-attention,
  encoder-decoder attention, FFN), each sub-layer wrapped in a residual connection with
  LayerNorm after it (post-LN, the paper) or before it (``norm=pre``, plus a final LayerNorm on
  each stack).
- Sinusoidal positional encodings, embeddings multiplied by sqrt(d_model).
- ONE embedding matrix shared by the source embedding, the target embedding and the pre-softmax
  projection (``share_embeddings=false``: separate source and target embeddings, the projection
  stays tied to the target one). Its rows are padded to a multiple of ``vocab_multiple`` for
  fast matrix products; logits are returned for exactly ``vocab_size`` tokens, so padded rows
  never receive probability.
- Dropout where the paper puts it: on each sub-layer output before the residual add, on the sum
  of embeddings and positional encodings, and on the attention weights
  (``attention_dropout``, default = ``dropout``). ``dropout=0`` turns all of them off.

``encode``/``decode`` are separate so search can cache the encoder output; ``decode`` with a
:class:`mt.model.kv_cache.DecoderCache` (``new_cache()``) decodes incrementally. Training's
speed is applied to a copy from outside (``mt.fast.for_training``); decoding runs this as written.

Shape letters: B batch, S source length, T target length, D d_model, V vocab_size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.attention import CrossAttention, SelfAttention
from mt.model.kv_cache import DecoderCache, LayerCache
from mt.model.loss import label_smoothed_nll_loss
from mt.model.masks import RealPositions, pad_mask, subsequent_mask
from mt.schema import ModelConfig, attention_dropout
from mt.vocab import PAD


class EncoderOut(NamedTuple):
    """What the decoder needs from the encoder."""

    memory: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor | None  # (B, 1, 1, S) key mask, True = real token; None: no padding

    def select(self, sents: torch.Tensor) -> EncoderOut:
        """The rows ``sents`` (n',) of the encoder output (sentences still searching)."""
        mask = None if self.src_mask is None else self.src_mask.index_select(0, sents)
        return EncoderOut(self.memory.index_select(0, sents), mask)


def sinusoidal_positions(max_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)): the
    (max_positions, d_model) float32 table (computed in float64 for accuracy)."""
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, D/2)
    pe = torch.zeros(max_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (no inner dropout: the paper has none there)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        for lin in (self.w1, self.w2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, L, D)."""
        return self.w2(F.relu(self.w1(x)))


class _Layer(nn.Module):
    """Residual wiring and self-attention, shared by encoder and decoder layers."""

    def __init__(self, cfg: ModelConfig, attention_dropout: float, n_sublayers: int) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.dropout = nn.Dropout(cfg.dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.d_model) for _ in range(n_sublayers))
        self.self_attn = SelfAttention(cfg.d_model, cfg.h, attention_dropout)

    def residual(self, x: torch.Tensor, i: int, sublayer: Callable) -> torch.Tensor:
        """post-LN: LayerNorm(x + Dropout(Sublayer(x))); pre-LN: x + Dropout(Sublayer(LN(x)))."""
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norms[i](x)))
        return self.norms[i](x + self.dropout(sublayer(x)))


class EncoderLayer(_Layer):
    """Self-attention then FFN."""

    def __init__(self, cfg: ModelConfig, attention_dropout: float) -> None:
        super().__init__(cfg, attention_dropout, 2)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, D), mask (B, 1, 1, S) or None (no padding) -> (B, S, D)."""
        x = self.residual(x, 0, lambda y: self.self_attn(y, mask=mask))
        return self.residual(x, 1, self.ffn)


class DecoderLayer(_Layer):
    """Causal self-attention, encoder-decoder attention, then FFN."""

    def __init__(self, cfg: ModelConfig, attention_dropout: float) -> None:
        super().__init__(cfg, attention_dropout, 3)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.h, attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)

    def forward(
        self,
        x: torch.Tensor,
        enc: EncoderOut,
        self_mask: torch.Tensor | None,
        is_causal: bool,
        cache: LayerCache | None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, D) -> (B, T, D) and the cross-attention weights (B, H, T, S) or None."""
        self_cache = None if cache is None else cache.self_attn
        cross_cache = None if cache is None else cache.cross_attn
        x = self.residual(x, 0, lambda y: self.self_attn(y, self_mask, is_causal, self_cache))
        weights = None

        def cross(y: torch.Tensor) -> torch.Tensor:
            nonlocal weights
            out, weights = self.cross_attn(y, enc.memory, enc.src_mask, cross_cache, need_weights)
            return out

        x = self.residual(x, 1, cross)
        return self.residual(x, 2, self.ffn), weights


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring. Build with :func:`build_model`."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        if cfg.norm not in ("post", "pre"):
            raise ValueError(f"model.norm must be 'post' or 'pre', got {cfg.norm!r}")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.d_model = D = cfg.d_model
        self.max_positions = cfg.max_positions
        m = max(1, cfg.vocab_multiple)
        self.padded_vocab = -(-vocab_size // m) * m
        # Embedding init: normal(0, D^-0.5) as fairseq does for a shared, sqrt(D)-scaled table:
        # the scaled embedding then has unit variance and the tied projection starts small.
        # The PAD row starts at zero. Rows >= vocab_size are padding: never looked up or scored.
        self.embed = self._embedding(self.padded_vocab, D)  # target embedding + projection
        self.src_embed = None if cfg.share_embeddings else self._embedding(self.padded_vocab, D)
        self.register_buffer("pe", sinusoidal_positions(cfg.max_positions, D), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        attn_p = attention_dropout(cfg)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, attn_p) for _ in range(cfg.N))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, attn_p) for _ in range(cfg.N_dec or cfg.N))
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(D) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(D) if pre else nn.Identity()

    @staticmethod
    def _embedding(rows: int, d_model: int) -> nn.Parameter:
        weight = torch.empty(rows, d_model)
        nn.init.normal_(weight, mean=0.0, std=d_model**-0.5)
        weight[PAD].zero_()
        return nn.Parameter(weight)

    @property
    def output_weight(self) -> nn.Parameter:
        """The pre-softmax projection, tied to the target embedding."""
        return self.embed

    def _embed(self, tokens: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Dropout(Embedding(tokens) * sqrt(D) + PE[start : start + L]): (B, L) -> (B, L, D)."""
        L = tokens.size(1)
        if start + L > self.max_positions:
            raise ValueError(
                f"sequence of length {start + L} exceeds model.max_positions={self.max_positions}"
            )
        x = F.embedding(tokens, weight) * math.sqrt(self.d_model)
        return self.dropout(x + self.pe[start : start + L])

    def encode(self, src: torch.Tensor, real: RealPositions | None = None) -> EncoderOut:
        """Encode a right-padded source batch: src (B, S) ids (tokens + EOS, PAD-padded) ->
        memory (B, S, D) and its key mask. With ``real`` (training batches,
        ``mt.data.batches.Batch.real``) a source without padding needs no mask (None)."""
        mask = None if real is not None and real.src is None else pad_mask(src)
        x = self._embed(src, self.embed if self.src_embed is None else self.src_embed)
        for layer in self.encoder:
            x = layer(x, mask)
        return EncoderOut(self.encoder_norm(x), mask)

    def new_cache(self, dtype: torch.dtype | None = None) -> DecoderCache:
        """An empty incremental state for :meth:`decode` (one cache per decoder layer)."""
        return DecoderCache(len(self.decoder), dtype)

    def decode(
        self,
        tgt_in: torch.Tensor,
        enc: EncoderOut,
        cache: DecoderCache | None = None,
        need_attn: bool = False,
        attn_layer: int = -1,
        project: bool = True,
        vocab: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) of target ids ``tgt_in`` (B, T) (BOS + prefix) given ``enc``.

        ``enc`` holds rows matching ``tgt_in``, or one row per G consecutive rows of ``tgt_in``
        (the beams of a sentence share its encoder row and encoder-decoder keys/values; see
        ``DecoderCache.select``). With ``cache`` (:meth:`new_cache`, updated in place)
        ``tgt_in`` holds only the NEW token(s); positions continue from what the cache holds.
        ``need_attn``: also return ``attn`` (B, T, S), layer ``attn_layer``'s cross-attention
        averaged over heads: ``(logits, attn)``. ``project=False`` stops before the projection
        (the decoder output, (B, T, D)); ``vocab`` projects onto some pieces only: (B, T, C) from
        ``vocab.project(h, output_weight)`` (``mt.decode.shortlist.Shortlist``).
        """
        T = tgt_in.size(1)
        past = 0 if cache is None else cache.length  # positions decoded so far
        # Targets are right-padded, so the causal mask alone keeps real positions off pad keys.
        if cache is None or past == 0:
            self_mask, is_causal = None, True  # T = 1: the same (a SymBool under compile)
        elif T == 1:
            self_mask, is_causal = None, False  # one new token sees the whole cached prefix
        else:  # several new tokens after a prefix: new token i sees keys <= past + i
            self_mask, is_causal = subsequent_mask(T, tgt_in.device, past), False
        x = self._embed(tgt_in, self.embed, past)
        wanted = attn_layer % len(self.decoder)
        attn = None
        for i, layer in enumerate(self.decoder):
            layer_cache = None if cache is None else cache.layers[i]
            want = need_attn and i == wanted
            x, weights = layer(x, enc, self_mask, is_causal, layer_cache, want)
            if want:  # (B, H, T, S) -> (B, T, S)
                attn = weights.mean(dim=1)
        out = self.decoder_norm(x)
        if project:
            out = self.project(out) if vocab is None else vocab.project(out, self.output_weight)
        return (out, attn) if need_attn else out

    def features(
        self, src: torch.Tensor, tgt_in: torch.Tensor, real: RealPositions | None = None
    ) -> torch.Tensor:
        """Decoder output before the projection: (B, S), (B, T) -> (B, T, D)."""
        return self.decode(tgt_in, self.encode(src, real), project=False)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-softmax projection with the tied embedding: (..., D) -> (..., V). The product
        uses all padded rows (aligned shapes are faster); the padded columns are then sliced
        off, so they never receive probability."""
        logits = F.linear(h, self.output_weight)  # (..., V_padded)
        return logits if self.padded_vocab == self.vocab_size else logits[..., : self.vocab_size]

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        real: RealPositions | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """Teacher-forced logits: src (B, S), tgt_in (B, T) -> (B, T, V).

        With ``real`` (``mt.data.batches.Batch.real``) only the real target positions are
        projected: (n, V), row-major. Training uses this, so padding costs nothing in the
        projection and the loss, and nothing waits for the device to find the positions.
        ``project=False``: the decoder output of those positions, for :meth:`loss`.
        """
        h = self.features(src, tgt_in, real)  # (B, T, D)
        if real is not None:
            h = h.reshape(-1, h.size(-1))  # (B*T, D)
            h = h if real.tgt is None else h.index_select(0, real.tgt)  # (n, D)
        return self.project(h) if project else h

    def loss(
        self, h: torch.Tensor, target: torch.Tensor, smoothing: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed (label-smoothed loss, NLL) of decoder outputs h (n, D) against target (n,):
        ``mt.model.loss.label_smoothed_nll_loss`` of ``log_softmax(project(h))`` in float32.
        (``mt.fast.for_training``'s loss computes the same without the (n, V) log-probs.)"""
        lprobs = F.log_softmax(self.project(h).float(), dim=-1)  # (n, V)
        return label_smoothed_nll_loss(lprobs, target, smoothing)


def build_model(model_cfg: ModelConfig | dict, vocab_size: int) -> Transformer:
    """The Transformer for ``model_cfg`` (a ModelConfig, or the dict a checkpoint stores)."""
    if isinstance(model_cfg, dict):
        model_cfg = ModelConfig(**model_cfg)
    if not dataclasses.is_dataclass(model_cfg):
        raise TypeError(f"model_cfg must be a ModelConfig or dict, got {type(model_cfg)}")
    return Transformer(model_cfg, vocab_size)
