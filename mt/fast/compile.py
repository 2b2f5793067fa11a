"""``torch.compile`` for training: dynamic shapes (one graph for every batch, instead of padding
lengths to multiples, which added positions and a key mask to nearly every batch), the order
torch documents for DDP, and the count of compiled graphs for the log."""

from __future__ import annotations

import logging

import torch

from mt.schema import TrainConfig

log = logging.getLogger(__name__)


def pad_multiple(tc: TrainConfig) -> int:
    """What training batches' lengths are padded up to a multiple of: ``train.pad_multiple``
    (0 or 1: no padding beyond the longest sentence; compiled steps take dynamic shapes)."""
    if tc.pad_multiple < 0:
        raise ValueError(f"train.pad_multiple must be >= 0, got {tc.pad_multiple}")
    return max(1, tc.pad_multiple)


def compile_model(raw: torch.nn.Module, tc: TrainConfig) -> torch.nn.Module:
    """``torch.compile(raw, dynamic=True)`` with ``train.compile``, else ``raw``; wrap the
    result in DDP after.

    Dynamic shapes: batch and sequence lengths are symbols in one graph, so batches of every
    length run it without a recompile. Two things would still compile again, each as long as
    the first compile and in the middle of training, and are ruled out:
    - a side without padding, for which a batch would pass no key mask or no selection of the
      real rows: compiled training collates with ``one_graph`` (``mt.data.batches.collate``);
    - sizes equal by chance: Dynamo's "duck sizing" gives sizes equal at the first trace one
      symbol (a first batch with as many real source as target tokens, say) and compiles again
      when a later batch has them differ; turned off here
      (``torch.fx.experimental._config.use_duck_shape``, for the whole process).
    A batch of one sentence still makes one more graph (Dynamo specialises sizes 0 and 1).

    The order is the one torch documents for DDP ("Where to apply torch.compile?": compile the
    inner module, then wrap it). Dynamo then compiles inside DDP's forward, sees the DDP module
    and, with ``torch._dynamo.config.optimize_ddp`` (on by default), splits the graph at DDP's
    gradient-bucket boundaries, so each bucket's all-reduce overlaps the rest of the backward.
    ``raw`` itself stays uncompiled: validation and checkpoints use it.
    """
    if not tc.compile:
        return raw
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    if not torch._dynamo.config.optimize_ddp:
        log.warning("torch._dynamo.config.optimize_ddp is off: DDP cannot overlap all-reduces")
    fx_config.use_duck_shape = False
    return torch.compile(raw, dynamic=True)


def compiled_graphs() -> int:
    """Graphs compiled by Dynamo in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
