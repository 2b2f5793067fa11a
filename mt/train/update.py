"""One optimiser update: forward/backward over a group of batches, clip, step.

Works the same in one process and under DDP: the loss of an update is normalised by the number
of target tokens of the WHOLE update (all accumulation steps, all ranks), so 2 ranks x
``max_tokens`` and 1 rank x 2 accumulation steps compute the same gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from mt import distributed
from mt.data.batches import Batch
from mt.device import autocast
from mt.schema import Config
from mt.train.state import TrainState

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates with a non-finite loss or gradient."""


class LossScaleError(NonFiniteError, FloatingPointError):
    """fp16: the dynamic loss scale fell below ``train.min_loss_scale`` (fairseq's
    ``--min-loss-scale`` stops with a FloatingPointError too)."""


# fp16: consecutive gradient overflows from which each one is logged as a WARNING (INFO
# before). Nine halvings take GradScaler's initial scale, 2^16, to fairseq's, 2^7, where fairseq
# starts every fp16 run: a longer streak is more than the calibration of a run's start.
OVERFLOW_WARNING = 10


@dataclass
class UpdateResult:
    """One update's figures, reduced over accumulation steps and ranks, left on the device.

    Reading them waits for the device to finish the update, so the training loop reads them
    only when it logs (every ``train.log_every`` updates); each property here is such a read.
    """

    figures: torch.Tensor  # (4,) float64: loss, NLL per target token, target tokens, gnorm

    @property
    def loss(self) -> float:  # label-smoothed, per target token
        return float(self.figures[0])

    @property
    def nll(self) -> float:  # per target token
        return float(self.figures[1])

    @property
    def ntokens(self) -> int:  # target tokens of the update, all ranks
        return int(self.figures[2])

    @property
    def gnorm(self) -> float:  # before clipping
        return float(self.figures[3])


def batch_loss(
    model: torch.nn.Module, batch: Batch, eps: float, precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (label-smoothed loss, NLL) of one batch, in float32 (weight 0 for fillers).

    Only the non-pad target positions are projected and scored (``model.loss``: the
    Transformer's own, or ``mt.fast.TrainingModel``'s), selected by the indices ``collate``
    found on the host, so nothing here reads the device."""
    target = batch.tgt_out.reshape(-1)  # (B*T,)
    if batch.real.tgt is not None:
        target = target.index_select(0, batch.real.tgt)  # (n,)
    with autocast(batch.src.device, precision):
        h = model(batch.src, batch.tgt_in, batch.real, project=False)  # (n, D)
        # The projection and the loss outside DDP's and torch.compile's wrappers: the loss
        # loops over row blocks, which a compiled graph would have to specialise on n.
        loss, nll = distributed.unwrap(model).loss(h, target, eps)
    return loss * batch.weight, nll * batch.weight


def adam_settings(tc) -> dict:
    """``train``'s Adam settings as Adam's param groups hold them (built and resumed alike)."""
    return dict(
        betas=(tc.beta1, tc.beta2),
        eps=tc.eps,
        weight_decay=tc.weight_decay,
        decoupled_weight_decay=tc.decoupled_weight_decay,
    )


def build_optimizer(params, tc, device: torch.device) -> torch.optim.Optimizer:
    """Adam with the paper's betas and eps (weight decay decoupled or L2, ``train``'s choice),
    at base rate 1.0 (the LambdaLR schedule gives the rate itself); the fused single-kernel
    implementation on CPU and CUDA (one pass over all parameters instead of a loop of small
    operations per tensor, which dominates a CPU step of the larger models)."""
    return torch.optim.Adam(
        params, lr=1.0, fused=device.type in ("cpu", "cuda") or None, **adam_settings(tc)
    )


class Updater:
    """Applies one optimiser update from a group of batches (gradient accumulation + DDP).

    ``model`` is what to call (possibly DDP-wrapped and/or compiled), ``params`` what to clip
    and check. ``loss_fn``: ``(model, batch, eps, precision) -> (loss_sum, nll_sum)``, default
    :func:`batch_loss` (the benchmark swaps in a textbook one for its baseline).
    """

    def __init__(
        self, model, params, optimizer, scheduler, scaler, cfg: Config, world_size: int,
        loss_fn=None, defer_check: Optional[bool] = None,
    ):  # fmt: skip
        self.model = model
        self.loss_fn = loss_fn or batch_loss
        self.params = list(params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.tc = cfg.train
        self.world_size = world_size
        # Whether the finite check stays on the device (see __call__); None: on a GPU, where
        # a read of the device would stall the queue of kernels.
        self.defer_check = defer_check
        self._streak: Optional[torch.Tensor] = None  # consecutive skipped updates (device)
        self._skipped: Optional[torch.Tensor] = None  # skipped updates in all (device)
        self._reported = 0  # of those, how many the log has told
        self.overflows = 0  # fp16: consecutive gradient overflows (skipped, scale lowered)
        if self.tc.precision == "fp16" and not self.tc.min_loss_scale > 0:
            raise ValueError(
                f"train.min_loss_scale must be > 0 with fp16, got {self.tc.min_loss_scale}"
            )
        # train.master_weights: the passes run on a 16-bit working copy of ``params``
        self.master = getattr(distributed.unwrap(model), "master", None)

    def __call__(self, batches: list[Batch], state: TrainState) -> Optional[UpdateResult]:
        """Forward/backward every batch, then step; None when the update was skipped.

        Nothing here waits for the device. Whether the loss and the gradient norm are finite
        decides between step and skip: on a GPU the decision stays on the device (the fused
        Adam's ``found_inf``, as torch's GradScaler passes it: a non-finite update leaves
        weights and moments as they were, the schedule still moves on) and is read when the
        training loop logs (:meth:`check`); on a CPU, where a read costs nothing, and with
        fp16's loss scale, it is read here (:func:`_all_finite`) and the update is skipped
        whole (None).

        No collective runs before the backward passes: the loss of a batch is scaled by a
        constant every rank shares, ``c = 1 / (batches x max_tokens)`` (it keeps the gradients
        at a mean loss's magnitude), and the update's target tokens ride in the one all-reduce
        of the figures after them, from which the gradients are rescaled on the device to
        ``sum over ranks / tokens`` (fairseq's order: normalise after the all-reduce).
        """
        device = batches[0].src.device
        c = 1.0 / (len(batches) * max(self.tc.max_tokens, 1))  # the same on every rank
        local_tokens = float(sum(b.ntokens * b.weight for b in batches))  # from the host
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, NLL, tokens
        self.optimizer.zero_grad(set_to_none=True)
        autocast = self.tc.precision
        if self.master is not None:  # the working copy takes the master weights' values
            self.master.pull()
            autocast = "fp32"  # it is 16-bit itself: no autocast
        for i, batch in enumerate(batches):
            with distributed.no_sync(self.model, skip=i < len(batches) - 1):
                loss, nll = self.loss_fn(self.model, batch, self.tc.label_smoothing, autocast)
                self.scaler.scale(loss * c).backward()
            sums[:2] += torch.stack([loss.detach(), nll.detach()]).double()
        if self.master is not None:  # the master weights take its gradients, as float32
            self.master.push_grads()
        sums[2].fill_(local_tokens)  # a fill kernel: assigning a float copies from the host
        distributed.all_reduce_sum(sums)  # the update's figures over all ranks
        total = sums[2:].clamp_min(1.0)  # (1,) target tokens of the update, all ranks
        grads = [p.grad for p in self.params if p.grad is not None]
        # DDP averaged c * (sum of losses) over the ranks: x W / (c x tokens) gives sum / tokens.
        torch._foreach_mul_(grads, (self.world_size / (c * total)).to(torch.float32).squeeze(0))

        self.scaler.unscale_(self.optimizer)
        if self.tc.clip_norm > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.tc.clip_norm)
        else:
            gnorm = torch.nn.utils.get_total_norm(grads)
        figures = torch.cat([sums[:2] / total, total, gnorm.detach().double().reshape(1)])
        if self._deferred(device):
            return self._step_on_device(figures)
        if not _all_finite(torch.isfinite(figures).all()):
            return self._skip(state, loss_finite=bool(torch.isfinite(figures[0])))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        state.nonfinite = 0
        self.overflows = 0
        return UpdateResult(figures)

    def _deferred(self, device: torch.device) -> bool:
        if self.defer_check is None:
            self.defer_check = device.type == "cuda"
        return (
            self.defer_check
            and self.tc.precision != "fp16"
            and getattr(self.optimizer, "_step_supports_amp_scaling", False)  # fused Adam
        )

    def _step_on_device(self, figures: torch.Tensor) -> UpdateResult:
        """Step unless ``figures`` hold a non-finite value, decided on the device."""
        bad = (~torch.isfinite(figures).all()).to(torch.float32)  # () 1.0: skip this update
        if self._streak is None:
            self._streak, self._skipped = torch.zeros_like(bad), torch.zeros_like(bad)
        self.optimizer.found_inf = bad  # read by the fused kernel: 1.0 leaves everything
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        self.scheduler.step()
        self._streak.add_(bad).mul_(bad)  # +1 on a skip, 0 after a step
        self._skipped.add_(bad)
        return UpdateResult(figures)

    def check(self, state: TrainState) -> None:
        """The device-side finite checks since the last call, read (one read): log the skipped
        updates, and stop after ``train.max_nonfinite`` consecutive ones. Nothing to do when
        the checks were made on the host."""
        if self._streak is None:
            return
        streak, skipped = (int(v) for v in torch.stack([self._streak, self._skipped]).tolist())
        state.nonfinite = streak
        if skipped > self._reported:
            log.warning(
                "non-finite loss or gradient: %d update(s) skipped by update %d (%d skipped in "
                "all, %d consecutive now; the learning-rate schedule moved on over them)",
                skipped - self._reported, state.step, skipped, streak,
            )  # fmt: skip
            self._reported = skipped
        _stop_after(streak, self.tc.max_nonfinite)

    def _skip(self, state: TrainState, loss_finite: bool) -> None:
        """Drop a non-finite update (fp16: lower the loss scale); stop after too many.

        An fp16 gradient overflow with a finite loss is how the loss scale calibrates itself
        (as in fairseq): it does not count towards ``train.max_nonfinite``, whose 10 would
        otherwise stop a run before its scale had come down from 2^16 to 2^6. A streak of them
        is bounded by the scale's floor instead, ``train.min_loss_scale`` (30 in a row from
        2^16 to the default 1e-4), which ends a run whose gradients overflow at every scale.
        A non-finite loss counts, in fp16 too."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.tc.precision == "fp16":
            self.scaler.update()  # the dynamic loss scale backs off
            self._check_loss_scale(state, loss_finite)
            if loss_finite:
                return
        state.nonfinite += 1
        log.warning(
            "non-finite %s at update %d: update skipped (%d consecutive)",
            "gradient" if loss_finite else "loss",
            state.step + 1,
            state.nonfinite,
        )
        _stop_after(state.nonfinite, self.tc.max_nonfinite)

    def _check_loss_scale(self, state: TrainState, loss_finite: bool) -> None:
        """fp16, after a skipped update lowered the loss scale: count the overflow streak, log
        it (a WARNING from :data:`OVERFLOW_WARNING` in a row), and stop once the scale is below
        ``train.min_loss_scale``."""
        self.overflows += 1
        scale = float(self.scaler.get_scale())
        floor = self.tc.min_loss_scale
        if scale < floor:
            raise LossScaleError(
                f"fp16: the loss scale fell to {scale:.3g}, below train.min_loss_scale={floor:g}, "
                f"after {self.overflows} consecutive updates with an overflowing gradient (update "
                f"{state.step + 1}); stopping. The loss is probably exploding: try "
                "train.precision=bf16 (or fp32), a lower learning rate (train.lr / train.factor), "
                "or gradient clipping (train.clip_norm)."
            )
        level = logging.WARNING if self.overflows >= OVERFLOW_WARNING else logging.INFO
        log.log(
            level, "fp16 %s at update %d: update skipped, loss scale lowered to %g (%d "
            "consecutive overflow(s); train.min_loss_scale=%g stops the run)",
            "gradient overflow" if loss_finite else "non-finite loss", state.step + 1, scale,
            self.overflows, floor,
        )  # fmt: skip


def _stop_after(streak: int, limit: int) -> None:
    """Stop (NonFiniteError) when ``streak`` consecutive skipped updates reach ``limit``."""
    if streak >= limit:
        raise NonFiniteError(
            f"{streak} consecutive updates had a non-finite loss or gradient "
            f"(train.max_nonfinite={limit}); stopping. Try a lower learning rate "
            "(train.lr / train.factor), train.clip_norm, or precision=fp32."
        )


def _all_finite(flag: torch.Tensor) -> bool:
    """The one read of the device in an update: is the () bool ``flag`` set (step) or not
    (skip)? Kept apart so that the tests can tell it from a read that should not be there."""
    return bool(flag)
