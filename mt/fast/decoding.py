"""Decoding copies of a Transformer: the fastest correct kernels for decoding on a CPU.

``for_decoding(model, quantize, precision, onednn)`` returns what search runs, a
:class:`DecodingModel` behind the contract search depends on (``mt.decode.search.
IncrementalDecoder``):

* ``onednn`` (default; CPU only): every ``nn.Linear`` and the tied pre-softmax projection run
  through oneDNN's linear kernel (``mt.fast.onednn``), with the FFN's ReLU fused into it. In
  fp32 the products stay float32 and use copies of the weights in oneDNN's own layout, packed
  once (``mt.fast.onednn.pack``): unpacked, every product re-lays its weight out, which costs
  as much as the product itself at a decoder step's few rows.
* ``precision=bf16`` (CPU): the same, with bfloat16 copies of the weights made once (packed
  too): inputs go to bfloat16 for the product and the result comes back in float32, so
  LayerNorm, attention, the softmax and the residual stream stay float32 (what CPU autocast
  computes, without casting every weight at every step). Where oneDNN has no bfloat16 kernels
  (CPUs without AVX-512), the model runs under bf16 autocast instead (:func:`needs_autocast`).
* ``onednn=null`` (auto): whichever float32 products measure fastest here on the FFN's shapes
  (:func:`fp32_products`): oneDNN's, mt's own (:mod:`mt.fast.fp32`, AVX2 and FMA: a row's
  result independent of the batch) or torch's; with torch's, the projection over the
  vocabulary (the widest product, a different shape) through oneDNN if that alone measures
  faster (:func:`onednn_projects`). ``onednn="mt"`` (``make bench decode --kernels mt``) asks
  for mt's.
* ``quantize=int8``: dynamically quantized int8 products (``mt.fast.quantize``).
* attention (in those copies): the short-query cores of ``mt.fast.attention`` and float32
  caches; every step after the first through ``mt.fast.step`` (the same formula with fewer
  calls into torch), its attention over the caches in mt's C++ kernel where it builds
  (``mt.fast.native``; ``native=False`` or ``MT_NATIVE_KERNELS=0``: torch's products), and
  there each step in one C++ call (``mt.fast.step.FusedStep``) where the copy's products are
  mt's int8 kernels, oneDNN's, mt's or torch's float32 (not fbgemm's, not bfloat16).

Elsewhere (a GPU, ``onednn=False``) the model itself decodes: SDPA's fused kernels, callers
autocast for bf16.

The original model is never modified (no attribute is set on it). Copies are cached per model
and rebuilt when its weights change (in-place updates bump a tensor's version; ``.to()`` moves
them), so validation during training decodes with the current weights;
:func:`release_decoding_copies` lets them go (training, after each validation).
"""

from __future__ import annotations

import logging
import os
import weakref
from functools import cache, partial

import torch
from torch import nn

import mt.fast.native as native_kernels
import mt.fast.probe as probe
from mt.fast.attention import ShortQueryAttention, gpu_attention, install
from mt.fast.fp32 import Fp32FeedForward, fp32_copy
from mt.fast.memory import hold_freed_memory
from mt.fast.modules import products_copy, shared_copy
from mt.fast.onednn import (
    FusedFeedForward,
    OneDNNLinear,
    onednn_available,
    onednn_bf16_available,
)
from mt.fast.quantize import quantize_int8
from mt.fast.step import FusedStep, applies, decoder_step
from mt.model.kv_cache import DecoderCache
from mt.model.transformer import Transformer

log = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8")

# model -> {kind: (weights' identity when built, copy)}.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DecodingModel(nn.Module):
    """What search runs: a model (or its decoding copy), its output projection and the dtype of
    its decoder caches, behind the decoding contract (``mt.decode.search.IncrementalDecoder``).

    Args:
        module: an ``mt.model.transformer.Transformer`` or a copy made here (not modified).
        head: a replacement for the output projection over all ``padded_vocab`` rows (oneDNN or
            int8), or None: the module's own.
        cache_dtype: what the decoder caches hold (None: the keys' own dtype).
        step: the steps after the first (one new token per row) through
            ``mt.fast.step.decoder_step`` where it applies; False: always the module's own.
        kernel: the steps' attention through ``torch.ops.mt.short_attention``
            (``mt.fast.native``; float32 caches), or None: torch's batched products.
        fused: the steps in one C++ call (``mt.fast.step.FusedStep``; with ``step``), or
            None: layer by layer (``mt.fast.step.decoder_step``).
    """

    def __init__(
        self,
        module: nn.Module,
        head: nn.Module | None = None,
        cache_dtype=None,
        step: bool = False,
        kernel=None,
        fused: FusedStep | None = None,
    ) -> None:
        super().__init__()
        self.module, self.head, self.cache_dtype, self.step = module, head, cache_dtype, step
        self.kernel, self.fused = kernel, fused
        self.max_positions: int = module.max_positions
        self.vocab_size: int = module.vocab_size

    def encode(self, src: torch.Tensor):
        """(B, S) source ids -> the module's encoder output."""
        return self.module.encode(src)

    def new_cache(self) -> DecoderCache:
        """An empty incremental state (caches of ``cache_dtype``)."""
        return self.module.new_cache(self.cache_dtype)

    def decode(self, tgt_in: torch.Tensor, enc, cache: DecoderCache | None = None, vocab=None):
        """(B, T) new target ids -> (B, T, V) logits (see ``Transformer.decode``); with
        ``vocab`` (``mt.decode.shortlist.Shortlist``) (B, T, C) over its columns: a product
        of the head's kind (int8, oneDNN float32 or bfloat16) over those pieces' rows, made
        once per batch."""
        if self.step and applies(tgt_in, cache, self.module):
            if self.fused is not None:
                h = self.fused(self.module, tgt_in, enc.memory, enc.src_mask, cache)
            else:
                h = decoder_step(self.module, tgt_in, enc.memory, enc.src_mask, cache,
                                 self.kernel)  # fmt: skip
            h = h[:, None]
        elif vocab is None and self.head is None:
            return self.module.decode(tgt_in, enc, cache)
        else:
            h = self.module.decode(tgt_in, enc, cache, project=False)  # (B, T, D)
        if vocab is not None:
            return vocab.project(h, self.module.output_weight, self.head)
        logits = self.module.project(h) if self.head is None else self.head(h)
        return logits[..., : self.vocab_size]  # the padded columns sliced off

    def greedy_search(self, src: torch.Tensor, limits: list[int], min_len: int, alpha: float,
                      shortlist=None):  # fmt: skip
        """A batch's whole greedy search in one C++ call (``FusedStep.greedy``: what
        ``mt.decode.search.generate`` finds with ``Greedy`` through :meth:`decode`, over a
        ``shortlist``'s pieces where given), or None where this copy has no fused step or its
        head is not a product the call runs."""
        if not self._searches(src):
            return None
        return self.fused.greedy(self.module, self.encode(src), limits, min_len, alpha,
                                 shortlist)  # fmt: skip

    def beam_search(self, src: torch.Tensor, K: int, limits: list[int], min_len: int,
                    alpha: float, nbest: int, settle: bool, shortlist=None):  # fmt: skip
        """A batch's whole beam search in one C++ call (``FusedStep.beam``: what
        ``generate`` finds with ``Beam(K)`` through :meth:`decode`), or None as for
        :meth:`greedy_search`."""
        if not self._searches(src):
            return None
        return self.fused.beam(self.module, self.encode(src), limits, K, nbest, alpha, settle,
                               min_len, shortlist)  # fmt: skip

    def _searches(self, src: torch.Tensor) -> bool:
        """Whether a whole search in one call computes what :meth:`decode`'s steps would: a
        fused step with a head it runs, eval mode, a CPU batch, no autocast."""
        return not (self.fused is None or self.fused.head is None or not self.step
                    or self.module.training or src.device.type != "cpu"
                    or torch.is_autocast_enabled("cpu"))  # fmt: skip


def onednn_copy(
    model: Transformer, dtype: torch.dtype = torch.float32, rows: int | None = None
) -> tuple[nn.Module, nn.Module]:
    """A copy of ``model`` whose Linear layers run through oneDNN, and a oneDNN projection.

    Parameters and buffers are shared with ``model`` (not copied); with ``dtype=bfloat16`` the
    Linear and projection weights are bfloat16 copies; with ``rows`` the products also keep
    their weights in oneDNN's own layout, packed for about that many rows
    (``mt.fast.onednn.pack``: a copy, faster at a decoder step's few rows).

    Returns:
        ``(copy, head)``: the copy in eval mode, for decoding only, and the pre-softmax
        projection as a oneDNN product.
    """
    clone = products_copy(model, lambda c: FusedFeedForward(c, dtype, rows),
                          lambda c: OneDNNLinear(c.weight, c.bias, dtype, rows=rows))
    return clone, OneDNNLinear(clone.output_weight, None, dtype, rows=rows)


def _identity(model: nn.Module) -> tuple:
    """Changes when the weights change: in place (version bump) or by moving (new storage).
    Kernels that write parameters without a version bump (torch's fused Adam) must be followed
    by ``torch.autograd.graph.increment_version`` (``mt.train.update.Updater`` does)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _kind(
    model: nn.Module, quantize: str, precision: str, onednn: bool | str | None, rows: int = 256
) -> str | None:
    """Which products the decoding copy has: int8, onednn-fp32, onednn-bf16, mt-fp32 (mt's
    float32 kernel), torch (the model's own, with the copy's attention), or None (the model
    itself, as written). ``onednn=None`` (auto) measures the float32 products here at ``rows``
    (:func:`fp32_products`); ``onednn="mt"`` asks for mt's float32 kernel."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"decode.quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"decode.precision must be fp32 or bf16, got {precision!r}")
    if onednn not in (True, False, None, "mt"):
        raise ValueError(f"decoding products: onednn must be true, false, null or 'mt', "
                         f"got {onednn!r}")
    if quantize == "int8":
        return "int8"
    if onednn is False or _device(model).type != "cpu":
        return None
    if onednn == "mt":
        if precision != "fp32" or native_kernels.f32_linear() is None:
            raise ValueError("mt's float32 kernel decodes in fp32 on a CPU with AVX2 and FMA "
                             f"where mt's kernels build (precision {precision}; "
                             f"{native_kernels.unavailable_reason() or 'no AVX2 and FMA'})")
        return "mt-fp32"
    if precision == "bf16":
        if not onednn_available():
            return None if onednn else "torch"  # under bf16 autocast
        if onednn_bf16_available():
            return "onednn-bf16"
        _warn_emulated_bf16()
        return None  # the model under bf16 autocast
    if onednn is None:
        return {"torch": "torch", "onednn": "onednn-fp32", "mt": "mt-fp32"}[
            fp32_products(model, rows)]
    return "onednn-fp32" if onednn_available() else None


def fp32_products(model: nn.Module, rows: int, cache_dir: str | None = None) -> str:
    """Which float32 products decode fastest here: ``"torch"``, ``"onednn"`` (oneDNN's, packed)
    or ``"mt"`` (mt's own, :mod:`mt.fast.fp32`), among those this build has, measured on the
    FFN's products, forward, over ``rows`` decoder rows (``mt.fast.probe``; cached in
    ``cache_dir`` or ``$MT_CACHE_DIR``). oneDNN reached 340-400 GFLOP/s where MKL reached 160
    on an AMD Zen 4; on a Zen 3 (AVX2) some of these shapes ran several times slower on it, and
    mt's kernel 1.0-1.25x as fast as oneDNN's at a decoder step's rows."""
    d, f = model.cfg.d_model, model.cfg.d_ff
    candidates = ["torch"] + ["onednn"] * onednn_available()
    candidates += ["mt"] * (native_kernels.enabled() and native_kernels.f32_linear() is not None)
    if len(candidates) == 1:
        return "torch"

    def make(candidate: str, n: int):
        x, pair = _ffn_inputs(n, d, f)
        if candidate == "torch":
            return partial(_torch_ffn, x, pair, "fp32")
        ffn = FusedFeedForward(pair, torch.float32, rows) if candidate == "onednn" else (
            Fp32FeedForward(pair))  # fmt: skip
        return lambda: ffn(x)

    return probe.choose("decode.fp32_products", _device(model), f"ffn {rows}x{d}x{f} packed",
                        make, candidates, rows, min(rows, 16),
                        cache_dir or os.environ.get("MT_CACHE_DIR"))  # fmt: skip


def onednn_projects(model: nn.Module, rows: int, cache_dir: str | None = None) -> bool:
    """Whether oneDNN's float32 product runs the pre-softmax projection (d_model x padded
    vocabulary, forward, over ``rows`` decoder rows) faster than torch's here, where the FFN's
    products stay torch's (``mt.fast.probe``; cached like :func:`fp32_products`). On an AMD
    Zen 3 the projection of a 256 x 8,000 model ran 1.2-1.9x faster through oneDNN while the
    FFN's shapes did not."""
    weight = model.output_weight
    v, d = weight.shape

    def make(candidate: str, n: int):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
        if candidate == "onednn":
            head = OneDNNLinear(w, None, torch.float32, rows=rows)
            return lambda: head(x)

        def step():
            with torch.inference_mode():
                return torch.nn.functional.linear(x, w)

        return step

    choice = probe.choose("decode.onednn_projection", _device(model), f"proj {rows}x{d}x{v} packed",
                          make, ["torch", "onednn"], rows, min(rows, 16),
                          cache_dir or os.environ.get("MT_CACHE_DIR"))  # fmt: skip
    return choice == "onednn"


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@cache
def _warn_emulated_bf16() -> None:
    log.warning(
        "decode.precision=bf16 on a CPU without bfloat16 kernels in oneDNN (no AVX-512): "
        "decoding under plain bf16 autocast, which is slower than fp32 here"
    )


def for_decoding(
    model: Transformer,
    quantize: str = "none",
    precision: str = "fp32",
    onednn: bool | str | None = True,
    fast_attention: bool = True,
    rows: int = 256,
    native: bool | None = None,
) -> DecodingModel:
    """The model to decode with for the ``decode.*`` settings (see the module docstring).

    Args:
        model: the trained model (left unchanged).
        quantize: ``decode.quantize``: none | int8.
        precision: ``decode.precision``: fp32 | bf16. On CPU with oneDNN the bf16 copy does its
            own casting (see :func:`needs_autocast`); elsewhere callers autocast.
        onednn: ``decode.onednn``: oneDNN's products on CPU (when this torch has them);
            None (auto): the fastest measured at ``rows`` decoder rows of oneDNN's, mt's
            own float32 kernel and torch's (:func:`fp32_products`); ``"mt"``: mt's.
        fast_attention: the copy's attention through the short-query cores (False: the
            model's SDPA).
        native: the decoder steps' attention through mt's C++ kernel (``mt.fast.native``),
            built here on first use; where it cannot be built, torch's products. None:
            unless ``MT_NATIVE_KERNELS=0``.

    A decoding copy (on a CPU) also keeps the memory decoding frees in the process for the next
    batch (``mt.fast.memory.hold_freed_memory``, glibc's allocator; training does the same).

    Returns:
        A :class:`DecodingModel` over a cached decoding copy, or over ``model`` itself where
        its own products are what runs (a GPU, ``onednn=False``, bf16 on a CPU without
        oneDNN's bfloat16 kernels): the model as written.

    Raises:
        ValueError: for an unknown ``quantize``, ``precision`` or ``onednn``, or ``"mt"``
            where mt's float32 kernel is not built or the precision is not fp32.
    """
    gpu_attention(next(model.parameters()).device)  # on CUDA: no cuDNN attention
    kind = _kind(model, quantize, precision, onednn, rows)
    if kind is None:  # the model as written decodes
        return DecodingModel(model)
    kernel = None
    if fast_attention and (native_kernels.enabled() if native is None else native):
        kernel = native_kernels.short_attention()  # built or loaded once per process
    copies = _CACHE.setdefault(model, {})  # the copies never refer to `model` itself
    identity = _identity(model)
    key = (kind, fast_attention, kernel is not None)
    hit = copies.get(key)
    if hit is not None and hit[0] == identity:
        return hit[1]
    copies.pop(key, None)
    del hit  # a stale copy is let go before its replacement is built: never two at once
    # a batch's caches are freed when it ends and allocated again, as large, for the next:
    # kept in the process, their pages are not faulted in and zeroed again (beam 5 on an AMD
    # Zen 3: 5x fewer page faults, 3-6% faster, the same peak resident memory)
    hold_freed_memory()
    if kind == "int8":
        clone, head = quantize_int8(model)
        log.info("decoding with an int8 dynamically quantized copy of the model")
    elif kind == "mt-fp32":
        clone, head = fp32_copy(model)
    elif kind == "torch":
        clone, head = shared_copy(model).eval(), None
        if onednn is None and onednn_available() and onednn_projects(model, rows):
            head = OneDNNLinear(clone.output_weight, None, torch.float32, rows=rows)
    else:
        clone, head = onednn_copy(
            model, torch.bfloat16 if kind == "onednn-bf16" else torch.float32, rows
        )
    if fast_attention:
        install(clone, ShortQueryAttention)
    cache_dtype = torch.float32 if fast_attention else None
    # each step in one C++ call where the copy's products are of a kind it runs
    fused = FusedStep.build(clone, head) if kernel is not None else None
    decoder = DecodingModel(clone, head, cache_dtype, step=fast_attention, kernel=kernel,
                            fused=fused)  # fmt: skip
    copies[key] = (identity, decoder)
    return decoder


def release_decoding_copies(model: nn.Module) -> None:
    """Let go of ``model``'s cached decoding copies (:func:`for_decoding`).

    Training calls this after each validation: the weights change at the next update, so the
    copy would be rebuilt at the next validation anyway, and kept it holds a second set of
    weights through training (29.6 MB for Multi30k's small model, fp32 oneDNN-packed: in use
    after the default run's first validation 279 MB instead of 308 on an AMD Zen 3).
    """
    _CACHE.pop(model, None)


def needs_autocast(
    model: nn.Module, quantize: str, precision: str, onednn: bool | None, rows: int = 256
) -> bool:
    """Whether decoding must run under bf16 autocast (False where the copy casts itself)."""
    if precision != "bf16":
        return False
    return _kind(model, quantize, precision, onednn, rows) != "onednn-bf16"


def resolve_precision(
    model: nn.Module, precision: str, quantize: str, onednn: bool, rows: int,
    cache_dir: str | None = None,
) -> str:  # fmt: skip
    """``decode.precision``: ``auto`` becomes fp32 or bf16, whichever runs the decoding copy's
    products (the FFN's, forward, over ``rows`` decoder rows: batch size x beam) faster here
    (``mt.fast.probe``; cached in ``cache_dir`` or, without one, ``$MT_CACHE_DIR``, and for the
    life of the process). int8 decoding and a GPU keep their own precision: fp32 there."""
    if precision != "auto":
        return precision
    device = _device(model)
    if quantize == "int8" or device.type != "cpu":
        return "fp32"
    d, f = model.cfg.d_model, model.cfg.d_ff
    use_onednn = onednn is True and onednn_available()

    def make(candidate: str, n: int):
        x, pair = _ffn_inputs(n, d, f)
        if use_onednn and (candidate == "fp32" or onednn_bf16_available()):
            dtype = torch.bfloat16 if candidate == "bf16" else torch.float32
            ffn = FusedFeedForward(pair, dtype, rows)  # packed, as the copy's
            return lambda: ffn(x)
        return partial(_torch_ffn, x, pair, candidate)

    cache_dir = cache_dir or os.environ.get("MT_CACHE_DIR")
    return probe.choose(
        "decode.precision", device, f"ffn {rows}x{d}x{f}", make, ["fp32", "bf16"], rows,
        min(rows, 16), cache_dir,
    )  # fmt: skip


def _ffn_inputs(n: int, d: int, f: int) -> tuple[torch.Tensor, _Pair]:
    """A probe's FFN at ``n`` rows of width ``d`` (hidden ``f``): its input and weights, the
    same for every candidate (seed 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    return x, _Pair(torch.randn(f, d, generator=g), torch.randn(d, f, generator=g))


def _torch_ffn(x: torch.Tensor, pair: _Pair, precision: str) -> torch.Tensor:
    """The FFN's products through torch (under CPU autocast for bf16), for a probe."""
    from mt.fast.precision import autocast

    with torch.inference_mode(), autocast("cpu", precision):
        linear = torch.nn.functional.linear
        return linear(torch.relu(linear(x, pair.w1.weight)), pair.w2.weight)


class _Pair(nn.Module):
    """Two weights shaped as an FFN's (w1: (d_ff, d), w2: (d, d_ff)), no biases: a probe's."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(1, 1), nn.Linear(1, 1)
        self.w1.weight, self.w1.bias = nn.Parameter(w1, requires_grad=False), None
        self.w2.weight, self.w2.bias = nn.Parameter(w2, requires_grad=False), None
