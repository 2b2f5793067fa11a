"""The decoder's incremental state: per-layer key/value caches with the row operations that
search needs: self-attention's keys/values of every earlier position (a growing buffer) and
the encoder output's for encoder-decoder attention (computed once). Beam search moves rows:
a surviving hypothesis takes its parent's state (:meth:`DecoderCache.select`,
:meth:`DecoderCache.copy_rows`), and a sentence whose search has ended is dropped (``sents``).

Rows: the self-attention caches hold one row per hypothesis (B = G * n rows); the
encoder-decoder caches hold one row per sentence (n rows), shared by its G hypotheses.

Shape letters: B decoder rows, n sentences, H heads, C capacity, S source length, d_k head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class SelfAttentionCache:
    """Keys and values of the positions decoded so far, in preallocated buffers: new positions
    are written in place (no re-concatenation of the whole prefix each step), and the capacity
    doubles when it runs out."""

    k: torch.Tensor | None = None  # (B, H, C, d_k) buffers, None before the first step
    v: torch.Tensor | None = None
    length: int = 0  # how many of the C positions are filled
    dtype: torch.dtype | None = None  # what the buffers hold (None: the keys/values' own)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys/values (B, H, T, d_k) of T new positions; returns (B, H, length + T,
        d_k) views of every position so far."""
        if self.dtype is not None and k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        past, end = self.length, self.length + k.size(2)
        if self.k is None or self.k.size(2) < end or self.k.dtype != k.dtype:
            B, H, _, d_k = k.shape
            new_k = torch.empty(B, H, max(end, 2 * past, 16), d_k, dtype=k.dtype, device=k.device)
            new_v = torch.empty_like(new_k)
            if past:
                new_k[:, :, :past], new_v[:, :, :past] = self.filled()
            self.k, self.v = new_k, new_v
        self.k[:, :, past:end], self.v[:, :, past:end] = k, v
        self.length = end
        return self.filled()

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, length, d_k) views of the filled positions."""
        assert self.k is not None and self.v is not None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def select(self, rows: torch.Tensor) -> SelfAttentionCache:
        """A new cache whose row i is row ``rows[i]`` of this one (only filled positions move)."""
        if self.k is None:
            return SelfAttentionCache(dtype=self.dtype)
        out = []
        for buf, filled in zip((self.k, self.v), self.filled()):
            if _tracked(buf):  # out= has no autograd
                out.append(filled.index_select(0, rows))
                continue
            new = buf.new_empty(rows.numel(), *buf.shape[1:])
            torch.index_select(filled, 0, rows, out=new[:, :, : self.length])
            out.append(new)
        return SelfAttentionCache(out[0], out[1], self.length, self.dtype)

    def compact(self, rows: torch.Tensor, moved: torch.Tensor | None) -> SelfAttentionCache:
        """What :meth:`select` gives, made in this cache's buffers: the places ``moved``
        (``_moves_from_beyond(rows)``) take their rows from beyond the new end, and the buffers
        are cut to ``len(rows)`` rows. This cache is not to be used afterwards. ``moved`` None
        (``rows`` not of that form): :meth:`select`."""
        if self.k is None or moved is None or _tracked(self.k):
            return self.select(rows)
        _copy_rows(self.filled(), moved, rows[moved])
        n = rows.numel()
        return SelfAttentionCache(self.k[:n], self.v[:n], self.length, self.dtype)


@dataclass(slots=True, eq=False)
class CrossAttentionCache:
    """Keys and values of the encoder output for one layer's encoder-decoder attention,
    computed at the first step: (n, H, S, d_k) each, one row per sentence."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    dtype: torch.dtype | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the memory's keys/values (n, H, S, d_k), contiguous once (not copied by every
        step's products) and in the cache's dtype; returns them."""
        dtype = self.dtype or k.dtype
        self.k, self.v = k.to(dtype).contiguous(), v.to(dtype).contiguous()
        return self.k, self.v

    def select(self, sents: torch.Tensor) -> CrossAttentionCache:
        """A new cache holding the sentences ``sents``."""
        if self.k is None:
            return CrossAttentionCache(dtype=self.dtype)
        k, v = self.k.index_select(0, sents), self.v.index_select(0, sents)
        return CrossAttentionCache(k, v, self.dtype)

    def compact(self, sents: torch.Tensor, moved: torch.Tensor | None) -> CrossAttentionCache:
        """:meth:`select` in this cache's buffers, as :meth:`SelfAttentionCache.compact`."""
        if self.k is None or moved is None or _tracked(self.k):
            return self.select(sents)
        _copy_rows((self.k, self.v), moved, sents[moved])
        n = sents.numel()
        return CrossAttentionCache(self.k[:n], self.v[:n], self.dtype)


@dataclass(slots=True, eq=False)
class LayerCache:
    """One decoder layer's state: its self-attention and encoder-decoder attention caches."""

    self_attn: SelfAttentionCache
    cross_attn: CrossAttentionCache


class DecoderCache:
    """The incremental state of a whole decoder: one :class:`LayerCache` per layer, holding
    ``dtype`` (None: the keys/values' own, e.g. bfloat16 under autocast)."""

    def __init__(self, n_layers: int, dtype: torch.dtype | None = None) -> None:
        self.layers = [
            LayerCache(SelfAttentionCache(dtype=dtype), CrossAttentionCache(dtype=dtype))
            for _ in range(n_layers)
        ]
        self.dtype = dtype

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        return self.layers[0].self_attn.length if self.layers else 0

    def select(self, rows: torch.Tensor, sents: torch.Tensor | None = None) -> DecoderCache:
        """Follow the surviving hypotheses: a new cache with decoder rows ``rows`` (B',) and,
        when ``sents`` (n',) is given, the encoder-side rows of those sentences (else as is)."""
        out = DecoderCache(0, self.dtype)
        out.layers = [
            LayerCache(
                layer.self_attn.select(rows),
                layer.cross_attn if sents is None else layer.cross_attn.select(sents),
            )
            for layer in self.layers
        ]
        return out

    def compact(self, rows: torch.Tensor, sents: torch.Tensor) -> DecoderCache:
        """What :meth:`select` gives, moving only the rows that change place when ``rows`` and
        ``sents`` fill the places of dropped rows from beyond the new end and keep the rest
        (see ``SelfAttentionCache.compact``); this cache is not to be used afterwards."""
        moved_rows, moved_sents = _moves_from_beyond(rows), _moves_from_beyond(sents)  # once
        out = DecoderCache(0, self.dtype)
        out.layers = [
            LayerCache(
                layer.self_attn.compact(rows, moved_rows),
                layer.cross_attn.compact(sents, moved_sents),
            )
            for layer in self.layers
        ]
        return out

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """In place: decoder rows ``dst`` (m,) take the contents of rows ``src`` (m,), disjoint
        from ``dst``; encoder-side rows are unchanged (the hypotheses stay in their sentence)."""
        for layer in self.layers:
            if layer.self_attn.k is not None:
                _copy_rows(layer.self_attn.filled(), dst, src)


def _copy_rows(tensors, dst: torch.Tensor, src: torch.Tensor) -> None:
    """In place, in each tensor: rows ``dst`` take the contents of rows ``src`` (disjoint)."""
    if dst.numel():
        for t in tensors:
            t.index_copy_(0, dst, t.index_select(0, src))


def _tracked(t: torch.Tensor) -> bool:
    """Whether autograd records operations on ``t`` (in-place moves would then be wrong)."""
    return t.requires_grad and torch.is_grad_enabled()


def _moves_from_beyond(rows: torch.Tensor) -> torch.Tensor | None:
    """The places i with ``rows[i] != i`` when each of them takes a row from beyond the new
    end (``rows[i] >= len(rows)``, so no moved row is overwritten before it is read); None
    when ``rows`` is not of that form."""
    n = rows.numel()
    moved = (rows != torch.arange(n, device=rows.device)).nonzero().squeeze(1)
    if moved.numel() and not bool((rows[moved] >= n).all()):
        return None
    return moved


__all__ = ["CrossAttentionCache", "DecoderCache", "LayerCache", "SelfAttentionCache"]
