"""Validation of a model during training: loss and NLL per target token, greedy BLEU, and
which of them decides ``best.pt`` and patience."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from mt.batching import BatchSampler, iterate_batches
from mt.schema import Config
from mt.update import batch_loss


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
