"""Where a training run stands and what must hold for it to go on: the training state, the
batch plan of an epoch, the compatibility of a checkpoint with the configuration, seeding."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from mt.checkpoint import CheckpointError, model_cfg_from, tokenizer_blobs
from mt.data.batches import BatchSampler
from mt.schema import Config

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint and restored on resume."""

    step: int = 0  # optimiser updates applied
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # index of the next batch within the epoch (exact resume)
    best: Optional[float] = None  # best validation metric so far
    best_step: int = 0
    bad_evals: int = 0  # validations without improvement (patience)
    last_eval_step: int = -1
    wall: float = 0.0  # seconds spent training, over all restarts
    nonfinite: int = 0  # consecutive skipped updates


def data_plan(cfg: Config, world_size: int) -> dict[str, Any]:
    """What decides the order of batches in an epoch (besides the data): a checkpoint's
    position in an epoch (``data.batch``) only means something under the same plan."""
    tc = cfg.train
    max_len = cfg.model.max_positions - 1 if tc.skip_long else None
    return {"world_size": world_size, "max_tokens": tc.max_tokens, "seed": tc.seed,
            "max_len": max_len}  # fmt: skip


def check_data_plan(ckpt: dict, cfg: Config, world_size: int, path: Path) -> None:
    """Refuse to resume in the middle of an epoch under another batch plan.

    The stored batch index counts this rank's batches of the epoch plan that the world size,
    ``train.max_tokens``, the seed and the length limit made; under another plan it would point
    at other pairs (some skipped, some repeated). At an epoch boundary (index 0) any plan is
    fine: the next epoch starts from its beginning.

    Raises:
        CheckpointError: mid-epoch, with a different plan (the message says what differs).
    """
    data = ckpt.get("data", {})
    stored = data.get("plan")
    now = data_plan(cfg, world_size)
    if stored is None or dict(stored) == now:
        return
    diff = {k: (stored.get(k), v) for k, v in now.items() if stored.get(k) != v}
    if int(data.get("batch", 0)) == 0:
        log.info("batch plan changed at an epoch boundary (stored, now): %s", diff)
        return
    names = {"world_size": "number of ranks (torchrun --nproc_per_node x nodes)",
             "max_tokens": "train.max_tokens", "seed": "train.seed",
             "max_len": "model.max_positions / train.skip_long"}  # fmt: skip
    shown = "; ".join(f"{names[k]}: {a} in the checkpoint, {b} now" for k, (a, b) in diff.items())
    raise CheckpointError(
        f"{path} stopped in the middle of epoch {data.get('epoch')} (batch {data.get('batch')}) "
        f"under another batch plan ({shown}). Resuming would skip or repeat pairs: resume with "
        "the original settings (they may change at the next epoch boundary), or start a new run "
        "from these weights with train.init_from"
    )


def train_sampler(split, cfg: Config, rank: int = 0, world_size: int = 1) -> BatchSampler:
    """The training batches of ``split`` for this rank: ``train.max_tokens``, the run's seed, and
    pairs beyond the positional range skipped when ``train.skip_long``."""
    tc = cfg.train
    return BatchSampler(
        split.src.lengths,
        split.tgt.lengths,
        tc.max_tokens,
        seed=tc.seed,
        rank=rank,
        world_size=world_size,
        max_len=cfg.model.max_positions - 1 if tc.skip_long else None,
    )


def check_compatible(
    ckpt: dict, cfg: Config, vocab_size: int, path: Path, tokenizer_bytes: list[bytes] | None = None
) -> None:
    """Raise CheckpointError unless ``ckpt``'s model fits ``cfg.model`` and the vocabulary.

    With ``tokenizer_bytes`` (the prepared data's SentencePiece model(s)), the checkpoint's
    embedded model(s) must be byte-identical: the same vocabulary size with other pieces would
    silently give every embedding row a different meaning.
    """
    if int(ckpt["vocab_size"]) != vocab_size:
        raise CheckpointError(
            f"{path} has a vocabulary of {ckpt['vocab_size']}, the prepared data {vocab_size}"
        )
    if tokenizer_bytes is not None and tokenizer_blobs(ckpt) != list(tokenizer_bytes):
        raise CheckpointError(
            f"{path} was trained with a different SentencePiece model than the prepared data "
            f"(same vocabulary size {vocab_size}, other pieces): its embeddings would map to "
            f"the wrong pieces. Prepare the data with tokenizer.reuse={path} to encode it with "
            f"the checkpoint's own model"
        )
    stored = model_cfg_from(ckpt)
    shape = ("N", "N_dec", "d_model", "d_ff", "h", "norm", "share_embeddings")
    diff = {k: (getattr(stored, k), getattr(cfg.model, k)) for k in shape
            if getattr(stored, k) != getattr(cfg.model, k)}  # fmt: skip
    if diff:
        raise CheckpointError(f"{path} holds a different model shape (stored, config): {diff}")
    if dataclasses.asdict(stored) != dataclasses.asdict(cfg.model):
        log.info("model settings differ from %s (dropout etc.): using the configuration", path)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
