"""What the training step runs: :func:`for_training` wraps a model in a :class:`TrainingModel`
(its forward pass and the loss), on a CPU over a copy with faster kernels.

The CPU training copy (``train.cpu_kernels``, :func:`training_copy`) shares the model's
parameters (gradients land on the model's own tensors, so the optimiser, checkpoints and
validation see one model) and computes the model's math with these things done differently:

* **Products through oneDNN** (float32 training without autocast): every ``nn.Linear`` and the
  tied pre-softmax projection compute ``y = x W^T + b`` and the input gradient ``dx = dy W``
  with oneDNN's linear kernel (``mt.fast.onednn``) instead of MKL's sgemm, where a probe at the
  run's shapes measures it faster (:func:`onednn_products`); the loss's projection onto the
  vocabulary is probed on its own (:func:`onednn_projection`).
* **Products over few row counts** in bfloat16 (autocast hands torch's products to oneDNN,
  which builds and keeps a kernel per shape): every ``nn.Linear`` and the projection's row
  blocks pad their rows to one of 16 sizes per doubling (``mt.fast.onednn.bucketed_linear``),
  and oneDNN's kernel caches are sized to hold the kernels of those sizes that a step meets
  (``mt.fast.onednn.size_kernel_cache``, before the first product; the precision probe runs
  under the same).
* **Dropout masks from 16 random bits** per element, kept for the backward pass as booleans,
  drawn, compared and applied in one pass by mt's kernel where it is built
  (``mt.fast.dropout``).
* **Attention written out** with those masks, one autograd function that keeps the weights and
  the bool mask for its backward pass, not the dropped weights and a float mask as well
  (``mt.fast.attention.CPUTrainingAttention``): 5 bytes per query-key pair instead of 12.
* **The position-wise products on the real positions only** of a well-padded batch (the FFNs
  and the attention's projections: ``mt.fast.packing``).
* **The projection and the loss in row blocks** (``mt.fast.loss.projected_cross_entropy``):
  the (n, V) logits and their gradient, 112 MB each in float32 for a 3,500-token batch at
  V = 8000, are never allocated. On a CPU each such allocation is fresh memory from the kernel
  every step (above glibc's largest mmap threshold), 55,000 page faults a step for the two,
  and its passes run from DRAM instead of the cache.

Training on a CPU also calls ``mt.fast.memory.hold_freed_memory`` (glibc keeps freed memory for
the next step instead of handing it back to the kernel and faulting it in again).

On a GPU the model itself runs, its projection and loss in row blocks of ~512 MB of scores;
with ``train.cpu_kernels=false`` the model itself with the fused loss over its logits.
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
from mt.fast.attention import CPUTrainingAttention, install
from mt.fast.dropout import Dropout
from mt.fast.loss import (
    label_smoothed_cross_entropy,
    projected_block_rows,
    projected_cross_entropy,
)
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
from mt.model.masks import RealPositions
from mt.model.transformer import Transformer

log = logging.getLogger(__name__)


class TrainingModel(nn.Module):
    """A Transformer (or its CPU training copy) and its training loss: what the update step
    calls, as it would call the model (``forward`` and ``loss`` have the model's signatures).

    Args:
        model: the Transformer the passes run through.
        blockwise: the projection and the loss in row blocks (:func:`projected_cross_entropy`);
            False: the logits, then the fused loss (:func:`label_smoothed_cross_entropy`).
        product: ``(x, w, bias) -> x w^T (+ bias)`` for the blockwise projection.
        in_flight: where the model's packed FFNs find the real rows of each batch
            (``mt.fast.packing.pack``); None: nothing is packed.
        master: with ``train.master_weights``, the float32 parameters that ``model`` (a 16-bit
            working copy) follows (``mt.fast.master``); the update step moves values and
            gradients between them. None: ``model``'s parameters are the model's own.
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
    """A copy of ``model`` for the training passes on a CPU (see the module docstring): its
    dropouts draw 16-bit masks, its attention is written out and (``products``, when this torch
    has oneDNN's kernel) its float32 products run on oneDNN, or (``bucketed``, for autocast's
    16-bit products) its products see bucketed row counts.

    Parameters and buffers are the model's own (shared, not copied), so the copy's state dict
    equals the model's and an optimiser over ``model.parameters()`` updates both.

    Returns:
        The copy, in the model's training mode.
    """
    products = products and onednn_available()
    clone = shared_copy(model)

    def rule(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Dropout:
            return Dropout(child.p)
        if products and type(child) is nn.Linear:
            return Linear(child)
        if bucketed and type(child) is nn.Linear:
            return BucketedLinear(child)
        return None

    replace_modules(clone, rule)
    install(clone, CPUTrainingAttention)
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
    """What the training step runs (``mt.train`` and ``make bench``).

    On a CPU with ``train.cpu_kernels``, unless the step is ``compiled``:
    :func:`hold_freed_memory` and a :func:`training_copy`, its loss in row blocks and its
    position-wise products packed on well-padded batches. Its float32 products run on oneDNN
    where that measures faster than torch's own at the run's shapes (:func:`onednn_products`:
    ``tokens`` per batch; the loss's projection apart, :func:`onednn_projection`); bf16 and
    fp16 keep autocast's, over bucketed row counts (:func:`mt.fast.onednn.bucketed_linear`).
    On a GPU the model itself with the projection and the loss in blocks of thousands of rows
    (the logits of a 25k-token batch never exist whole), its attention off cuDNN's kernel
    (:func:`gpu_attention`); elsewhere, and for a ``compiled`` step on a CPU, the model with the
    fused loss over its logits: Inductor cannot compile the copy (oneDNN's training products
    want frozen weights, the 16-bit dropout masks' in-place ``random_`` breaks the graph).
    With ``master_weights`` and a 16-bit ``precision`` all of that runs on a 16-bit working
    copy of ``model`` whose parameters follow ``model``'s (``mt.fast.master``), without
    autocast. ``activation_checkpointing``: every encoder and decoder layer of what the step
    runs recomputes its activations in the backward pass (:func:`checkpointed`). ``model`` is
    never modified.
    """
    step = _for_training(model, device, cpu_kernels, precision, compiled, tokens, cache_dir,
                         master_weights)  # fmt: skip
    return checkpointed(step) if activation_checkpointing else step


def checkpointed(step: TrainingModel) -> TrainingModel:
    """``step`` with its model's layers under activation checkpointing
    (``mt.fast.recompute``): the CPU training copy in place (it is the step's own), any
    other model through a copy sharing its parameters, so the caller's model stays as it is."""
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
    """Whether oneDNN's float32 products train faster than torch's (MKL's) here: measured on a
    layer's products forward and backward at batches of up to ``tokens`` rows
    (:func:`mt.fast.precision.layer_step`; ``mt.fast.probe``, cached). Which library wins
    depends on the CPU: oneDNN reaches much more of an AVX-512 CPU's float32 peak than MKL, and
    is the slower one in training on some AVX2 CPUs. The probe times batches of several row
    counts up to ``tokens``, forward and backward, because a product at exactly ``tokens`` rows
    alone can tie where training does not (docs/performance.md)."""
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
    torch's here: measured on a block's scores ``x W^T`` and input gradient ``G W`` at the
    loss's block rows (:func:`mt.fast.precision.projection_step`; ``mt.fast.probe``, cached).
    Its shapes are not the layers' (V outputs, thousands, against the layers' hundreds), so
    the library that loses the layers' probe can win this one, and the step is then faster
    with each product on its own winner (docs/performance.md)."""
    if not onednn_available():
        return False
    d, vocab = model.cfg.d_model, model.vocab_size
    rows = projected_block_rows(vocab, device, bucket_rows)

    def make(candidate: str, n: int):
        return projection_step(n, d, vocab, device, linear if candidate == "onednn" else F.linear)

    choice = probe.choose("train.projection", device, f"projection {rows}x{d}x{vocab}", make,
                          ["torch", "onednn"], rows, min(rows, 128), cache_dir)  # fmt: skip
    return choice == "onednn"
