"""``torch.compile`` for training: dynamic shapes (one graph for every batch, instead of padding
lengths to multiples), the order torch documents for DDP, and the count of compiled graphs."""

from __future__ import annotations

import logging

import torch
import torch.fx.experimental._config as fx_config

from mt import distributed
from mt.fast.graphs import BucketStep, ShapeRouter, bucket_loss, step_mode
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
    result in DDP after (``raw`` itself stays uncompiled: validation and checkpoints use it).

    Dynamic shapes: batches of every length run one graph. Two recompiles are ruled out: a side
    without padding, passing no key mask (compiled training collates with ``one_graph``,
    ``mt.data.batches.collate``), and Dynamo's "duck sizing", which makes sizes equal at the first
    trace one symbol (off for the process: ``torch.fx.experimental._config.use_duck_shape``). A
    one-sentence batch still makes one more graph (Dynamo specialises sizes 0 and 1). The order
    is torch's for DDP ("Where to apply torch.compile?"): with ``optimize_ddp`` Dynamo splits the
    graph at DDP's gradient buckets, so each bucket's all-reduce overlaps the backward.
    """
    if not tc.compile:
        return raw
    import torch._dynamo

    if not torch._dynamo.config.optimize_ddp:
        log.warning("torch._dynamo.config.optimize_ddp is off: DDP cannot overlap all-reduces")
    fx_config.use_duck_shape = False
    return torch.compile(raw, dynamic=True)


def compiled_graphs() -> int:
    """Graphs compiled by Dynamo in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_step(
    forward: torch.nn.Module, tc: TrainConfig, device: torch.device,
    shapes: list[tuple[int, int, int]] | None = None,
) -> torch.nn.Module:  # fmt: skip
    """What the update calls, before the DDP wrap: with ``train.compile`` and
    ``train.shape_buckets`` the whole step of a bucketed batch compiled (``mt.fast.graphs``),
    on CUDA replayed as one CUDA graph per bucket shape in ``shapes``; otherwise
    :func:`compile_model`. :func:`step_loss` gives the update's loss function for the result.
    The step takes dynamic shapes: one compile for all the buckets, not one per bucket."""
    if not (tc.compile and tc.shape_buckets):
        return compile_model(forward, tc)
    fx_config.use_duck_shape = False  # the plain step's shapes, as compile_model's
    shapes = list(shapes or [])
    step = BucketStep(forward)
    mode = step_mode(device.type, tc.shape_buckets)
    fixed = torch.compile(step, dynamic=True, mode=mode)
    graphs = mode == "reduce-overhead"
    plain = torch.compile(step, dynamic=True) if graphs else fixed  # a CPU: one and the same
    log.info("train.compile with train.shape_buckets: the whole step compiled for %d shapes "
             "(%s)", len(shapes), "CUDA graphs" if graphs else "no CUDA graphs")  # fmt: skip
    return ShapeRouter(step, shapes, fixed, plain, graphs=graphs)


def step_loss(model: torch.nn.Module):
    """The update's ``loss_fn`` for what :func:`compile_step` returned (possibly DDP-wrapped):
    ``mt.fast.graphs.bucket_loss`` for the bucketed step, None (the default) otherwise."""
    return bucket_loss if isinstance(distributed.unwrap(model), ShapeRouter) else None


def fitted_max_tokens(cfg, vocab_size: int, device: torch.device) -> int | None:
    """``train.fit_batch``: on CUDA with ``train.batch_tokens``, the largest per-GPU batch
    (padded tokens) the memory model (``mt.fast.footprint``) fits in this GPU, at most its share
    of the global batch; None elsewhere. The whole bucketed step scores every position at once,
    so its logits, 16-bit and float32, are added to the blockwise step's estimate."""
    tc = cfg.train
    if not (tc.fit_batch and tc.batch_tokens > 0 and device.type == "cuda"):
        return None
    from mt.fast.footprint import estimate_step_gb, fit_tokens

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    whole = tc.compile and tc.shape_buckets > 0

    def estimate(tokens: int) -> float:
        gb = estimate_step_gb(cfg.model, vocab_size, tokens, tc.precision, tc.master_weights,
                              tc.activation_checkpointing)  # fmt: skip
        return gb["total"] + (tokens * vocab_size * 6 / 2**30 if whole else 0.0)

    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    share = max(1024, tc.batch_tokens // world)
    return fit_tokens(estimate, memory, min(1024, share), share)
