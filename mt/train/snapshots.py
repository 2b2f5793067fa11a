"""Snapshots of a training run: what its checkpoints hold and when they are written
(``last.pt``, the periodic ones, the average of the last N, the moving average of the weights),
and how a resumed run takes its state back (with ``train.reset``'s parts afresh and changed
settings applied)."""

from __future__ import annotations

import logging
from typing import Any

from mt import distributed
from mt.checkpoint import (
    average_checkpoints,
    link_checkpoint,
    periodic_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
)
from mt.schema import Config
from mt.train.state import (
    OPTIMIZER_KEYS,
    SCHEDULE_KEYS,
    TrainState,
    better,
    changed_settings,
    training_state,
)
from mt.train.tracking import resident_fields
from mt.train.update import adam_settings
from mt.train.validation import validate

log = logging.getLogger(__name__)


def save(run, periodic: bool) -> None:
    """``last.pt`` (full state, all ranks take part) and optionally ``checkpoint_<step>.pt``.

    A periodic checkpoint holds the full training state too (any of them can resume the run
    when ``last.pt`` is unreadable): a hard link to ``last.pt``, not a second write.
    """
    ckpt = checkpoint_of(run, full=True)
    if run.info.is_main:
        last = run.ckpt_dir / "last.pt"
        save_checkpoint(last, ckpt)
        if periodic:
            link_checkpoint(last, run.ckpt_dir / f"checkpoint_{run.state.step}.pt")
            rotate_checkpoints(run.ckpt_dir, run.cfg.train.keep_last)
        log.info("saved checkpoints at step %d", run.state.step)
    distributed.barrier()


def average_into_best(run) -> None:
    """Average the last N periodic checkpoints into averaged.pt; it becomes best.pt when it
    validates at least as well as the best single checkpoint (the paper always uses it).

    Called once training is over (``last.pt`` holds the trained state): the average is summed
    in the run's own model, one checkpoint at a time, which is left holding it. A second model
    and two checkpoints mapped at once would raise the process's peak well above training's at
    the very end of a run; this way the heap in use after averaging is the same as before it
    (docs/performance.md).
    """
    paths = periodic_checkpoints(run.ckpt_dir)[-run.cfg.train.average_last :]
    if len(paths) < 2:
        log.warning("average_last: only %d periodic checkpoint(s), nothing to average", len(paths))
        return
    avg = average_checkpoints(paths, into=run.raw_model.state_dict())
    save_checkpoint(run.ckpt_dir / "averaged.pt", avg)
    _validate_into_best(run, avg, "avg_", {"averaged": len(paths)},
                        f"average of {len(paths)} checkpoints")  # fmt: skip


def ema_into_best(run) -> None:
    """Validate the moving average of the weights (``train.ema``), write it to ema.pt, and
    make it best.pt when it validates at least as well as the best so far (the best single
    checkpoint, or the average of the last N when that won). Called once training is over,
    after :func:`average_into_best`; the run's own model is left holding the average."""
    run.ema.copy_to(run.raw_model.parameters())
    ckpt = checkpoint_of(run, full=False)
    ckpt.update(ema_decay=run.ema.decay, ema_updates=run.ema.updates)
    save_checkpoint(run.ckpt_dir / "ema.pt", ckpt)
    _validate_into_best(run, ckpt, "ema_", {"ema_decay": run.ema.decay},
                        f"moving average of the weights (decay {run.ema.decay:g})")  # fmt: skip


def _validate_into_best(run, ckpt: dict, prefix: str, record: dict, what: str) -> None:
    """Validate the weights the run's model holds now (those of ``ckpt``), as every
    checkpoint was (the same loss path, the same decoding); record the figures (keys with
    ``prefix``, plus ``record``) and log them; ``ckpt`` becomes best.pt, and its value the bar
    for what follows, when it validates at least as well as the best so far."""
    result = validate(run.raw_model, run.prepared, run.cfg, run.info.device,
                      loss_model=run.training_model)  # fmt: skip
    value, best = result[run.key], run.state.best
    use = best is None or value == best or better(run.key, value, best)
    run.metrics.write({"step": run.state.step, **record, **resident_fields(),
                       **{f"{prefix}{k}": v for k, v in result.items()}})  # fmt: skip
    log.info("%s: %s %.4g%s", what, run.key, value, " -> best.pt" if use else "")
    if use:
        ckpt.update(best=value, best_metric=run.key)
        save_checkpoint(run.ckpt_dir / "best.pt", ckpt)
        run.state.best = value


def checkpoint_of(run, full: bool) -> dict[str, Any]:
    """The checkpoint dict of ``run`` now (``full``: with the training state; every rank)."""
    update = run.update
    return training_state(
        run.raw_model, run.prepared, run.cfg, run.state,
        update.optimizer, update.scheduler, update.scaler, full, run.info.world_size, run.ema,
    )  # fmt: skip


def restore(resume: dict, cfg: Config, resets: list[str], optimizer, scheduler, scaler):
    """The training state of a resumed run, with ``train.reset``'s parts started afresh and
    changed optimiser and schedule settings applied (each change logged, never ignored)."""
    tc, stored = cfg.train, dict(resume.get("train_cfg") or {})
    if "optimizer" in resets:
        log.info("train.reset: optimizer: Adam's moments start afresh")
    else:
        optimizer.load_state_dict(resume["optimizer"])
        for group in optimizer.param_groups:  # the checkpoint's groups hold the old values
            group.update(adam_settings(tc))
        for key, (old, new) in changed_settings(stored, cfg, OPTIMIZER_KEYS).items():
            log.warning("resuming with train.%s %s -> %s: applied", key, old, new)
    if "schedule" in resets:
        log.info("train.reset: schedule: the learning rate starts from its first step")
    else:
        scheduler.load_state_dict(resume["scheduler"])
        for key, (old, new) in changed_settings(stored, cfg, SCHEDULE_KEYS).items():
            log.warning("resuming with train.%s %s -> %s: applied from the next update",
                        key, old, new)  # fmt: skip
    # The schedule's rate now (a reset one's first), not the one the optimiser state stored
    rates = [base * f(scheduler.last_epoch)
             for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]  # fmt: skip
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates
    if resume.get("scaler"):
        scaler.load_state_dict(resume["scaler"])
    state = TrainState(**resume["state"])
    if "meters" in resets:
        log.info("train.reset: meters: best value and patience start afresh")
        state.best, state.best_step, state.bad_evals, state.last_eval_step = None, 0, 0, -1
    if "data" in resets:
        log.info("train.reset: data: a new epoch starts (epoch %d)", state.epoch + 1)
        state.epoch, state.batch = state.epoch + (1 if state.batch else 0), 0
    if resets:  # saved with the state: a resume with the same list does not repeat them
        state.resets = [*state.resets, {"step": state.step, "parts": list(resets)}]
        log.info("train.reset=[%s]: applied at step %d (recorded in the checkpoints)",
                 ",".join(resets), state.step)  # fmt: skip
    return state
