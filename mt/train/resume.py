"""Resuming a run directory: which checkpoint, which best value, which configuration.

- :func:`resume_checkpoint`: ``last.pt``, or when it is unreadable the newest readable periodic
  checkpoint (each holds the full training state), with a warning naming both.
- :func:`agree_on_resume`: under several ranks, rank 0 makes that choice and every rank checks
  that it sees the same checkpoint (a run directory that is not one shared directory, or a
  checkpoint rewritten in between, stops every rank with an error instead of a silent split).
- :func:`keep_best_of_best_pt`: a resumed state knows the best validation value as of its own
  step; ``best.pt`` may have been saved later with a better one, which then stays the bar.
- :func:`record_config`: ``config.yaml`` keeps the run's original configuration; a resume with
  other settings writes ``config.resume-<n>.yaml`` and logs each changed key.
- :func:`training_state`: what a checkpoint of the run holds, so that it can be resumed.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from mt import distributed
from mt.checkpoint import (
    CheckpointError,
    load_checkpoint,
    model_state,
    periodic_checkpoints,
    rng_state,
)
from mt.config import to_yaml
from mt.files import write_text
from mt.schema import Config
from mt.train.state import TrainState, data_plan
from mt.train.validation import better, metric_key

log = logging.getLogger(__name__)


def has_checkpoints(ckpt_dir: Path) -> bool:
    return (ckpt_dir / "last.pt").is_file() or bool(periodic_checkpoints(ckpt_dir))


def resume_checkpoint(ckpt_dir: Path) -> tuple[Optional[dict], Optional[Path]]:
    """The training state to resume: ``last.pt``, or when it is unreadable the newest readable
    periodic checkpoint that holds a training state (with a warning naming both).

    Returns:
        ``(checkpoint, path)``, or ``(None, None)`` for a new run.

    Raises:
        CheckpointError: checkpoints exist but none of them can resume the run.
    """
    last = ckpt_dir / "last.pt"
    candidates = ([last] if last.is_file() else []) + periodic_checkpoints(ckpt_dir)[::-1]
    errors = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, require_training=True)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if path != last:
            log.warning(
                "%s: resuming from %s (step %d) instead: %s", last, path.name, ckpt["step"],
                errors[0] if errors else "last.pt is missing",
            )  # fmt: skip
        return ckpt, path
    if candidates:
        raise CheckpointError(
            f"no checkpoint in {ckpt_dir} can resume the run: " + " | ".join(errors)
        )
    return None, None


def agree_on_resume(ckpt_dir: Path, is_main: bool) -> tuple[Optional[dict], Optional[Path]]:
    """:func:`resume_checkpoint` decided by rank 0 and checked by every rank.

    Rank 0 chooses (as in a single process) and broadcasts the file name and step; each other
    rank loads that file from its own ``ckpt_dir`` and checks the step (or, for a new run, that
    it sees no checkpoint either). Every rank learns of any rank's failure.

    Returns:
        ``(checkpoint, path)`` as :func:`resume_checkpoint`, the same on every rank.

    Raises:
        CheckpointError: on the rank that disagrees (its own reason).
        mt.distributed.RankError: on the other ranks, with that reason.
    """
    ckpt, path, error = None, None, None
    if is_main:
        try:
            ckpt, path = resume_checkpoint(ckpt_dir)
        except CheckpointError as err:
            error = err
    distributed.check_all(error, f"choosing the checkpoint to resume in {ckpt_dir}")
    choice = distributed.broadcast_object(None if ckpt is None else (path.name, ckpt["step"]))
    if not is_main:
        try:
            ckpt, path = _load_choice(ckpt_dir, choice)
        except CheckpointError as err:
            error = err
    distributed.check_all(error, f"agreeing with rank 0 on the checkpoint in {ckpt_dir}")
    return ckpt, path


def _load_choice(ckpt_dir: Path, choice) -> tuple[Optional[dict], Optional[Path]]:
    """Load rank 0's choice ``(file name, step)`` (None: a new run) from this rank's view."""
    shared = "run_dir must be one directory that every rank sees (a shared filesystem)"
    if choice is None:
        if has_checkpoints(ckpt_dir):
            raise CheckpointError(
                f"rank 0 starts a new run, but this rank sees checkpoints in {ckpt_dir}: {shared}"
            )
        return None, None
    name, step = choice
    path = ckpt_dir / name
    try:
        ckpt = load_checkpoint(path, require_training=True)
    except CheckpointError as err:
        raise CheckpointError(
            f"rank 0 resumes {name} (step {step}), but this rank cannot read it: {err}. {shared}"
        ) from err
    if ckpt["step"] != step:
        raise CheckpointError(
            f"rank 0 resumes {name} at step {step}, but this rank reads step {ckpt['step']} "
            f"from {path}: {shared}"
        )
    return ckpt, path


def keep_best_of_best_pt(state: TrainState, best_path: Path, key: str) -> None:
    """After a resume, ``state.best`` is as old as the resumed checkpoint; ``best.pt`` may hold
    a better model saved after it. Take that value, so best.pt is only replaced by better."""
    if not best_path.is_file():
        return
    try:
        best = load_checkpoint(best_path)
    except CheckpointError as err:
        log.warning("%s is unreadable (%s); the next validation replaces it", best_path, err)
        return
    value = best.get("best")
    if best.get("best_metric") != key or value is None:
        return
    if better(key, value, state.best):
        log.info("best.pt (step %s) holds %s %.4g, better than the resumed state's %s",
                 best.get("step"), key, value, state.best)  # fmt: skip
        state.best, state.best_step = float(value), int(best.get("step", 0))


def record_config(run_dir: Path, cfg: Config, resuming: bool) -> None:
    """``config.yaml`` holds a run's original configuration. A new run writes it; a resumed
    run keeps it, and when its own configuration differs writes that to
    ``config.resume-<n>.yaml`` and logs each changed key."""
    text = to_yaml(cfg)
    path = run_dir / "config.yaml"
    if not resuming or not path.is_file():
        write_text(path, text)
        return
    original = path.read_bytes().decode("utf-8", errors="replace")
    if original == text:
        return
    n = 1 + sum(1 for _ in run_dir.glob("config.resume-*.yaml"))
    write_text(run_dir / f"config.resume-{n}.yaml", text)
    changes = _changed_keys(original, text)
    log.warning(
        "resuming with a different configuration (kept in config.resume-%d.yaml; config.yaml "
        "keeps the original): %s", n, "; ".join(changes) or "formatting only",
    )  # fmt: skip


def _changed_keys(old: str, new: str) -> list[str]:
    """``key: old -> new`` for each leaf that differs between two YAML configurations."""
    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in (d or {}).items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    try:
        a, b = flat(yaml.safe_load(old)), flat(yaml.safe_load(new))
    except yaml.YAMLError:
        return ["config.yaml is not valid YAML"]
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


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
