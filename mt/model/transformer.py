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
:class:`mt.model.kv_cache.DecoderCache` (``new_cache()``) decodes incrementally (keys/values of the
target prefix are kept per layer, the encoder-decoder keys/values are computed once). Masks are
boolean, True = may attend.

Shape letters: B batch, S source length, T target length, D d_model, V vocab_size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.attention import SDPA, CrossAttention, Kernels, SelfAttention, teacher_forced_kernels
from mt.model.kv_cache import DecoderCache, LayerCache
from mt.model.loss import label_smoothed_cross_entropy, projected_cross_entropy
from mt.model.masks import RealPositions, pad_mask, subsequent_mask
from mt.schema import ModelConfig, attention_dropout
from mt.vocab import PAD


class EncoderOut(NamedTuple):
    """What the decoder needs from the encoder."""

    memory: torch.Tensor  # (B, S, D) encoder output
    src_mask: torch.Tensor | None  # (B, 1, 1, S) key mask (see Kernels.key_mask); None: no pad

    def select(self, sents: torch.Tensor) -> EncoderOut:
        """The rows ``sents`` (n',) of the encoder output (sentences still searching)."""
        mask = None if self.src_mask is None else self.src_mask.index_select(0, sents)
        return EncoderOut(self.memory.index_select(0, sents), mask)


def sinusoidal_positions(max_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

    Returns:
        (max_positions, d_model) float32 table (computed in float64 for accuracy).
    """
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
    """Residual wiring shared by encoder and decoder layers."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool, n_sublayers: int) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.dropout = nn.Dropout(dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_sublayers))

    def residual(self, x: torch.Tensor, i: int, sublayer: Callable) -> torch.Tensor:
        """post-LN: LayerNorm(x + Dropout(Sublayer(x))); pre-LN: x + Dropout(Sublayer(LN(x)))."""
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norms[i](x)))
        return self.norms[i](x + self.dropout(sublayer(x)))

    def packed_residual(
        self, x: torch.Tensor, i: int, sublayer: Callable, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`residual` of a position-wise sublayer (the FFN) on the real positions only.

        ``rows`` are the flat indices of the non-pad positions of ``x`` (B, L, D), or None (no
        padding). Padded positions come out as zeros: nothing reads them (keys there are
        masked, and the causal mask keeps real target queries off the right padding).
        """
        if rows is None:
            return self.residual(x, i, sublayer)
        B, L, D = x.shape
        packed = self.residual(x.reshape(B * L, D).index_select(0, rows), i, sublayer)
        return x.new_zeros(B * L, D).index_copy(0, rows, packed).view(B, L, D)


class EncoderLayer(_Layer):
    """Self-attention then FFN."""

    def __init__(self, cfg: ModelConfig, attention_dropout: float) -> None:
        super().__init__(cfg.d_model, cfg.dropout, cfg.norm == "pre", 2)
        self.self_attn = SelfAttention(cfg.d_model, cfg.h, attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        rows: torch.Tensor | None = None,
        kernels: Kernels = SDPA,
    ) -> torch.Tensor:
        """x (B, S, D), mask (B, 1, 1, S), rows (see :func:`real_rows`) -> (B, S, D)."""
        x = self.residual(x, 0, lambda y: self.self_attn(y, mask=mask, kernels=kernels))
        return self.packed_residual(x, 1, self.ffn, rows)


class DecoderLayer(_Layer):
    """Causal self-attention, encoder-decoder attention, then FFN."""

    def __init__(self, cfg: ModelConfig, attention_dropout: float) -> None:
        super().__init__(cfg.d_model, cfg.dropout, cfg.norm == "pre", 3)
        self.self_attn = SelfAttention(cfg.d_model, cfg.h, attention_dropout)
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
        rows: torch.Tensor | None = None,
        kernels: Kernels = SDPA,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, D) -> (B, T, D) and the cross-attention weights (B, H, T, S) or None.
        ``rows``: the non-pad positions for the FFN (see :func:`real_rows`)."""
        self_cache = None if cache is None else cache.self_attn
        cross_cache = None if cache is None else cache.cross_attn
        x = self.residual(
            x, 0, lambda y: self.self_attn(y, self_mask, is_causal, self_cache, kernels)
        )
        weights = None

        def cross(y: torch.Tensor) -> torch.Tensor:
            nonlocal weights
            out, weights = self.cross_attn(
                y, enc.memory, enc.src_mask, cross_cache, need_weights, kernels
            )
            return out

        x = self.residual(x, 1, cross)
        return self.packed_residual(x, 2, self.ffn, rows), weights


def real_rows(tokens: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the non-pad positions of (B, L) ``tokens``; None when there is no
    padding (or in incremental decoding, where every row is real)."""
    keep = (tokens != PAD).view(-1)
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(1)


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see the module docstring. Build with :func:`build_model`."""

    # The pre-softmax product; the CPU training copy swaps in oneDNN's (mt.fast.training).
    product = staticmethod(F.linear)
    # How teacher-forced passes compute attention; None: the device's default
    # (mt.model.attention.teacher_forced_kernels). The CPU training copy sets its own.
    teacher_kernels: Kernels | None = None
    # How the training loss meets the projection (see `loss`): False, the (n, V) logits and then
    # the loss; True (the CPU training copy), both in row blocks, the logits never held whole.
    blockwise_loss: bool = False

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
    def src_embedding(self) -> nn.Parameter:
        """The source embedding table (the shared one unless ``share_embeddings=false``)."""
        return self.embed if self.src_embed is None else self.src_embed

    @property
    def tgt_embedding(self) -> nn.Parameter:
        """The target embedding table."""
        return self.embed

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

    def encode(
        self, src: torch.Tensor, kernels: Kernels = SDPA, real: RealPositions | None = None
    ) -> EncoderOut:
        """Encode a right-padded source batch.

        Args:
            src: (B, S) ids (tokens + EOS, PAD-padded).
            kernels: how attention is computed (``mt.fast.decoding`` picks them for decoding).
            real: the real positions when the caller knows them (training batches); None:
                found here (which reads the device).

        Returns:
            EncoderOut(memory (B, S, D), src_mask (B, 1, 1, S)).
        """
        mask = kernels.key_mask(pad_mask(src), padded=real is None or real.src is not None)
        rows = real_rows(src) if real is None else real.src
        x = self._embed(src, self.src_embedding)
        for layer in self.encoder:
            x = layer(x, mask, rows, kernels)
        return EncoderOut(self.encoder_norm(x), mask)

    def _decoder(
        self,
        tgt_in: torch.Tensor,
        enc: EncoderOut,
        cache: DecoderCache | None,
        need_attn: bool,
        attn_layer: int = -1,
        real: RealPositions | None = None,
        kernels: Kernels = SDPA,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder stack: (B, T) ids -> (B, T, D) features and (B, T, S) attention or None.
        ``kernels``: attention without a cache (with one: the cache's)."""
        T = tgt_in.size(1)
        past = 0 if cache is None else cache.length  # positions decoded so far
        # Targets are right-padded, so the causal mask alone keeps real positions off pad keys.
        if cache is None or past == 0:
            self_mask, is_causal = None, True  # T = 1: the same (a SymBool under compile)
        elif T == 1:
            self_mask, is_causal = None, False  # one new token sees the whole cached prefix
        else:  # several new tokens after a prefix: new token i sees keys <= past + i
            self_mask, is_causal = subsequent_mask(T, tgt_in.device, past), False
        x = self._embed(tgt_in, self.tgt_embedding, past)
        rows = None if cache is not None else real_rows(tgt_in) if real is None else real.tgt
        if cache is not None:
            kernels = SDPA if cache.kernels is None else cache.kernels
        wanted = attn_layer % len(self.decoder)
        attn = None
        for i, layer in enumerate(self.decoder):
            layer_cache = None if cache is None else cache.layers[i]
            want = need_attn and i == wanted
            x, weights = layer(x, enc, self_mask, is_causal, layer_cache, want, rows, kernels)
            if want:  # (B, H, T, S) -> (B, T, S)
                attn = weights.mean(dim=1)
        return self.decoder_norm(x), attn

    def new_cache(self, kernels: Kernels | None = None) -> DecoderCache:
        """An empty incremental state for :meth:`decode` (one cache per decoder layer)."""
        return DecoderCache(len(self.decoder), kernels)

    def decode(
        self,
        tgt_in: torch.Tensor,
        enc: EncoderOut,
        cache: DecoderCache | None = None,
        need_attn: bool = False,
        head: nn.Module | None = None,
        attn_layer: int = -1,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode target tokens given the encoder output.

        Args:
            tgt_in: (B, T) ids (BOS + prefix). With ``cache`` only the NEW token(s); positions
                continue from what the cache holds.
            enc: the output of :meth:`encode`: rows matching ``tgt_in``, or one row per G
                consecutive rows of ``tgt_in`` (beam search: the K beams of a sentence share
                its encoder row and encoder-decoder keys/values; see ``DecoderCache.select``).
            cache: None (decode the whole prefix) or a :class:`DecoderCache` (empty at the
                first step: :meth:`new_cache`), updated in place with per-layer keys/values.
            need_attn: also return a layer's cross-attention averaged over heads.
            head: a replacement for the output projection (``mt.fast.decoding``'s oneDNN or int8
                copies of it), producing ``padded_vocab`` columns.
            attn_layer: which decoder layer's attention ``need_attn`` returns (-1: the last).

        Returns:
            logits (B, T, V), or ``(logits, attn (B, T, S))`` with ``need_attn``.
        """
        h, attn = self._decoder(tgt_in, enc, cache, need_attn, attn_layer)
        if head is None:
            logits = self.project(h)
        else:  # a oneDNN or int8 copy of the projection (mt.fast.decoding); same padded columns
            logits = head(h)[..., : self.vocab_size]
        return (logits, attn) if need_attn else logits

    def reorder(
        self, enc: EncoderOut, cache: DecoderCache | None, index: torch.Tensor
    ) -> tuple[EncoderOut, DecoderCache | None]:
        """Select/reorder batch rows of the encoder output and the cache, the encoder output
        kept row-aligned with the decoder rows.

        Args:
            index: (B',) long row indices into the current batch.

        Returns:
            The new ``(enc, cache)``; the inputs are left unchanged.
        """
        return enc.select(index), None if cache is None else cache.select(index, index)

    def features(
        self, src: torch.Tensor, tgt_in: torch.Tensor, real: RealPositions | None = None
    ) -> torch.Tensor:
        """Decoder output before the projection: (B, S), (B, T) -> (B, T, D)."""
        kernels = self.teacher_kernels or teacher_forced_kernels(src.device)
        enc = self.encode(src, kernels, real)
        return self._decoder(tgt_in, enc, None, False, real=real, kernels=kernels)[0]

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-softmax projection with the tied embedding: (..., D) -> (..., V).

        The product uses all padded rows (aligned shapes are faster); the padded columns are
        then sliced off, so they never receive probability.
        """
        logits = self.product(h, self.output_weight)  # (..., V_padded)
        return logits if self.padded_vocab == self.vocab_size else logits[..., : self.vocab_size]

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        real: RealPositions | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """Teacher-forced logits: src (B, S), tgt_in (B, T) -> (B, T, V).

        With ``real`` (a batch's real positions, ``mt.data.batches.Batch.real``) only the real
        target positions are projected: -> (n, V), rows in row-major order (all B*T of them
        when the target has no padding). Training uses this, so padding costs nothing in the
        projection and the loss, and nothing waits for the device to find the positions.
        ``project=False`` (training, with ``real``) stops before the projection: the decoder
        features of those positions, (n, D), for :meth:`loss`.
        """
        h = self.features(src, tgt_in, real)
        if real is None:
            return self.project(h) if project else h
        h = h.reshape(-1, h.size(-1))  # (B*T, D)
        h = h if real.tgt is None else h.index_select(0, real.tgt)  # (n, D)
        return self.project(h) if project else h

    def loss(
        self, h: torch.Tensor, target: torch.Tensor, smoothing: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed (label-smoothed loss, NLL) of decoder features h (n, D) against target (n,).

        The logits ``project(h)`` scored by ``mt.model.loss.label_smoothed_cross_entropy``; with
        ``blockwise_loss``, the same sums from ``mt.model.loss.projected_cross_entropy``, which
        projects and scores one block of rows at a time (same math, less memory traffic).
        """
        if self.blockwise_loss:
            return projected_cross_entropy(
                h, self.output_weight, target, smoothing, self.vocab_size, self.product
            )
        return label_smoothed_cross_entropy(self.project(h), target, smoothing, None)


def build_model(model_cfg: ModelConfig | dict, vocab_size: int) -> Transformer:
    """The Transformer for ``model_cfg`` (a ModelConfig, or the dict a checkpoint stores).

    Example:
        >>> model = build_model(ModelConfig(N=1, d_model=16, d_ff=32, h=2), vocab_size=50)
        >>> model(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]])).shape
        torch.Size([1, 2, 50])
    """
    if isinstance(model_cfg, dict):
        model_cfg = ModelConfig(**model_cfg)
    if not dataclasses.is_dataclass(model_cfg):
        raise TypeError(f"model_cfg must be a ModelConfig or dict, got {type(model_cfg)}")
    return Transformer(model_cfg, vocab_size)
