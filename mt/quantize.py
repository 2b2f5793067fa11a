"""Int8 dynamic quantization of a Transformer for fast CPU decoding (``decode.quantize=int8``).

Every ``nn.Linear`` (attention projections, FFN) and the tied pre-softmax projection become
dynamically quantized int8 matrix products: weights int8 per output channel, activations
quantized per call from their observed range, accumulation in int32, output in float32
(``torch.ao.quantization.quantize_dynamic``; fbgemm/oneDNN kernels with VNNI where the CPU has
it). Embeddings, LayerNorm, softmax and attention stay in float32. The original model is left
unchanged; the int8 copy is for decoding only (its ``decode_head`` replaces ``project``).
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

QUANTIZE_CHOICES = ("none", "int8")

# model -> (parameter versions when quantized, int8 copy): re-quantized when weights change.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 dynamically quantized copy of ``model`` for decoding.

    Args:
        model: an ``mt.model.Transformer`` (anything with ``nn.Linear`` layers works; a model
            with ``output_weight`` and ``decode_head`` also gets an int8 output projection).

    Returns:
        A new module in eval mode; ``model`` is not modified.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    was_training = model.training
    head = None
    if hasattr(model, "decode_head") and hasattr(model, "output_weight"):
        weight = model.output_weight.detach()  # (V_padded, D), tied to the target embedding
        head = nn.Linear(weight.size(1), weight.size(0), bias=False)
        head.weight = nn.Parameter(weight.clone(), requires_grad=False)
        model.decode_head = head  # quantize_dynamic copies it with the rest
    try:
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
            warnings.simplefilter("ignore")
            qmodel = quantize_dynamic(
                model.eval(), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
            )
    finally:
        if head is not None:
            model.decode_head = None
        model.train(was_training)
    return qmodel.eval()


def _versions(model: nn.Module) -> tuple[int, ...]:
    """In-place updates bump a tensor's version: a changed tuple means changed weights."""
    return tuple(p._version for p in model.parameters())


def for_decoding(model: nn.Module, quantize: str = "none") -> nn.Module:
    """The model to decode with for ``decode.quantize`` (``none``: ``model`` itself).

    The int8 copy is cached per model and rebuilt when the model's weights have changed (a
    model validated during training), so repeated calls cost nothing.

    Raises:
        ValueError: for an unknown ``quantize`` setting.
    """
    if quantize == "none":
        return model
    if quantize != "int8":
        raise ValueError(f"decode.quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    versions = _versions(model)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == versions:
        return hit[1]
    qmodel = quantize_int8(model)
    _CACHE[model] = (versions, qmodel)
    log.info("decoding with an int8 dynamically quantized copy of the model")
    return qmodel


__all__ = ["QUANTIZE_CHOICES", "for_decoding", "quantize_int8"]
