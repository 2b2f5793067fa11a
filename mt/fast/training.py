"""What the training step runs: :func:`for_training` wraps a model in a :class:`TrainingModel`
(its forward pass and the loss), on a CPU over a copy with faster kernels.

The CPU training copy (``train.cpu_kernels``, :func:`training_copy`) shares the model's
parameters (the optimiser, checkpoints and validation see one model) and computes its math with
float32 products on oneDNN where a probe measures them faster, 16-bit products over few row
counts (``mt.fast.onednn``), 16-bit dropout masks (``mt.fast.dropout``), attention written out
(``mt.fast.attention``), the position-wise products on the real positions only
(``mt.fast.packing``), and the projection and the loss in row blocks
(``mt.fast.loss.projected_cross_entropy``): the (n, V) logits and their gradient, fresh memory
from the kernel every step, are never allocated; glibc keeps freed memory for the next step
(``mt.fast.memory``). On a GPU the model itself runs, its projection and loss in row blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mt.fast.probe as probe
from mt.device import gpu_attention
from mt.fast.attention import CPUTrainingAttention
from mt.fast.dropout import Dropout
from mt.fast.loss import label_smoothed_cross_entropy, projected_block_rows, projected_cross_entropy
from mt.fast.master import MasterWeights
from mt.fast.memory import hold_freed_memory
from mt.fast.modules import replace_modules, shared_copy
from mt.fast.onednn import (
    BucketedLinear,
    Linear,
    bucket_rows,
    bucketed_linear,
    linear,
    onednn_available,
    size_kernel_cache,
)
from mt.fast.packing import InFlight, pack
from mt.fast.precision import apply_fp32_math, layer_step, projection_step
from mt.model.attention import ScaledDotProduct
from mt.model.masks import RealPositions
from mt.model.transformer import Transformer

log = logging.getLogger(__name__)


class TrainingModel(nn.Module):
    """A Transformer (or its CPU training copy) and its training loss: what the update step
    calls, as it would call the model (``forward`` and ``loss`` have the model's signatures).

    ``blockwise``: the projection and the loss in row blocks (:func:`projected_cross_entropy`,
    through ``product``, ``(x, w, bias) -> x w^T (+ bias)``); else the logits, then the fused
    loss. ``in_flight``: where the packed products find each batch's real rows
    (``mt.fast.packing.pack``). ``master``: with ``train.master_weights``, the float32
    parameters that ``model`` (a 16-bit working copy) follows (``mt.fast.master``).
    """

    def __init__(
        self,
        model: Transformer,
        blockwise: bool = False,
        product: Callable = F.linear,
        in_flight: InFlight | None = None,
        master: MasterWeights | None = None,
    ) -> None:
        super().__init__()
        self.model, self.blockwise, self.product = model, blockwise, product
        self.in_flight, self.master = in_flight, master
        self.bucket = row_buckets(product)  # the loss's blocks come at those row counts

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        real: RealPositions | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """The model's teacher-forced pass (``Transformer.forward``)."""
        if self.in_flight is not None:
            self.in_flight.set(src, tgt_in, real)
        return self.model(src, tgt_in, real, project)

    def loss(
        self, h: torch.Tensor, target: torch.Tensor, smoothing: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Transformer.loss``, fast: summed (label-smoothed loss, NLL) of decoder outputs h
        (n, D) against target (n,)."""
        m = self.model
        if self.blockwise:
            return projected_cross_entropy(
                h, m.output_weight, target, smoothing, m.vocab_size, self.product,
                bucket=self.bucket,
            )  # fmt: skip
        return label_smoothed_cross_entropy(m.project(h), target, smoothing, None)


def row_buckets(product: Callable) -> Callable[[int], int] | None:
    """The row counts ``product`` pads its input to (oneDNN's products: ``bucket_rows``), or
    None where it takes any count (torch's ``F.linear``)."""
    return bucket_rows if product in (linear, bucketed_linear) else None


def training_copy(model: Transformer, products: bool = True, bucketed: bool = False) -> Transformer:
    """A copy of ``model`` for the training passes on a CPU (module docstring), sharing its
    parameters and buffers: 16-bit dropout masks, attention written out, and float32 products
    on oneDNN (``products``, where this torch has it) or products over bucketed row counts
    (``bucketed``, for autocast's 16-bit ones)."""
    products = products and onednn_available()
    clone = shared_copy(model)

    def rule(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Dropout:
            return Dropout(child.p)
        if isinstance(child, ScaledDotProduct):
            return CPUTrainingAttention()
        if products and type(child) is nn.Linear:
            return Linear(child)
        if bucketed and type(child) is nn.Linear:
            return BucketedLinear(child)
        return None

    replace_modules(clone, rule)
    log.info(
        "CPU training kernels: attention written out, 16-bit dropout masks, loss in row "
        "blocks%s", ", float32 products on oneDNN" if products else
        ", products over bucketed row counts" if bucketed else "",
    )  # fmt: skip
    return clone


def for_training(
    model: Transformer,
    device: torch.device,
    cpu_kernels: bool = True,
    precision: str = "fp32",
    compiled: bool = False,
    tokens: int = 2048,
    cache_dir: str | Path | None = None,
    master_weights: bool = False,
    activation_checkpointing: bool = False,
) -> TrainingModel:
    """What the training step runs (``mt.train`` and ``make bench``); ``model`` is never
    modified.

    On a CPU with ``train.cpu_kernels``: a :func:`training_copy`, its float32 products on
    oneDNN where that measures faster at ``tokens`` per batch (:func:`onednn_products`,
    :func:`onednn_projection`). On a GPU the model with the projection and the loss in blocks,
    its attention off cuDNN's kernel (:func:`gpu_attention`). Elsewhere, and for a
    ``compiled`` step on a CPU, the model with the fused loss over its logits: Inductor cannot
    compile the copy (oneDNN's training products want frozen weights, the 16-bit dropout masks'
    in-place ``random_`` breaks the graph). ``master_weights`` (16-bit ``precision``): all of
    that on a 16-bit working copy following ``model`` (``mt.fast.master``), without autocast.
    ``activation_checkpointing``: see :func:`checkpointed`.
    """
    step = _for_training(model, device, cpu_kernels, precision, compiled, tokens, cache_dir,
                         master_weights)  # fmt: skip
    return checkpointed(step) if activation_checkpointing else step


def checkpointed(step: TrainingModel) -> TrainingModel:
    """``step`` with its model's layers under activation checkpointing (``mt.fast.recompute``),
    on a copy sharing the parameters unless the model is the step's own CPU training copy."""
    from mt.fast.recompute import checkpoint_layers

    model = step.model
    if step.in_flight is None:  # not the CPU training copy: the caller's model or master's copy
        model = shared_copy(model)
    layers = checkpoint_layers(model, step.in_flight)
    log.info("train.activation_checkpointing: %d layers recompute their activations in the "
             "backward pass", layers)  # fmt: skip
    step.model = model
    return step


def _for_training(
    model: Transformer, device: torch.device, cpu_kernels: bool, precision: str, compiled: bool,
    tokens: int, cache_dir: str | Path | None, master_weights: bool,
) -> TrainingModel:  # fmt: skip
    """:func:`for_training` without activation checkpointing."""
    master = None
    if master_weights and precision != "fp32":
        master = MasterWeights(model, precision)
        model = master.model
        log.info("train.master_weights: the passes run on a %s copy, Adam on float32 masters",
                 precision)  # fmt: skip
    elif master_weights:
        log.info("train.master_weights: nothing to do in fp32")
    if device.type == "cuda":  # the projection and the loss in blocks of thousands of rows
        gpu_attention(device)
        return TrainingModel(model, blockwise=True, master=master)
    if device.type != "cpu" or not cpu_kernels:
        return TrainingModel(model, master=master)
    if compiled:  # Inductor compiles the model as written, not the copy's kernels (see above)
        log.info("train.compile=true on a CPU: the model as written, Inductor's own kernels "
                 "(not train.cpu_kernels' copy)")  # fmt: skip
        return TrainingModel(model, master=master)
    hold_freed_memory()
    # Before the first product (the probes' below), unless the precision probe sized it already
    size_kernel_cache(tokens, model.cfg.d_model, model.cfg.d_ff, model.vocab_size, device)
    if precision == "fp32":
        apply_fp32_math(device)  # bf32 where the precision probe chose it
    products = precision == "fp32" and onednn_products(model, device, tokens, cache_dir)
    bucketed = precision != "fp32"  # 16-bit products run on oneDNN: few row counts
    copy = training_copy(model, products=products, bucketed=bucketed)
    product = linear if products else (bucketed_linear if bucketed else F.linear)
    in_flight = pack(copy, row_buckets(product))
    projection = product
    if precision == "fp32":  # the loss's projection is probed apart: other shapes, other winner
        projection = linear if onednn_projection(model, device, cache_dir) else F.linear
    return TrainingModel(
        copy, blockwise=True, product=projection, in_flight=in_flight, master=master
    )


def onednn_products(
    model: Transformer, device: torch.device, tokens: int, cache_dir: str | Path | None = None
) -> bool:
    """Whether oneDNN's float32 products train faster than torch's (MKL's) here, probed on a
    layer's products forward and backward at batches of up to ``tokens`` rows
    (:func:`mt.fast.precision.layer_step`). Which wins depends on the CPU: oneDNN reaches much
    more of an AVX-512 CPU's float32 peak, and loses in training on some AVX2 CPUs; a product
    at exactly ``tokens`` rows alone can tie where training does not (docs/performance.md)."""
    if not onednn_available():
        return False
    d, f = model.cfg.d_model, model.cfg.d_ff

    def make(candidate: str, rows: int):
        return layer_step("fp32", rows, d, f, device, linear if candidate == "onednn" else F.linear)

    choice = probe.choose("train.products", device, f"layer {tokens}x{d}x{f}", make,
                          ["torch", "onednn"], tokens, min(tokens, 128), cache_dir)  # fmt: skip
    return choice == "onednn"


def onednn_projection(
    model: Transformer, device: torch.device, cache_dir: str | Path | None = None
) -> bool:
    """Whether oneDNN's float32 products run the blockwise loss's projection faster than
    torch's here, probed on a block's scores ``x W^T`` and input gradient ``G W``
    (:func:`mt.fast.precision.projection_step`). Its shapes (V outputs, thousands) are not the
    layers', so the library that loses the layers' probe can win this one (docs/performance.md)."""
    if not onednn_available():
        return False
    d, vocab = model.cfg.d_model, model.vocab_size
    rows = projected_block_rows(vocab, device, bucket_rows)

    def make(candidate: str, n: int):
        return projection_step(n, d, vocab, device, linear if candidate == "onednn" else F.linear)

    choice = probe.choose("train.projection", device, f"projection {rows}x{d}x{vocab}", make,
                          ["torch", "onednn"], rows, min(rows, 128), cache_dir)  # fmt: skip
    return choice == "onednn"
