"""Decoding copies of a Transformer: the fastest correct kernels for CPU decoding.

``for_decoding(model, quantize, precision, onednn)`` returns what search should run:

* ``onednn`` (default; CPU only): every ``nn.Linear`` and the tied pre-softmax projection run
  through oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``, the kernel
  ``torch.compile`` picks on CPU), with the FFN's ReLU fused into it. In fp32 the weights are
  shared with the model, not copied, and the products stay float32 (accumulated in float32, only
  the summation order differs). ``nn.Linear`` runs on MKL's sgemm, which reaches half of the
  CPU's float32 peak on AMD processors; oneDNN reaches about 85% there.
* ``precision=bf16`` (CPU): the same, with bfloat16 copies of the weights made once: inputs go
  to bfloat16 for the product and the result comes back in float32, so LayerNorm, attention,
  the softmax and the residual stream stay float32 (what CPU autocast computes, without casting
  every weight at every step). Where oneDNN has no bfloat16 kernels (CPUs without AVX-512),
  the model itself runs under bf16 autocast instead.
* ``quantize=int8``: every ``nn.Linear`` and the projection become dynamically quantized int8
  products (weights int8 per output channel, activations quantized per call from their
  observed range, int32 accumulation, float32 output; ``torch.ao.quantization.quantize_dynamic``
  with fbgemm's VNNI kernels). Embeddings, LayerNorm, softmax and attention stay float32.

* attention (CPU; :class:`CPUDecodingKernels`): short queries through the written-out formula,
  float32 attention and cache under bf16 autocast. They reach the model's attention layers
  through its decoder cache and ``encode``; the paper's attention (``mt.model.attention``) stays
  free of
  device rules.

Search runs a :class:`DecodingModel`: the copy, its output projection and the kernels, behind
the contract search depends on (``mt.decode.search.IncrementalDecoder``).

The original model is never modified (no attribute is set on it). Copies are cached per model
and rebuilt when its weights change (in-place updates bump a tensor's version; ``.to()`` moves
them), so validation during training decodes with the current weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from mt.model.attention import SDPA, Kernels
from mt.model.kv_cache import DecoderCache

log = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8")

# model -> {kind: (weights' identity when built, copy)}.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear kernel and it agrees with ``F.linear`` here."""
    if not torch.backends.mkldnn.is_available():
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return False
    try:
        x, w, b = torch.randn(3, 2, 16), torch.randn(8, 16), torch.randn(8)
        y = op(x, w, b, "relu", [], "")
        return bool(torch.allclose(y, torch.relu(F.linear(x, w, b)), atol=1e-5))
    except RuntimeError:  # a build whose oneDNN lacks the op's kernels
        return False


@cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN has bfloat16 linear kernels on this CPU: AVX-512 and newer. On AVX2 CPUs
    (e.g. AMD Zen 3) it has none, and ``precision=bf16`` decodes under plain autocast instead."""
    if not onednn_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None and not check():
        return False
    try:
        x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return True
    except RuntimeError:  # "could not create a primitive descriptor"
        return False


class OneDNNLinear(nn.Module):
    """``y = act(x W^T + b)`` through oneDNN, for inference (no autograd).

    Args:
        weight: (out, in); kept as given (fp32: shared with the model) or as a bfloat16 copy.
        bias: (out,) or None.
        dtype: the dtype of the product (float32 or bfloat16); inputs are cast to it and the
            output is cast back to the input's dtype.
        relu: apply ReLU inside the kernel (the FFN's first layer).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
        relu: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(dtype), persistent=False)
        b = None if bias is None else bias.detach().to(dtype)
        self.register_buffer("bias", b, persistent=False)
        self.attr = "relu" if relu else "none"

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out) in the weight's dtype."""
        return torch.ops.mkldnn._linear_pointwise(
            x.to(self.weight.dtype), self.weight, self.bias, self.attr, [], ""
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out), in ``x``'s dtype."""
        return self.product(x).to(x.dtype)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, dtype={self.weight.dtype}, attr={self.attr}"


class _FusedFeedForward(nn.Module):
    """FFN(x) = W2 relu(W1 x + b1) + b2 with the ReLU inside the first oneDNN product."""

    def __init__(self, ffn: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = OneDNNLinear(ffn.w1.weight, ffn.w1.bias, dtype, relu=True)
        self.w2 = OneDNNLinear(ffn.w2.weight, ffn.w2.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D); the hidden layer stays in the product's dtype."""
        return self.w2.product(self.w1.product(x)).to(x.dtype)


def onednn_copy(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, nn.Module | None]:
    """A copy of ``model`` whose Linear layers run through oneDNN, and a oneDNN projection.

    Parameters and buffers are shared with ``model`` (not copied); with ``dtype=bfloat16`` the
    Linear and projection weights are bfloat16 copies.

    Args:
        model: an ``mt.model.transformer.Transformer`` (any module with ``nn.Linear`` layers works).
        dtype: float32 or bfloat16.

    Returns:
        ``(copy, head)``: the copy in eval mode, for decoding only, and the pre-softmax
        projection as a oneDNN product (None for a model without ``output_weight``).
    """
    from mt.model.transformer import FeedForward, Transformer

    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo=shared).eval()
    for parent in list(clone.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FeedForward):
                setattr(parent, name, _FusedFeedForward(child, dtype))
            elif type(child) is nn.Linear:
                setattr(parent, name, OneDNNLinear(child.weight, child.bias, dtype))
    head = None
    if isinstance(clone, Transformer):
        head = OneDNNLinear(clone.output_weight, None, dtype)
    return clone, head


def quantize_int8(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """An int8 dynamically quantized copy of ``model`` and of its projection, for decoding.

    Args:
        model: an ``mt.model.transformer.Transformer`` (anything with ``nn.Linear`` layers works).

    Returns:
        ``(copy, head)`` in eval mode: the quantized model and the int8 pre-softmax projection
        (None for a model without ``output_weight``); ``model`` is not modified.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from mt.model.transformer import Transformer

    was_training = model.training
    parts = nn.ModuleDict({"model": model})
    if isinstance(model, Transformer):
        weight = model.output_weight.detach()  # (V_padded, D), tied to the target embedding
        head = nn.Linear(weight.size(1), weight.size(0), bias=False)
        head.weight = nn.Parameter(weight.clone(), requires_grad=False)
        parts["head"] = head
    try:
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
            warnings.simplefilter("ignore")
            quantized = quantize_dynamic(
                parts.eval(), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
            )
    finally:
        model.train(was_training)
    qhead = quantized["head"].eval() if "head" in quantized else None
    return quantized["model"].eval(), qhead


def _identity(model: nn.Module) -> tuple:
    """Changes when the weights change: in place (version bump) or by moving (new storage)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _kind(model: nn.Module, quantize: str, precision: str, onednn: bool) -> str | None:
    """Which decoding copy ``for_decoding`` builds, or None for the model itself."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"decode.quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"decode.precision must be fp32 or bf16, got {precision!r}")
    if quantize == "int8":
        return "int8"
    param = next(model.parameters(), None)
    on_cpu = param is not None and param.device.type == "cpu"
    if not (onednn and on_cpu and onednn_available()):
        return None
    if precision == "bf16" and not onednn_bf16_available():
        _warn_emulated_bf16()
        return None  # the model under bf16 autocast
    return f"onednn-{precision}"


@cache
def _warn_emulated_bf16() -> None:
    log.warning(
        "decode.precision=bf16 on a CPU without bfloat16 kernels in oneDNN (no AVX-512): "
        "decoding under plain bf16 autocast, which is slower than fp32 here"
    )


# Query lengths up to this go through explicit matrix products on CPU (see CPUDecodingKernels).
EXPLICIT_MAX_QUERIES = 16


class CPUDecodingKernels(Kernels):
    """Attention rules that make decoding fast on CPU (measured: README, Performance).

    * Short queries (incremental decoding: 1 query per row in self-attention, one per beam in
      encoder-decoder attention; short sources in the encoder) use the explicit
      ``softmax(q k^T) v`` with batched matrix products: 40-70% of the time of SDPA's CPU
      kernel, which is built for long queries. Gradients on (training) keep SDPA.
    * Under bf16 autocast the projections run in bfloat16, but CPU attention with one query per
      row is several times slower in bfloat16 than in float32 (and the cache is small): the
      cache and the attention of incremental decoding stay float32, autocast off inside them.
    """

    def __init__(self, max_queries: int | None = None) -> None:
        self.max_queries = EXPLICIT_MAX_QUERIES if max_queries is None else max_queries

    def explicit(self, q: torch.Tensor) -> bool:
        return q.size(-2) <= self.max_queries and not torch.is_grad_enabled()

    def inputs(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if tensors[0].dtype == torch.float32:
            return tensors
        return tuple(t.float() for t in tensors)

    def scope(self) -> contextlib.AbstractContextManager:
        if torch.is_autocast_enabled("cpu"):
            return torch.autocast("cpu", enabled=False)
        return contextlib.nullcontext()


def kernels_for(device: torch.device | str, fast: bool = True) -> Kernels:
    """The attention kernels for decoding on ``device`` (``fast=False``: torch's defaults)."""
    return CPUDecodingKernels() if fast and torch.device(device).type == "cpu" else SDPA


class DecodingModel(nn.Module):
    """What search runs: a model (or its decoding copy), its output projection and the attention
    kernels for its device, behind the decoding contract (``mt.decode.search.IncrementalDecoder``).

    Args:
        module: an ``mt.model.transformer.Transformer`` or a copy made by :func:`onednn_copy` /
            :func:`quantize_int8` (not modified here).
        head: a replacement for the output projection (None: the module's own).
        kernels: how attention runs while decoding (see :func:`kernels_for`).
    """

    def __init__(self, module: nn.Module, head: nn.Module | None, kernels: Kernels) -> None:
        super().__init__()
        self.module, self.head, self.kernels = module, head, kernels
        self.max_positions: int = module.max_positions
        self.vocab_size: int = module.vocab_size

    def encode(self, src: torch.Tensor):
        """(B, S) source ids -> the module's encoder output."""
        return self.module.encode(src, self.kernels)

    def new_cache(self) -> DecoderCache:
        """An empty incremental state that carries this model's attention kernels."""
        return self.module.new_cache(self.kernels)

    def decode(self, tgt_in: torch.Tensor, enc, cache: DecoderCache | None = None):
        """(B, T) new target ids -> (B, T, V) logits (see ``Transformer.decode``)."""
        return self.module.decode(tgt_in, enc, cache, head=self.head)


def for_decoding(
    model: nn.Module,
    quantize: str = "none",
    precision: str = "fp32",
    onednn: bool = True,
    fast_attention: bool = True,
) -> DecodingModel:
    """The model to decode with for the ``decode.*`` settings (see the module docstring).

    Args:
        model: the trained model (left unchanged).
        quantize: ``decode.quantize``: none | int8.
        precision: ``decode.precision``: fp32 | bf16. On CPU with oneDNN the bf16 copy does its
            own casting (see :func:`needs_autocast`); elsewhere callers autocast.
        onednn: ``decode.onednn``: use oneDNN's kernels on CPU when this torch has them.
        fast_attention: the device's attention rules (:func:`kernels_for`); False: SDPA.

    Returns:
        A :class:`DecodingModel` over ``model`` itself (GPU, or ``onednn=False`` in fp32) or
        over a cached decoding copy.

    Raises:
        ValueError: for an unknown ``quantize`` or ``precision``.
    """
    kind = _kind(model, quantize, precision, onednn)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    kernels = kernels_for(device, fast_attention)
    if kind is None:
        return DecodingModel(model, None, kernels)
    copies = _CACHE.setdefault(model, {})  # the copies never refer to `model` itself
    identity = _identity(model)
    hit = copies.get((kind, fast_attention))
    if hit is not None and hit[0] == identity:
        return hit[1]
    if kind == "int8":
        clone, head = quantize_int8(model)
        log.info("decoding with an int8 dynamically quantized copy of the model")
    else:
        dtype = torch.bfloat16 if kind == "onednn-bf16" else torch.float32
        clone, head = onednn_copy(model, dtype)
    decoder = DecodingModel(clone, head, kernels)
    copies[(kind, fast_attention)] = (identity, decoder)
    return decoder


def needs_autocast(model: nn.Module, quantize: str, precision: str, onednn: bool) -> bool:
    """Whether decoding must run under bf16 autocast (False where the copy casts itself)."""
    return precision == "bf16" and _kind(model, quantize, precision, onednn) != "onednn-bf16"


__all__ = [
    "CPUDecodingKernels",
    "DecodingModel",
    "QUANTIZE_CHOICES",
    "OneDNNLinear",
    "for_decoding",
    "kernels_for",
    "needs_autocast",
    "onednn_available",
    "onednn_bf16_available",
    "onednn_copy",
    "quantize_int8",
]
