"""The pieces of a training run: one optimiser update, validation, metrics, training state.

:mod:`mt.train` strings these together into the recipe (setup -> train -> save -> cleanup).
Everything here works the same in one process and under DDP: the loss of an update is
normalised by the number of target tokens of the WHOLE update (all accumulation steps, all
ranks), so 2 ranks x ``max_tokens`` and 1 rank x 2 accumulation steps compute the same gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from mt import distributed
from mt.batching import Batch, BatchSampler, iterate_batches
from mt.checkpoint import CheckpointError, model_cfg_from, model_state, rng_state, tokenizer_blobs
from mt.files import JsonlAppender
from mt.loss import label_smoothed_cross_entropy
from mt.schema import Config
from mt.vocab import PAD

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates with a non-finite loss or gradient."""


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


@dataclass
class UpdateResult:
    """One update's figures, reduced over accumulation steps and ranks."""

    loss: float  # label-smoothed loss per target token
    nll: float  # negative log-likelihood per target token
    ntokens: int  # target tokens of the update (all ranks)
    gnorm: float  # gradient norm before clipping


def autocast(device: torch.device, precision: str):
    """The autocast context for ``precision`` (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise ValueError(f"train.precision must be fp32, bf16 or fp16, got {precision!r}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def batch_loss(
    model: torch.nn.Module, batch: Batch, eps: float, precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (label-smoothed loss, NLL) of one batch, in float32 (weight 0 for fillers).

    Only the non-pad target positions are projected and scored."""
    keep = batch.tgt_out != PAD
    with autocast(batch.src.device, precision):
        logits = model(batch.src, batch.tgt_in, keep)  # (n, V)
    loss, nll = label_smoothed_cross_entropy(logits, batch.tgt_out[keep], eps, None)
    return loss * batch.weight, nll * batch.weight


def build_optimizer(params, tc, device: torch.device) -> torch.optim.Optimizer:
    """Adam with the paper's betas and eps, at base rate 1.0 (the LambdaLR schedule gives the
    rate itself); the fused single-kernel implementation on CPU and CUDA (on a CPU it is
    ~6x faster than the per-tensor loop: 21 vs 132 ms per step for the base model)."""
    return torch.optim.Adam(
        params,
        lr=1.0,
        betas=(tc.beta1, tc.beta2),
        eps=tc.eps,
        weight_decay=tc.weight_decay,
        fused=device.type in ("cpu", "cuda") or None,
    )


class Updater:
    """Applies one optimiser update from a group of batches (gradient accumulation + DDP).

    Args:
        model: what to call (possibly DDP-wrapped and/or compiled).
        params: the parameters to clip and check.
        optimizer, scheduler, scaler: the optimisation state.
        cfg: the whole configuration (train.* settings are used).
        world_size: number of DDP ranks.
        loss_fn: ``(model, batch, eps, precision) -> (loss_sum, nll_sum)``, default
            :func:`batch_loss` (the benchmark swaps in a textbook one for its baseline).
    """

    def __init__(
        self, model, params, optimizer, scheduler, scaler, cfg: Config, world_size: int,
        loss_fn=None,
    ):  # fmt: skip
        self.model = model
        self.loss_fn = loss_fn or batch_loss
        self.params = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.tc = cfg.train
        self.world_size = world_size

    def __call__(self, batches: list[Batch], state: TrainState) -> Optional[UpdateResult]:
        """Forward/backward every batch, then step; None when the update was skipped."""
        device = batches[0].src.device
        local_tokens = sum(b.ntokens * b.weight for b in batches)
        ntok = distributed.all_reduce_sum(
            torch.tensor([local_tokens], dtype=torch.float64, device=device)
        )
        total_tokens = max(float(ntok.item()), 1.0)
        # DDP averages gradients over ranks; scaling by W / tokens gives sum-over-ranks / tokens.
        scale = self.world_size / total_tokens
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            with distributed.no_sync(self.model, skip=i < len(batches) - 1):
                loss, nll = self.loss_fn(
                    self.model, batch, self.tc.label_smoothing, self.tc.precision
                )
                self.scaler.scale(loss * scale).backward()
            sums += torch.stack([loss.detach(), nll.detach()]).double()
        distributed.all_reduce_sum(sums)
        loss_sum, nll_sum = sums.tolist()

        self.scaler.unscale_(self.optimizer)
        if self.tc.clip_norm > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.tc.clip_norm)
        else:
            gnorm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.params if p.grad is not None]
            )
        gnorm = float(gnorm)
        fp16 = self.tc.precision == "fp16"
        if not (math.isfinite(loss_sum) and math.isfinite(gnorm)):
            if fp16:
                self.scaler.update()  # the dynamic loss scale backs off
            self.optimizer.zero_grad(set_to_none=True)
            if fp16 and math.isfinite(loss_sum):
                log.info("fp16 gradient overflow: update skipped, loss scale lowered")
                return None
            state.nonfinite += 1
            log.warning(
                "non-finite %s at update %d: update skipped (%d consecutive)",
                "loss" if not math.isfinite(loss_sum) else "gradient",
                state.step + 1,
                state.nonfinite,
            )
            if state.nonfinite >= self.tc.max_nonfinite:
                raise NonFiniteError(
                    f"{state.nonfinite} consecutive updates had a non-finite loss or gradient "
                    f"(train.max_nonfinite={self.tc.max_nonfinite}); stopping. Try a lower "
                    "learning rate (train.lr / train.factor), train.clip_norm, or precision=fp32."
                )
            return None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        state.nonfinite = 0
        return UpdateResult(
            loss_sum / total_tokens, nll_sum / total_tokens, int(total_tokens), gnorm
        )


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


@torch.no_grad()
def valid_loss(
    model: torch.nn.Module, split, cfg: Config, device: torch.device
) -> tuple[float, float]:
    """Label-smoothed loss and NLL per target token over a whole split (one process)."""
    was_training = model.training
    model.eval()
    sampler = BatchSampler(
        split.src.lengths,
        split.tgt.lengths,
        cfg.train.max_tokens,
        seed=0,
        max_len=cfg.model.max_positions - 1,
    )
    loss = nll = 0.0
    ntok = 0
    for batch in iterate_batches(split, sampler, 0):
        batch = batch.to(device)
        lsum, nsum = batch_loss(model, batch, cfg.train.label_smoothing, cfg.train.precision)
        loss += float(lsum)
        nll += float(nsum)
        ntok += int(batch.ntokens)
    model.train(was_training)
    if ntok == 0:  # a loss of 0.0 would become "best"
        raise ValueError(
            "the validation split has no target tokens (empty, or every pair too long for "
            "model.max_positions): check data.splits.valid"
        )
    return loss / ntok, nll / ntok


@torch.no_grad()
def valid_bleu(model: torch.nn.Module, prepared, cfg: Config, device: torch.device) -> float:
    """Greedy-decode the valid sources and score them: the code path of final evaluation."""
    from mt.decoding import translate_ids
    from mt.evaluate import score

    split = prepared.split("valid")
    n = len(split)
    if cfg.train.eval_max_sentences > 0:
        n = min(n, cfg.train.eval_max_sentences)
    src_ids = [split.src[i].tolist() for i in range(n)]
    greedy = dataclasses.replace(cfg.decode, beam_size=1, nbest=1)
    was_training = model.training
    model.eval()
    hyp_ids = translate_ids(model, src_ids, greedy, device)
    model.train(was_training)
    hyps = prepared.tokenizer.decode(hyp_ids, side="tgt")
    return float(score(hyps, prepared.references("valid")[:n])["bleu"])


def validate(model: torch.nn.Module, prepared, cfg: Config, device: torch.device) -> dict:
    """Valid loss, NLL and (with train.eval_bleu) greedy BLEU of ``model``, in this process."""
    loss, nll = valid_loss(model, prepared.split("valid"), cfg, device)
    out = {"valid_loss": loss, "valid_nll": nll, "valid_ppl": math.exp(min(nll, 50.0))}
    if cfg.train.eval_bleu:
        out["valid_bleu"] = valid_bleu(model, prepared, cfg, device)
    return out


def metric_key(cfg: Config) -> str:
    """The validation record key that decides best.pt and patience."""
    if cfg.train.best_metric not in ("bleu", "loss"):
        raise ValueError(f"train.best_metric must be bleu or loss, got {cfg.train.best_metric!r}")
    if cfg.train.best_metric == "bleu" and cfg.train.eval_bleu:
        return "valid_bleu"
    return "valid_loss"


def better(key: str, new: float, old: Optional[float]) -> bool:
    """Is ``new`` an improvement on ``old`` (higher BLEU or lower loss)?"""
    if old is None:
        return True
    return new > old if key == "valid_bleu" else new < old


def training_state(
    raw_model, prepared, cfg: Config, state: TrainState, optimizer, scheduler, scaler, full: bool,
    world_size: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """A checkpoint dict: the self-describing model part, plus training state when ``full``.

    With ``full`` every rank must call this (the RNG states of all ranks are gathered).
    """
    ckpt = model_state(raw_model, cfg.model, prepared.tokenizer, prepared.vocab_size)
    ckpt.update(step=state.step, epoch=state.epoch, best=state.best, best_metric=metric_key(cfg))
    if full:
        ckpt.update(
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(),
            scaler=scaler.state_dict(),
            rng=distributed.all_gather_object(rng_state()),
            data={"epoch": state.epoch, "batch": state.batch, "plan": data_plan(cfg, world_size)},
            train_cfg=dataclasses.asdict(cfg.train),
            state=dataclasses.asdict(state),
        )
    return ckpt


class MetricsLog:
    """``metrics.jsonl`` (one flushed line per record, appended) and TensorBoard, rank 0 only.

    Args:
        run_dir: the run directory.
        resume_step: records from the first one with a larger step on are cut off (they were
            written after the checkpoint being resumed, and will be written again).
        enabled: False on ranks other than 0.
    """

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        self.file: Optional[JsonlAppender] = None
        self.tb = None
        if not enabled:
            return
        # Appended, never rewritten: a torn last line and the records after the resumed step
        # are cut off with one truncate.
        self.file = JsonlAppender(run_dir / "metrics.jsonl", keep_through_step=resume_step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)
        except Exception as e:  # tensorboard missing or broken: JSONL is enough
            log.info("TensorBoard disabled (%s)", e)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; scalars also go to TensorBoard under their key."""
        if not self.enabled:
            return
        self.file.write(record)
        if self.tb is not None and "step" in record:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


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
