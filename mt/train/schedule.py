"""The learning-rate schedule of the paper ("Noam"): linear warm-up, then inverse square root.

    lr(step) = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

The peak is at ``step = warmup``: ``factor * (d_model * warmup)^-0.5``. Setting a peak ``lr``
instead chooses ``factor = lr * (d_model * warmup)^0.5`` so the peak equals ``lr`` exactly.
Steps count updates from 1 (the first update uses ``lr(1)``).

A run with a fixed budget (``train.max_steps`` or ``train.max_minutes``) can end with a
cool-down: over the last fraction ``c`` of the budget the rate is multiplied by a factor that
falls linearly to zero, ``min(1, (1 - progress) / c)``, where ``progress`` in [0, 1] is the
share of the budget spent before the update. Ending at a small rate instead of the Noam tail's
large one gives a markedly better final model for the same budget (the "trapezoidal" or
warm-up/stable/decay schedule; Hägele et al., 2024, "Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The Noam learning rate of update ``step`` (1-based; step 0 is treated as 1)."""
    if warmup <= 0:
        raise ValueError(f"warmup must be positive, got {warmup}")
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def noam_factor(
    d_model: int, warmup: int, factor: float = 1.0, lr: Optional[float] = None
) -> float:
    """The factor to use: ``factor`` itself, or the one whose peak (at ``warmup``) equals ``lr``."""
    return factor if lr is None else lr * (d_model * warmup) ** 0.5


def noam_lambda(
    d_model: int, warmup: int, factor: float = 1.0, lr: Optional[float] = None
) -> Callable[[int], float]:
    """A ``torch.optim.lr_scheduler.LambdaLR`` function (use the optimiser with base lr 1.0).

    LambdaLR evaluates the function at 0 when created and at k after the k-th
    ``scheduler.step()``; the lr in force for update k+1 is therefore ``noam_lr(k + 1)``.
    """
    f = noam_factor(d_model, warmup, factor, lr)

    def lr_lambda(scheduler_step: int) -> float:
        return noam_lr(scheduler_step + 1, d_model, warmup, f)

    return lr_lambda


def cooldown_factor(progress: float, cooldown: float) -> float:
    """The cool-down multiplier after spending ``progress`` (clamped to [0, 1]) of the budget:
    ``min(1, (1 - progress) / cooldown)``, where ``cooldown`` is the final share of the budget
    over which the rate decays to 0 (0: off, the factor is 1)."""
    if not 0.0 <= cooldown <= 1.0:
        raise ValueError(f"train.cooldown must be in [0, 1], got {cooldown}")
    if cooldown == 0.0:
        return 1.0
    progress = min(max(progress, 0.0), 1.0)
    return min(1.0, (1.0 - progress) / cooldown)


def budget_progress(tc, state) -> float:
    """Share of the training budget spent: the larger of steps/max_steps and
    time/max_minutes (0 when neither is set)."""
    shares = [0.0]
    if tc.max_steps > 0:
        shares.append(state.step / tc.max_steps)
    if tc.max_minutes > 0:
        shares.append(state.wall / (tc.max_minutes * 60))
    return min(max(shares), 1.0)


STOPS = {
    "max_steps": "the update budget",
    "max_minutes": "the time cap",
    "max_epochs": "the epoch budget",
    "patience": "patience",
    "signal": "a stop signal",
}


def describe_budget(tc) -> str:
    """The training budget in words, for the log: updates first, time only as a cap."""
    parts = []
    if tc.max_steps > 0:
        parts.append(f"{tc.max_steps:,} updates")
    if tc.max_epochs > 0:
        parts.append(f"{tc.max_epochs} epochs")
    if tc.max_minutes > 0:
        parts.append(f"{tc.max_minutes:g} minutes" + (" (a cap)" if parts else ""))
    text = ", or ".join(parts) + (", whichever comes first" if len(parts) > 1 else "")
    text = text or "no limit"
    if tc.cooldown > 0:
        text += f"; the rate falls to 0 over the last {tc.cooldown:.0%} of it"
    if tc.patience > 0:
        text += f"; stops early after {tc.patience} validations without a better {tc.best_metric}"
    return text
