"""``torch.compile`` for training: compiled in the order torch documents for DDP, padded
lengths rounded up so that the compiler sees few shapes, and the count of compiled graphs for
the log."""

from __future__ import annotations

import logging

import torch

from mt.schema import TrainConfig

log = logging.getLogger(__name__)


def pad_multiple(tc: TrainConfig) -> int:
    """What training batches' lengths are padded up to a multiple of: ``train.pad_multiple``,
    or when it is 0, 8 with ``train.compile`` (fewer shapes, fewer recompiles) and 1 without."""
    if tc.pad_multiple < 0:
        raise ValueError(f"train.pad_multiple must be >= 0, got {tc.pad_multiple}")
    return tc.pad_multiple or (8 if tc.compile else 1)


def compile_model(raw: torch.nn.Module, tc: TrainConfig) -> torch.nn.Module:
    """``torch.compile(raw)`` with ``train.compile``, else ``raw``; wrap the result in DDP after.

    That is the order torch documents for DDP ("Where to apply torch.compile?": compile the
    module, then wrap it). Dynamo then compiles inside DDP's forward, sees the DDP module and,
    with ``torch._dynamo.config.optimize_ddp`` (on by default), splits the graph at DDP's
    gradient-bucket boundaries, so each bucket's all-reduce overlaps the rest of the backward.
    ``raw`` itself stays uncompiled: validation and checkpoints use it.
    """
    if not tc.compile:
        return raw
    import torch._dynamo

    if not torch._dynamo.config.optimize_ddp:
        log.warning("torch._dynamo.config.optimize_ddp is off: DDP cannot overlap all-reduces")
    return torch.compile(raw)


def compiled_graphs() -> int:
    """Graphs compiled by Dynamo in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
