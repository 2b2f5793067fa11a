"""Validation of a model during training: loss and NLL per target token, BLEU (and chrF when it
decides) of greedy or beam search (``train.valid_beam``), and which of them decides ``best.pt``
and patience."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from mt import distributed
from mt.data.batches import BatchSampler, iterate_batches
from mt.schema import Config, DecodeConfig
from mt.train.state import HIGHER_IS_BETTER
from mt.train.update import batch_loss


@torch.no_grad()
def valid_loss(
    model: torch.nn.Module, split, cfg: Config, device: torch.device, rank: int = 0,
    world_size: int = 1,
) -> tuple[float, float]:  # fmt: skip
    """Label-smoothed loss and NLL per target token over a whole split.

    With ``world_size`` > 1 every rank must call this: each scores its share of the batches
    (the training plan's sharding, zero-weight fillers included) and the sums are added over
    ranks, so every rank returns the single-process values.
    """
    was_training = model.training
    model.eval()
    sampler = BatchSampler(
        split.src.lengths,
        split.tgt.lengths,
        cfg.train.max_tokens,
        seed=0,
        rank=rank,
        world_size=world_size,
        max_len=cfg.model.max_positions - 1,
    )
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, NLL (read once, below)
    ntok = 0.0
    for batch in iterate_batches(split, sampler, 0):
        batch = batch.to(device)
        lsum, nsum = batch_loss(model, batch, cfg.train.label_smoothing, cfg.train.precision)
        sums += torch.stack([lsum, nsum]).double()
        ntok += batch.ntokens * batch.weight
    model.train(was_training)
    totals = torch.cat([sums, sums.new_tensor([ntok])])
    if world_size > 1:
        distributed.all_reduce_sum(totals)
    loss, nll, ntok = totals.tolist()
    if ntok == 0:  # a loss of 0.0 would become "best"
        raise ValueError(
            "the validation split has no target tokens (empty, or every pair too long for "
            "model.max_positions): check data.splits.valid"
        )
    return loss / ntok, nll / ntok


@torch.no_grad()
def valid_hypotheses(
    model: torch.nn.Module, prepared, cfg: Config, device: torch.device, rank: int = 0,
    world_size: int = 1,
) -> list[str]:  # fmt: skip
    """Translations of the valid sources (the first ``train.eval_max_sentences``) by
    :func:`validation_search`'s search, in order. With ``world_size`` > 1 every rank must call
    this: rank r decodes sentences r, r + W, ... and the translations are gathered, so every
    rank returns all of them."""
    from mt.decode.driver import translate_ids

    split = prepared.split("valid")
    chosen = [i for _, r in valid_ranges(prepared, cfg) for i in r]
    n = len(chosen)
    src_ids = [split.src[i].tolist() for i in chosen[rank::world_size]]
    # One batch at a time on all threads: batches side by side (decode.workers) validate faster,
    # but each worker's thread holds its freed memory in an arena of its own (this process
    # keeps freed memory, mt.fast.memory), and a training run then ends with much more of it
    # resident (glibc; docs/performance.md).
    search = dataclasses.replace(validation_search(cfg), workers=1)
    was_training = model.training
    model.eval()
    hyp_ids = translate_ids(model, src_ids, search, device) if src_ids else []
    model.train(was_training)
    if world_size == 1:
        return prepared.tokenizer.decode(hyp_ids, side="tgt")
    shards = distributed.all_gather_object(hyp_ids)  # rank r's: sentences r, r + W, ...
    ordered = [shards[i % world_size][i // world_size] for i in range(n)]
    return prepared.tokenizer.decode(ordered, side="tgt")


def valid_ranges(prepared, cfg: Config) -> list[tuple[str, range]]:
    """The valid pairs validation decodes, as ``(direction, range)``: the first
    ``train.eval_max_sentences`` (0: all) of the split, or of each direction of data prepared
    with ``data.directions`` (direction ``""`` for one direction)."""
    cap = cfg.train.eval_max_sentences
    ranges = prepared.directions("valid") or [("", range(len(prepared.split("valid"))))]
    return [(name, r[:cap] if cap > 0 else r) for name, r in ranges]


def validation_search(cfg: Config) -> DecodeConfig:
    """The search validation decodes with: greedy (``train.valid_beam`` null, the default), or
    ``train.valid_beam`` beams with the test's ``decode.*`` settings; one hypothesis per
    sentence, never sampled (the choice of a checkpoint must not depend on a draw)."""
    beam = cfg.train.valid_beam
    if beam is not None and beam < 1:
        raise ValueError(f"train.valid_beam must be a beam size >= 1 or null, got {beam}")
    return dataclasses.replace(cfg.decode, beam_size=beam or 1, nbest=1, sample=False)


def describe_search(cfg: Config) -> str:
    """:func:`validation_search` in words, for the log and the report: ``greedy`` or
    ``beam 5 (alpha 0.6, max length 1 x source + 50)``."""
    search = validation_search(cfg)
    if search.beam_size <= 1:
        return "greedy"
    return (f"beam {search.beam_size} (alpha {search.alpha:g}, max length "
            f"{search.max_len_a:g} x source + {search.max_len_b})")  # fmt: skip


def describe_selection(cfg: Config, key: str) -> str:
    """Which validation value chooses ``best.pt`` and counts patience, and how it is made:
    ``valid_chrf (higher is better) of beam 5 (...) search`` or ``valid_loss (lower is
    better)``."""
    order = "higher" if key in HIGHER_IS_BETTER else "lower"
    if key == "valid_loss":
        return f"{key} ({order} is better)"
    return f"{key} ({order} is better) of {describe_search(cfg)} search"


def valid_scores(
    model: torch.nn.Module, prepared, cfg: Config, device: torch.device, rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:  # fmt: skip
    """``{"valid_<metric>": score}`` of the valid sources decoded by :func:`validation_search`,
    scored as final evaluation scores, on the model as written (shared over ranks as
    :func:`valid_hypotheses`; every rank scores the gathered set): BLEU, and chrF too where
    it chooses ``best.pt`` (``train.best_metric=chrf``). With ``data.directions`` each
    direction is scored on its own (``valid_bleu_de-en``) and ``valid_bleu`` is their mean,
    so that every direction counts alike in the choice of ``best.pt``."""
    from mt.evaluation.metrics import direction_scores

    metrics = ["bleu", "chrf"] if cfg.train.best_metric == "chrf" else ["bleu"]
    hyps = valid_hypotheses(model, prepared, cfg, device, rank, world_size)
    chosen = valid_ranges(prepared, cfg)
    all_refs = prepared.references("valid")
    refs = [all_refs[i] for _, r in chosen for i in r]
    bounds = list(itertools.accumulate((len(r) for _, r in chosen), initial=0))
    positions = [(name, range(a, b)) for (name, _), a, b in zip(chosen, bounds, bounds[1:])]
    kwargs = {"metrics": metrics, "bleu_tokenize": cfg.eval.bleu_tokenize}
    per = direction_scores(hyps, refs, positions, **kwargs)
    out = {}
    for metric in metrics:
        values = [float(scores[metric]) for scores in per.values()]
        out[f"valid_{metric}"] = sum(values) / len(values)
        if "" not in per:  # data.directions
            out.update({f"valid_{metric}_{name}": float(s[metric]) for name, s in per.items()})
    return out


def validate(
    model: torch.nn.Module, prepared, cfg: Config, device: torch.device, rank: int = 0,
    world_size: int = 1, loss_model: torch.nn.Module | None = None,
) -> dict:  # fmt: skip
    """Valid loss, NLL and (with train.eval_bleu) BLEU of ``model`` (:func:`valid_scores`:
    chrF too where it chooses ``best.pt``), decoded by :func:`validation_search`.

    ``loss_model`` computes the loss (training passes its step's ``mt.fast.TrainingModel`` over
    ``model``'s parameters; None: ``model``). ``world_size`` > 1: every rank calls this with its
    ``rank``; the work is shared and every rank returns the values a single process computes.
    """
    split = prepared.split("valid")
    loss, nll = valid_loss(loss_model or model, split, cfg, device, rank, world_size)
    out = {"valid_loss": loss, "valid_nll": nll, "valid_ppl": math.exp(min(nll, 50.0))}
    if cfg.train.eval_bleu:
        out.update(valid_scores(model, prepared, cfg, device, rank, world_size))
    return out
