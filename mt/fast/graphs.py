"""The whole step of a shape-bucketed batch compiled, and on CUDA replayed as CUDA graphs.

With ``train.shape_buckets`` every batch has one of K shapes (``mt.data.buckets``), so a CUDA
graph of each is captured once and replayed (``reduce-overhead`` mode, cudagraph trees).
:class:`BucketStep` is the forward pass and the loss over every position, pads weighted 0 (a
selection of the real positions would change the shapes with every batch); the optimizer is
torch's fused Adam, taking the finite check's ``found_inf`` on the device. :class:`ShapeRouter`
sends any other shape through a plain compiled step, so it captures no graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mt.device import autocast
from mt.vocab import PAD

log = logging.getLogger(__name__)


def masked_smoothed_loss(
    h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, eps: float, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (label-smoothed loss, NLL) of ``h weight[:vocab]^T`` over the rows whose target
    is not PAD, in float32, at a fixed shape: every row is scored, a pad row's terms multiplied
    by 0 (its gradient exactly 0). The sums of ``mt.model.loss.label_smoothed_nll_loss``, in
    plain operators so that Inductor fuses the log-softmax and its reductions."""
    logits = F.linear(h, weight[:vocab]).float()  # (N, V)
    lp = torch.log_softmax(logits, dim=-1)
    keep = (target != PAD).to(lp.dtype)
    nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1) * keep
    smooth = -lp.sum(dim=-1) * keep
    eps_i = eps / (vocab - 1) if vocab > 1 else 0.0
    nll_sum = nll.sum()
    return (1.0 - eps - eps_i) * nll_sum + eps_i * smooth.sum(), nll_sum.detach()


class BucketStep(nn.Module):
    """The forward pass and loss of a ``mt.fast.TrainingModel`` for a fixed-shape batch:
    ``(src, tgt_in, tgt_out, eps) -> (loss_sum, nll_sum)`` over the real target positions."""

    def __init__(self, training: nn.Module) -> None:
        super().__init__()
        self.training_model = training
        self.master = getattr(training, "master", None)

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.training_model.model
        h = self.training_model(src, tgt_in, None, project=False)  # (B, T, D), key mask on
        h = h.reshape(-1, h.size(-1))
        return masked_smoothed_loss(
            h, model.output_weight, tgt_out.reshape(-1), eps, model.vocab_size
        )


def step_mode(device_type: str, buckets: int) -> str:
    """torch.compile's mode for the bucketed step: ``reduce-overhead`` (CUDA graphs) on CUDA
    with shape buckets; ``default`` elsewhere (without buckets every batch would capture its
    own graph)."""
    return "reduce-overhead" if device_type == "cuda" and buckets > 0 else "default"


class ShapeRouter(nn.Module):
    """Calls ``fixed`` (on CUDA replayed as CUDA graphs) for a batch of one of ``shapes``
    ((sentences, source width, target width) triples) and ``plain`` (compiled, no graphs) for
    any other, so a shape outside the set grows no graph pool. With ``graphs`` each call starts
    a new cudagraph-trees step: the last replay's outputs were read before it (the update adds
    them to its sums at once)."""

    def __init__(
        self, step: nn.Module, shapes: Iterable[tuple[int, int, int]], fixed: Callable,
        plain: Callable, graphs: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.step = step
        self.master = getattr(step, "master", None)
        self.shapes = {((b, s), (b, t)) for b, s, t in shapes}
        # not submodules: the parameters are step's, registered once
        self.__dict__["_fixed"], self.__dict__["_plain"] = fixed, plain
        self.graphs = graphs
        self.calls = {"fixed": 0, "plain": 0}

    def forward(self, src, tgt_in, tgt_out, eps):
        shape = (tuple(src.shape), tuple(tgt_in.shape))
        which = "fixed" if shape in self.shapes else "plain"
        self.calls[which] += 1
        if which == "fixed":
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            return self._fixed(src, tgt_in, tgt_out, eps)
        if self.calls["plain"] == 1:
            log.warning(
                "a batch of shape %s outside the shape buckets: a plain compiled step for it "
                "(no CUDA graph)", shape,
            )  # fmt: skip
        return self._plain(src, tgt_in, tgt_out, eps)


def bucket_loss(model, batch, eps: float, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The update's ``loss_fn`` (``mt.train.update.Updater``) for a :class:`ShapeRouter` model
    (possibly DDP-wrapped, run inside DDP's forward so its all-reduce hooks are armed): summed
    (loss, NLL) of one batch, weight 0 for fillers."""
    with autocast(batch.src.device, precision):
        loss, nll = model(batch.src, batch.tgt_in, batch.tgt_out, float(eps))
    return loss * batch.weight, nll * batch.weight


def graph_memory_gb(device: torch.device) -> dict[str, float]:
    """CUDA memory now and at its peak (GiB; the graphs' pools are part of ``reserved``). Empty
    on a CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    gib = 2.0**30
    return {
        "reserved_gb": stats.get("reserved_bytes.all.current", 0) / gib,
        "reserved_peak_gb": stats.get("reserved_bytes.all.peak", 0) / gib,
        "allocated_peak_gb": stats.get("allocated_bytes.all.peak", 0) / gib,
    }
