"""int8 decoding: every ``nn.Linear`` and the tied pre-softmax projection as dynamically
quantized int8 products (weights int8 per output channel, activations quantized per call from
their observed range, int32 accumulation, float32 output; ``torch.ao.quantization``'s
``quantize_dynamic`` with fbgemm's VNNI kernels). Embeddings, LayerNorm, softmax and attention
stay float32."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def quantize_int8(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """An int8 dynamically quantized copy of ``model`` and of its projection, for decoding.

    Args:
        model: an ``mt.model.transformer.Transformer`` (``output_weight``: the projection).

    Returns:
        ``(copy, head)`` in eval mode: the quantized model and the int8 pre-softmax projection
        (all ``padded_vocab`` rows); ``model`` is not modified.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    was_training = model.training
    weight = model.output_weight.detach()  # (V_padded, D), tied to the target embedding
    head = nn.Linear(weight.size(1), weight.size(0), bias=False, device="meta")  # no draw
    head.weight = nn.Parameter(weight.clone(), requires_grad=False)
    parts = nn.ModuleDict({"model": model, "head": head})
    try:
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
            warnings.simplefilter("ignore")
            quantized = quantize_dynamic(
                parts.eval(), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
            )
    finally:
        model.train(was_training)
    return quantized["model"].eval(), quantized["head"].eval()
